"""Fresh prompts (no cached context) on Hopper: the warp-specialized Gluon kernel (kernels/prompt_gluon.py).

A prompt launch of ``paged_attention`` with the step's own rows hands the sequences whose keys are all in the step
to the Gluon kernel and the Triton launch skips them (``SKIP_FRESH``). The CPU checks the split (the Triton launch
leaves exactly those rows alone), the conditions, and that the kernel compiles for sm_90 with the installed Triton;
the GPU checks its output against the Triton kernel's, under CUDA graphs, beside the next sequence's inf/NaN values,
and the engine's tokens.
"""

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from models import make_model, random_prompts
from test_kernels import make_batch
from test_step_kv import step_rows

import hfpaged
from hfpaged.kernels import paged_attention, paged_attention_reference, prompt_gluon
from hfpaged.kernels.attention_config import AttentionConfig
from hfpaged.kernels.paged_attention import paged_attention_with_config

paged_attention_module = importlib.import_module("hfpaged.kernels.paged_attention")  # the function shadows it
CUDA = torch.cuda.is_available()
HOPPER = CUDA and torch.cuda.get_device_capability() == (9, 0)
# (q_lens, seq_lens): fresh prompts (seq_len == q_len) beside a chunk after a cached prefix and decode rows
MIXED = ([40, 1, 70, 0, 33], [40, 33, 90, 12, 33])


def test_the_triton_launch_leaves_fresh_sequences_to_the_gluon_kernel(monkeypatch):
    # stand-in for the Gluon kernel: writes 7.0 into every row of a fresh sequence; the Triton launch must leave
    # exactly those rows alone and compute the others as without the split
    q_lens, seq_lens = MIXED
    batch = make_batch(q_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8,
                       dtype=torch.float16, table_tail="minus1")  # fmt: skip
    key, value = step_rows(batch, q_lens, seq_lens)
    config = AttentionConfig(block_m=32, tile_n=16, num_warps=4, num_stages=2)
    whole = paged_attention_with_config(**batch, scale=32**-0.5, config=config, step_kv=(key, value))
    calls = []

    def fake_fresh(q, key_, value_, seq_lens_, cu_seqlens_q, out, *, scale):
        calls.append(scale)
        starts = cu_seqlens_q.tolist()
        for b, n in enumerate(seq_lens_.tolist()):
            if n == starts[b + 1] - starts[b]:
                out[starts[b] : starts[b + 1]] = 7.0
        return True

    monkeypatch.setattr(paged_attention_module, "fresh_prompts_usable", lambda *a, **k: True)
    monkeypatch.setattr(paged_attention_module, "attend_fresh_prompts", fake_fresh)
    split = paged_attention_with_config(**batch, scale=32**-0.5, config=config, step_kv=(key, value))
    assert calls == [32**-0.5]
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        rows = slice(starts[b], starts[b + 1])
        if q_len == seq_len:
            assert bool((split[rows] == 7.0).all()), f"sequence {b}: the Triton launch wrote a fresh prompt's rows"
        else:
            assert torch.equal(split[rows], whole[rows]), f"sequence {b}"


def test_fresh_prompts_usable_says_no_where_the_kernel_cannot_serve():
    q_lens, seq_lens = [300], [300]
    batch = make_batch(q_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=128, block_size=16,
                       dtype=torch.float16, table_tail="minus1")  # fmt: skip
    key, value = step_rows(batch, q_lens, seq_lens)
    q, k_cache, v_cache = batch["q"], batch["k_cache"], batch["v_cache"]
    out = torch.empty_like(q)
    base = dict(sliding_window=None, softcap=None, sinks=None, block_m=128, tile_n=128, one_query=False, num_splits=1)

    def usable(**changes):
        return prompt_gluon.fresh_prompts_usable(q, k_cache, v_cache, key, value, out, **{**base, **changes})

    assert not usable()  # not a CUDA tensor here (on the GPU: see test_gpu_fresh_prompts_match_the_triton_kernel)
    for changes in ({"block_m": 64}, {"tile_n": 32}, {"num_splits": 2}, {"one_query": True}, {"sliding_window": 64},
                    {"softcap": 30.0}, {"sinks": torch.zeros(4)}):  # fmt: skip
        assert not usable(**changes), changes
    assert not prompt_gluon.fresh_prompts_usable(q, k_cache, v_cache, None, None, out, **base)


