"""The CUDA decode kernel for fp8 caches (kernels/fp8_decode.py): decode steps whose batch fills the GPU without
splitting the context run it instead of the Triton kernel. Checked on the GPU against a float64 reference over the
dequantized cache, against the Triton kernel, against ``store_kv``'s bytes, under CUDA graphs, and in the engine;
the routing (what stays on Triton) is checked too. On the CPU: only that nothing routes there."""

import sys
import warnings

import pytest
import torch
from models import make_model, random_prompts
from test_fp8_kernels import FMT_IDS, FORMATS, captured_attention, fp8_batch, reference64
from test_kernels import assert_close

import hfpaged
from hfpaged.kernels import attention_config as ac
from hfpaged.kernels import fp8_decode as fd
from hfpaged.kernels import paged_attention, store_kv

pa = sys.modules["hfpaged.kernels.paged_attention"]


class Calls(list):
    """Whether each call routed to the CUDA kernel stored the step's K/V; ``splits``: each one's context splits."""

    splits: list[int]


@pytest.fixture
def cuda_calls(monkeypatch):
    """Count the calls ``paged_attention`` routes to the CUDA kernel."""
    calls = Calls()
    calls.splits = []
    real = pa.fp8_decode

    def counting(*args, **kwargs):
        calls.append(kwargs.get("store") is not None)
        calls.splits.append(kwargs["split"][3] if kwargs.get("split") is not None else 1)
        return real(*args, **kwargs)

    monkeypatch.setattr(pa, "fp8_decode", counting)
    monkeypatch.setattr(fd, "USE_CUDA_FP8_DECODE", True)
    return calls