@pytest.mark.skipif(not prompt_gluon.HAVE_GLUON, reason="this Triton has no Gluon Hopper API")
def test_the_gluon_kernel_compiles_for_hopper_without_spills():
    # compiled for sm_90 on this machine (no GPU needed: a stand-in driver reports an H100), with the installed
    # Triton: the API the kernel uses exists, it fits in shared memory and its registers do not spill
    script = textwrap.dedent("""
        import os, re, subprocess, tempfile
        os.environ.pop("TRITON_INTERPRET", None)
        import torch, triton
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.driver import CudaDriver
        from triton.runtime.driver import driver

        class Hopper(CudaDriver):
            def __init__(self):
                self.utils = None
                self.launcher_cls = None
            @staticmethod
            def is_active():
                return True
            def get_current_target(self):
                return GPUTarget("cuda", 90, 32)
            def get_current_device(self):
                return 0
            def get_current_stream(self, device=None):
                return 0
            def get_active_torch_device(self):
                return torch.device("cpu")
            def get_device_interface(self):
                return torch.cuda

        driver.set_active(Hopper())
        from hfpaged.kernels import prompt_gluon as pg
        kernels = []
        real = pg._fresh_prompt_kernel
        class Compile:
            def __getitem__(self, grid):
                return lambda *a, **k: kernels.append(real.warmup(*a, grid=grid, **k))
        pg._fresh_prompt_kernel = Compile()
        q = torch.zeros(300, 16, 128, dtype=torch.bfloat16)
        kv = torch.zeros(8, 300, 128, dtype=torch.bfloat16).transpose(0, 1)  # the engine's views
        pg.attend_fresh_prompts(q, kv, kv, torch.tensor([300], dtype=torch.int32),
                                torch.tensor([0, 300], dtype=torch.int32), torch.empty_like(q), scale=0.088)
        (kernel,) = kernels
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        print("RESULT", kernel.metadata.shared, len(re.findall(r"\\b(STL|LDL)\\b", sass)),
              len(re.findall(r"HGMMA", sass)))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    shared, spills, mmas = (int(x) for x in lines[0].split()[1:])
    assert shared <= 227 * 1024, f"{shared} bytes of shared memory: more than an H100 block may use"
    assert spills == 0, f"{spills} spill instructions"
    assert mmas > 0


def test_a_gluon_kernel_that_fails_to_launch_turns_itself_off(monkeypatch):
    # (another Triton whose Gluon cannot compile it): a warning, nothing written, and the Triton kernel does every
    # sequence from then on
    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("no such Gluon API")

            return launch

    monkeypatch.setattr(prompt_gluon, "_fresh_prompt_kernel", Broken())
    monkeypatch.setattr(prompt_gluon, "ENABLED", True)
    q = torch.zeros(300, 4, 128, dtype=torch.float16)
    kv = torch.zeros(300, 2, 128, dtype=torch.float16)
    out = torch.full_like(q, 3.0)
    lens, cu = torch.tensor([300], dtype=torch.int32), torch.tensor([0, 300], dtype=torch.int32)
    with pytest.warns(UserWarning, match="the Gluon prompt kernel is off"):
        assert prompt_gluon.attend_fresh_prompts(q, kv, kv, lens, cu, out, scale=0.1) is False
    assert not prompt_gluon.ENABLED and bool((out == 3.0).all())


# ---- on the GPU ----------------------------------------------------------------------------------------------------

GPU_STEPS = [
    ([2048], [2048]),  # one prompt, whole tiles
    ([1, 7, 128, 129, 300, 1700], [1, 7, 128, 129, 300, 1700]),  # fresh prompts, partial diagonal tiles
    ([1, 1600, 700, 1, 333], [900, 1600, 1200, 40, 333]),  # decode rows, a chunk after 500 cached, fresh ones
    # 150 sequences (the kernels' sequence search goes chunk by chunk), an empty one, short fresh prompts, one long
    ([0] + [1 + i % 37 for i in range(148)] + [1600], [5] + [1 + i % 37 + (i % 3) * 20 for i in range(148)] + [1600]),
]


def _gpu_batch(q_lens, seq_lens, heads, kv_heads, dtype, seed=0):
    batch = make_batch(q_lens, seq_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=128, block_size=16,
                       dtype=dtype, table_tail="minus1", seed=seed)  # fmt: skip
    key, value = step_rows(batch, q_lens, seq_lens)
    return batch, key, value


def _attention(batch, key, value, gluon: bool, monkeypatch):
    monkeypatch.setattr(prompt_gluon, "ENABLED", gluon)
    hints = batch.setdefault("hints", {})  # host integers, read once (not during a graph capture)
    if not hints:
        q_lens = (batch["cu_seqlens_q"][1:] - batch["cu_seqlens_q"][:-1]).tolist()
        hints.update(max_seqlen_q=max(q_lens), max_seqlen_k=int(batch["seq_lens"].max()))
    tensors = {k: v for k, v in batch.items() if k != "hints"}
    return paged_attention(**tensors, scale=128**-0.5, key=key, value=value, **hints)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads,kv_heads", [(16, 8), (32, 8), (8, 8)])
@pytest.mark.parametrize("q_lens,seq_lens", GPU_STEPS)
def test_gpu_fresh_prompts_match_the_triton_kernel(q_lens, seq_lens, heads, kv_heads, dtype, monkeypatch):
    batch, key, value = _gpu_batch(q_lens, seq_lens, heads, kv_heads, dtype)
    calls = []
    real = paged_attention_module.attend_fresh_prompts
    monkeypatch.setattr(
        paged_attention_module, "attend_fresh_prompts", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1]
    )
    triton_only = _attention(batch, key, value, False, monkeypatch)
    with_gluon = _attention(batch, key, value, True, monkeypatch)
    assert calls == [True], "the Gluon kernel did not run"
    tensors = {k: v.float() if v.is_floating_point() else v for k, v in batch.items() if k != "hints"}
    ref = paged_attention_reference(**tensors, scale=128**-0.5)
    err_triton = (triton_only.float() - ref).abs().max().item()
    err_gluon = (with_gluon.float() - ref).abs().max().item()
    assert torch.isfinite(with_gluon).all()
    assert err_gluon <= max(1.5 * err_triton, 1e-3), (err_gluon, err_triton)
    torch.testing.assert_close(with_gluon, triton_only, rtol=0, atol=2 * err_triton + 1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_gpu_fresh_prompts_ignore_the_next_sequences_values(poison, dtype, monkeypatch):
    # a fresh prompt whose last tile runs into the next sequence's rows: inf/NaN values there must not reach it
    q_lens = seq_lens = [200, 150]
    batch, key, value = _gpu_batch(q_lens, seq_lens, 16, 8, dtype)
    clean = _attention(batch, key, value, True, monkeypatch)[:200].clone()
    value[200:] = poison
    key[200:] = poison
    dirty = _attention(batch, key, value, True, monkeypatch)
    assert torch.equal(dirty[:200], clean)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_gpu_fresh_prompts_replay_from_a_cuda_graph(monkeypatch):
    q_lens, seq_lens = GPU_STEPS[2]
    batch, key, value = _gpu_batch(q_lens, seq_lens, 16, 8, torch.bfloat16)
    eager = _attention(batch, key, value, True, monkeypatch)
    out = torch.empty_like(eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(_attention(batch, key, value, True, monkeypatch))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    # new inputs in the same buffers: the replay reads them
    batch["q"].copy_(torch.randn_like(batch["q"]))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, _attention(batch, key, value, True, monkeypatch))


def gluon_kernel_on_and_off(monkeypatch, model, prompts, **options):
    """The call's sequences' tokens without the Gluon kernel and with it (a patch each: a fresh pool, so no prefix
    hit of the first run turns a prompt into a continuation), and the second run's stats; checks the kernel ran
    in exactly the run it was on for."""
    calls, results = [], {}
    real = paged_attention_module.attend_fresh_prompts
    monkeypatch.setattr(
        paged_attention_module, "attend_fresh_prompts", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1]
    )
    for gluon in (False, True):
        monkeypatch.setattr(prompt_gluon, "ENABLED", gluon)
        hfpaged.patch(model, **options)
        try:
            outs = model.generate_many(prompts)
            stats = hfpaged.stats(model)
        finally:
            hfpaged.unpatch(model)
        results[gluon] = [[s.token_ids for s in r.sequences] for r in outs]
        assert bool(calls) == gluon and all(calls), "the Gluon kernel ran where it should not, or not where it should"
    return results, stats


def gpu_qwen3_128():
    return make_model("qwen3", dtype=torch.bfloat16, head_dim=128, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096).cuda()  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("options", [{"enforce_eager": True}, {}], ids=["eager", "graphs"])
def test_gpu_engine_tokens_with_the_gluon_kernel(options, monkeypatch):
    # bf16, 128-dim heads, prompts long enough for the long prompt tile: greedy tokens with and without the kernel
    # (eager steps, or CUDA graphs with compiled layers, captured by a patch per setting)
    prompts = [dict(prompt=p, max_new_tokens=12, do_sample=False) for p in random_prompts([1800, 2100, 40], seed=3)]
    results, _ = gluon_kernel_on_and_off(monkeypatch, gpu_qwen3_128(), prompts, **options)
    assert results[True] == results[False]


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_gpu_engine_tokens_with_the_gluon_kernel_under_chunking_prefix_hits_and_preemption(mode, monkeypatch):
    # prompts longer than a step (first chunk fresh: Gluon; second after a cached context: Triton), prompts sharing
    # a long prefix (prefix-cache hits: Triton), a pool too small for all (preempted prompts prefill again), beams and
    # parallel samples beside greedy: the tokens with the kernel equal those without (its outputs are bitwise the
    # Triton kernel's, so any difference is a row given to the wrong kernel)
    base = random_prompts([2400, 1700, 1600, 700, 90, 5], seed=8)
    prompts = [*base, base[1][:1600] + base[5], base[0][:2000] + base[4][:40]]  # prefix hits on base[1], base[0]
    settings = [dict(max_new_tokens=64, do_sample=False)] * len(prompts)
    settings[3] = dict(max_new_tokens=10, do_sample=False, num_beams=2)
    settings[4] = dict(max_new_tokens=10, do_sample=True, seed=4, num_return_sequences=2)
    # (240 blocks: the two longest prompts fit together but not their 64 new tokens; the same pool preempts on the
    # CPU, float32, with and without async scheduling)
    results, stats = gluon_kernel_on_and_off(
        monkeypatch,
        gpu_qwen3_128(),
        [{"prompt": p, **kw} for p, kw in zip(prompts, settings)],
        block_size=16,
        num_blocks=240,
        max_num_batched_tokens=2048,
        preemption_mode=mode,
    )
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert results[True] == results[False]