def decode_batch(fmt, dtype, num_seqs=48, num_heads=16, num_kv_heads=8, head_dim=128, block_size=16, seed=0):
    """One query token per sequence over context lengths with partial tiles, 1-key sequences, long ones; NaN in
    every cache slot past a sequence's end and in spare blocks (make_batch), so a read past the end shows."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [1, 2, 15, 16, 17, 33, 100, 257, 1000] + torch.randint(1, 700, (num_seqs - 9,), generator=gen).tolist()
    batch, _ = fp8_batch([1] * num_seqs, seq_lens, fmt, dtype, num_heads=num_heads, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, block_size=block_size, table_tail="minus1", seed=seed)  # fmt: skip
    return batch, dict(scale=head_dim**-0.5, max_seqlen_q=1, max_seqlen_k=max(seq_lens))


SHAPES = [  # (num_heads, num_kv_heads, head_dim, block_size)
    (16, 8, 128, 16),  # Qwen3-0.6B
    (32, 8, 64, 16),  # Llama-3.2-1B
    (64, 8, 128, 32),  # group 8, larger blocks
    (8, 8, 128, 16),  # group 1
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{h}-{kv}x{d}-bs{b}" for h, kv, d, b in SHAPES])
def test_gpu_decode_matches_reference_and_triton(cuda_calls, monkeypatch, shape, fmt, dtype):
    num_heads, num_kv_heads, head_dim, block_size = shape
    batch, kwargs = decode_batch(fmt, dtype, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                 block_size=block_size)  # fmt: skip
    out = paged_attention(**batch, **kwargs)
    assert cuda_calls == [False]
    ref = reference64(batch, scale=kwargs["scale"])
    assert_close(out, ref.to(dtype), dtype)
    monkeypatch.setattr(fd, "USE_CUDA_FP8_DECODE", False)
    triton = paged_attention(**batch, **kwargs)
    assert len(cuda_calls) == 1
    # the same math in another summation order: far closer to each other than either is to float64
    assert float((out.double() - triton.double()).norm() / triton.double().norm()) < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=["slots64", "slots32"])
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_gpu_fused_store_writes_store_kv_bytes(cuda_calls, fmt, slot_dtype):
    batch, kwargs = decode_batch(fmt, torch.bfloat16)
    num_seqs, block_size = batch["q"].shape[0], batch["k_cache"].shape[1]
    key = torch.randn(num_seqs, 8, 128, device="cuda").to(torch.bfloat16) * 3
    value = torch.randn(num_seqs, 8, 128, device="cuda").to(torch.bfloat16)
    slots = []  # each sequence's last position; every fifth stores nothing (-1)
    for b, n in enumerate(batch["seq_lens"].tolist()):
        block = int(batch["block_tables"][b, (n - 1) // block_size])
        slots.append(-1 if b % 5 == 2 else block * block_size + (n - 1) % block_size)
    slots = torch.tensor(slots, dtype=slot_dtype, device="cuda")
    expected = {name: batch[name].clone() for name in ("k_cache", "v_cache")}
    store_kv(key, value, expected["k_cache"], expected["v_cache"], slots, k_scale=batch["k_scale"],
             v_scale=batch["v_scale"])  # fmt: skip
    out = paged_attention(**batch, **kwargs, key=key, value=value, slot_mapping=slots)
    assert cuda_calls == [True]
    for name in ("k_cache", "v_cache"):
        assert torch.equal(batch[name].view(torch.uint8), expected[name].view(torch.uint8))
    assert_close(out, reference64(batch, scale=kwargs["scale"]).to(torch.bfloat16), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_graph_replay_reads_scales_lengths_and_tables_at_replay(cuda_calls):
    static, kwargs = decode_batch(torch.float8_e4m3fn, torch.bfloat16, seed=1)
    kwargs["max_seqlen_k"] = 4096
    graph, out = captured_attention(static, kwargs)
    assert len(cuda_calls) == 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    for k_scale, v_scale in ((0.5, 2.0), (0.01, 0.3)):
        # written after capture, as the engine's step inputs and calibration are: the sequences in reverse order
        # (block-table rows and lengths), each shortened by up to 20 keys, new queries, new scales
        lens = static["seq_lens"].flip(0)
        short = torch.randint(0, 21, lens.shape, device="cuda", generator=gen, dtype=lens.dtype)
        static["seq_lens"].copy_((lens - short).clamp_min(1))
        static["block_tables"].copy_(static["block_tables"].flip(0))
        static["q"].normal_(generator=gen)
        static["k_scale"].fill_(k_scale)
        static["v_scale"].fill_(v_scale)
        graph.replay()
        assert_close(out, reference64(static, scale=kwargs["scale"]).to(torch.bfloat16), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_gpu_a_non_finite_query_stays_in_its_row(cuda_calls, bad):
    batch, kwargs = decode_batch(torch.float8_e4m3fn, torch.bfloat16)
    q = batch["q"].float() * 1e5  # past fp16's range: every row needs the rescale
    q[6, 3, 17] = bad
    batch["q"] = q.to(torch.bfloat16)
    out = paged_attention(**batch, **kwargs)
    assert cuda_calls == [False]
    ref = reference64(batch, scale=kwargs["scale"])
    finite = torch.ones(ref.shape[:2], dtype=torch.bool)
    finite[6, 3] = False
    assert not out[6, 3].isfinite().all()
    assert_close(out[finite], ref[finite].to(torch.bfloat16), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "change",
    ["window", "softcap", "sinks", "fp32_queries", "group_16", "head_dim_96", "switched_off"],
)
def test_gpu_what_stays_on_triton(cuda_calls, monkeypatch, change):
    shape = dict(num_heads=16, num_kv_heads=8, head_dim=128)
    dtype, extra = torch.bfloat16, {}
    if change == "fp32_queries":
        dtype = torch.float32
    elif change == "group_16":
        shape.update(num_heads=128)
    elif change == "head_dim_96":
        shape.update(head_dim=96)
    elif change == "window":
        extra = dict(sliding_window=64)
    elif change == "softcap":
        extra = dict(softcap=30.0)
    elif change == "sinks":
        extra = dict(sinks=torch.randn(shape["num_heads"], device="cuda"))
    elif change == "switched_off":
        monkeypatch.setattr(fd, "USE_CUDA_FP8_DECODE", False)
    batch, kwargs = decode_batch(torch.float8_e4m3fn, dtype, **shape)
    out = paged_attention(**batch, **kwargs, **extra)
    assert cuda_calls == []
    assert_close(out, reference64(batch, scale=kwargs["scale"], **extra).to(dtype), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("seq_lens", [[3000, 90, 1500, 8000], [700] * 12, [20000, 1]], ids=["mixed", "mid", "long"])
def test_gpu_split_context_with_fused_store(cuda_calls, seq_lens):
    # few sequences: the context is split over several CTAs per sequence (flash-decoding) and merged by the Triton
    # merge kernel; the CTA whose share holds the last key stores the step's row
    batch, _ = fp8_batch([1] * len(seq_lens), seq_lens, torch.float8_e4m3fn, torch.bfloat16, num_heads=16,
                         num_kv_heads=8, head_dim=128, block_size=16, table_tail="minus1")  # fmt: skip
    kwargs = dict(scale=128**-0.5, max_seqlen_q=1, max_seqlen_k=max(seq_lens))
    key = torch.randn(len(seq_lens), 8, 128, device="cuda").to(torch.bfloat16)
    value = torch.randn(len(seq_lens), 8, 128, device="cuda").to(torch.bfloat16)
    slots = torch.tensor(
        [int(batch["block_tables"][b, (n - 1) // 16]) * 16 + (n - 1) % 16 for b, n in enumerate(seq_lens)],
        device="cuda",
    )
    expected = {name: batch[name].clone() for name in ("k_cache", "v_cache")}
    store_kv(key, value, expected["k_cache"], expected["v_cache"], slots, k_scale=batch["k_scale"],
             v_scale=batch["v_scale"])  # fmt: skip
    out = paged_attention(**batch, **kwargs, key=key, value=value, slot_mapping=slots)
    assert cuda_calls == [True]
    # the CUDA kernel's own split rule (attention_config.CUDA_FP8_CTAS_PER_SM), not the Triton kernel's
    config = pa.config_for_batch(len(seq_lens), len(seq_lens), 16, torch.bfloat16, batch["k_cache"],
                                 batch["v_cache"], 1, max(seq_lens), cuda_fp8_decode=True)  # fmt: skip
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    assert (
        cuda_calls.splits
        == [config.num_splits]
        == [ac.cuda_fp8_split_count(len(seq_lens) * 8, max(seq_lens), sm_count)]
    )
    assert config.num_splits > 1 and config.min_split_tiles * config.tile_n == ac.CUDA_FP8_MIN_SPLIT_KEYS
    for name in ("k_cache", "v_cache"):
        assert torch.equal(batch[name].view(torch.uint8), expected[name].view(torch.uint8))
    assert_close(out, reference64(batch, scale=kwargs["scale"]).to(torch.bfloat16), torch.bfloat16)


def test_a_variant_that_cannot_be_built_warns_once_and_stays_on_triton(monkeypatch):
    # an NVRTC too old for the GPU, or a cubin the driver refuses: the step runs Triton, not an error at every step
    batch, _ = fp8_batch([1] * 4, [5, 17, 33, 2], torch.float8_e4m3fn, torch.float16, num_heads=4, num_kv_heads=2,
                         head_dim=64, block_size=16)  # fmt: skip
    q, k_cache, v_cache = (batch[name].cpu() for name in ("q", "k_cache", "v_cache"))
    attempts = []

    def failing(device, **variant):
        attempts.append(variant)
        raise RuntimeError("NVRTC could not compile the fp8 decode kernel: unsupported arch")

    monkeypatch.setattr(fd, "available", lambda device: True)
    monkeypatch.setattr(fd, "get_kernel", failing)
    monkeypatch.setattr(fd, "_FAILED", set())
    monkeypatch.setattr(fd, "USE_CUDA_FP8_DECODE", True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    kwargs = dict(sliding_window=None, softcap=None, sinks=None, store=True)
    with pytest.warns(RuntimeWarning, match="could not be built .*unsupported arch.* run the Triton kernel"):
        assert not fd.fp8_decode_usable(q, k_cache, v_cache, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not fd.fp8_decode_usable(q, k_cache, v_cache, **kwargs)
    assert len(attempts) == 1


def test_cpu_never_routes_to_the_cuda_kernel(cuda_calls):
    batch, _ = fp8_batch([1] * 4, [5, 17, 33, 2], torch.float8_e4m3fn, torch.float32, num_heads=4, num_kv_heads=2,
                         head_dim=64, block_size=16)  # fmt: skip
    cpu = batch["q"].cpu()
    assert not fd.available(cpu.device)
    usable = fd.fp8_decode_usable(cpu, batch["k_cache"].cpu(), batch["v_cache"].cpu(), sliding_window=None,
                                  softcap=None, sinks=None)  # fmt: skip
    assert not usable


@pytest.mark.gpu
def test_gpu_engine_decode_steps_run_it_eager_and_graphed_alike(cuda_calls):
    # a small batch: its decode steps split the context (flash-decoding), the CUDA kernel then the merge
    model = make_model("qwen3", dtype=torch.bfloat16, head_dim=64, num_key_value_heads=2).cuda()
    prompts = random_prompts([4, 12, 30, 50, 7, 21, 9, 16, 40, 3], seed=3)
    runs = {}
    for name, options in (("eager", dict(enforce_eager=True)), ("graphs", dict(compile=False))):
        hfpaged.patch(model, num_blocks=128, block_size=16, kv_cache_dtype="fp8", **options)
        cuda_calls.clear()
        runs[name] = [r.token_ids for r in model.generate_many(prompts, max_new_tokens=24, do_sample=False)]
        assert cuda_calls, f"{name}: no decode step ran the CUDA kernel"
        assert (model._hfpaged.engine.runner.num_graph_steps > 0) == (name == "graphs")
    assert runs["graphs"] == runs["eager"]
