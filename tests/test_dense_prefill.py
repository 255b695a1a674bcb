"""Long prefill chunks attended through torch SDPA (hfpaged/model/dense_prefill.py) instead of the paged kernel.

On the GPU this is cuDNN's fused attention for 16-bit models (``dense_prefill_tokens`` None: chunks of 2,048+
tokens); here the threshold is set low so that the tiny models' prompts take the path, and every result is held
against the paged reference (kernel level) or stock ``generate`` (engine level).
"""

import pytest
import torch
from models import make_model, random_prompts, reference_generate

import hfpaged
from hfpaged.core.scheduler_output import ScheduledRequest
from hfpaged.kernels import paged_attention
from hfpaged.kernels.reference import paged_attention_reference, store_kv_reference
from hfpaged.model import dense_prefill


def _scheduled(*chunks):
    return [ScheduledRequest(f"r{i}", start, n, True) for i, (start, n) in enumerate(chunks)]


def test_plan_takes_long_chunks_whose_padding_is_cheap():
    # (start = keys before the chunk, tokens of the chunk); q_start accumulates over every sequence
    steps = _scheduled((40, 1), (0, 8), (0, 3), (4, 8), (20, 8), (0, 12))
    assert dense_prefill.plan(steps, 8) == [(1, 1, 0, 8), (3, 12, 4, 8), (5, 28, 0, 12)]
    # (20 + 8)^2 = 784 > 1.5 * (2 * 20 * 8 + 64) = 576: 20 zero query rows in front of 8 real ones cost too much
    assert dense_prefill.plan(steps, 0) == []
    assert dense_prefill.plan(steps, 13) == []
    many = _scheduled(*[(0, 4)] * (dense_prefill.MAX_SEQS + 3))
    assert len(dense_prefill.plan(many, 4)) == dense_prefill.MAX_SEQS  # the rest stay paged


def test_threshold_defaults_to_cuda_16_bit_models_only():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert dense_prefill.resolve_min_tokens(None, cuda, [torch.bfloat16, torch.float16]) == 2048
    assert dense_prefill.resolve_min_tokens(None, cuda, [torch.bfloat16, torch.float32]) == 0
    assert dense_prefill.resolve_min_tokens(None, cpu, [torch.bfloat16]) == 0
    assert dense_prefill.resolve_min_tokens(5, cpu, [torch.float32]) == 5
    assert dense_prefill.resolve_min_tokens(0, cuda, [torch.bfloat16]) == 0
    with pytest.raises(ValueError, match="dense_prefill_tokens must be None or an int >= 0, got -1"):
        hfpaged.EngineConfig(dense_prefill_tokens=-1)


def _batch(q_lens, seq_lens, cache_dtype, seed=0, heads=4, kv_heads=2, dim=16, block_size=4):
    """A packed step already stored in a shuffled paged cache: (q, key, value, caches, tables, lens, cu, scales)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(-(-s // block_size) for s in seq_lens)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    scales = {}
    if cache_dtype == torch.float8_e4m3fn:
        scales = {"k_scale": torch.tensor([0.02]), "v_scale": torch.tensor([0.03])}
    step_keys, step_values = [], []
    for b, seq_len in enumerate(seq_lens):
        n = -(-seq_len // block_size)
        tables[b, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
        keys = torch.randn(seq_len, kv_heads, dim, generator=g)
        values = torch.randn(seq_len, kv_heads, dim, generator=g)
        slots = tables[b, torch.arange(seq_len) // block_size].long() * block_size + torch.arange(seq_len) % block_size
        store_kv_reference(keys, values, k_cache, v_cache, slots, **scales)
        step_keys.append(keys[seq_len - q_lens[b] :])
        step_values.append(values[seq_len - q_lens[b] :])
    q = torch.randn(sum(q_lens), heads, dim, generator=g)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return q, torch.cat(step_keys), torch.cat(step_values), k_cache, v_cache, tables, lens, cu, scales


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("paged", ["reference", "triton"])
def test_attend_matches_paged_attention_of_the_whole_step(cache_dtype, paged, layout, monkeypatch):
    monkeypatch.setattr(dense_prefill, "_LAYOUT", layout)
    # sequences: a decode row, a fresh chunk, a chunk with 5 keys before it (padded queries), a short chunk left
    # to the paged kernel; the planned ones skip the paged kernel (seq_len 0 there) and come back from SDPA
    q_lens, seq_lens = [1, 11, 9, 3], [14, 11, 14, 7]
    q, key, value, k_cache, v_cache, tables, lens, cu, scales = _batch(q_lens, seq_lens, cache_dtype)
    scale = 16**-0.5
    expected = paged_attention_reference(q, k_cache, v_cache, tables, lens, cu, scale=scale, **scales)
    entries = dense_prefill.plan(_scheduled(*[(s - n, n) for n, s in zip(q_lens, seq_lens)]), 8)
    assert entries == [(1, 1, 0, 11), (2, 12, 5, 9)]
    paged_fn = paged_attention_reference if paged == "reference" else paged_attention
    out = dense_prefill.attend(
        entries, paged_fn, q, key, value, k_cache, v_cache, tables, lens, cu, scale=scale,
        max_seqlen_q=11, max_seqlen_k=14, **scales,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # every sequence planned: no paged launch at all
    entries = [(0, 0, 0, 11)]
    one = _batch([11], [11], cache_dtype, seed=1)
    out = dense_prefill.attend(entries, None, one[0], *one[1:8], scale=scale, **one[8])
    expected = paged_attention_reference(one[0], *one[3:8], scale=scale, **one[8])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_paged_kernels_skip_sequences_of_length_zero():
    q, _, _, k_cache, v_cache, tables, lens, cu, _ = _batch([1, 6, 2], [9, 6, 5], torch.float32, seed=2)
    skipped = lens.index_fill(0, torch.tensor([1]), 0)
    expected = paged_attention_reference(q, k_cache, v_cache, tables, lens, cu, scale=0.25)
    for fn in (paged_attention_reference, paged_attention):
        out = fn(q, k_cache, v_cache, tables, skipped, cu, scale=0.25, max_seqlen_q=6, max_seqlen_k=9)
        keep = torch.tensor([0, 7, 8])  # the rows of sequences 0 and 2
        torch.testing.assert_close(out[keep], expected[keep], rtol=1e-5, atol=1e-5)


def _patched(model, **options):
    hfpaged.patch(
        model, num_blocks=96, block_size=4, async_scheduling=False, compile_cache_dir="",
        **{"dense_prefill_tokens": 6, **options},
    )  # fmt: skip
    return hfpaged.Engine(model).core.runner


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_engine_with_dense_prefill_equals_stock_generate(backend):
    # fresh prompts, prompts chunked over several steps (max_num_batched_tokens 16: later chunks have context
    # and pad their queries), short prompts that stay paged, and a second round whose prompts hit the prefix cache
    model = make_model("qwen3", num_hidden_layers=2)
    prompts = random_prompts([13, 30, 4, 9, 21], seed=3)
    expected = reference_generate(model, prompts, max_new_tokens=6, do_sample=False)
    runner = _patched(model, attention_backend=backend, max_num_batched_tokens=16)
    assert runner.dense_min_tokens == 6
    outputs = model.generate_many(prompts, max_new_tokens=6, do_sample=False)
    assert [o.token_ids for o in outputs] == expected
    assert runner.num_dense_steps > 0
    again = model.generate_many(prompts[:2], max_new_tokens=6, do_sample=False)  # prefix-cache hits
    assert [o.token_ids for o in again] == expected[:2]
    st = hfpaged.stats(model)
    assert st["num_free_blocks"] == st["num_blocks"]


def test_engine_with_dense_prefill_and_fp8_cache_matches_the_paged_path():
    # fp8: the planned chunks attend over the values the cache holds, as the paged kernel does
    prompts = random_prompts([17, 9, 25], seed=4)
    results = []
    for tokens in (0, 6):
        model = make_model("llama", num_hidden_layers=2)
        _patched(model, dense_prefill_tokens=tokens, kv_cache_dtype="fp8", kv_cache_scales=0.05)
        outputs = model.generate_many(prompts, max_new_tokens=5, do_sample=False)
        results.append([o.token_ids for o in outputs])
    assert results[0] == results[1]


def test_dense_prefill_off_leaves_every_step_paged():
    model = make_model("llama", num_hidden_layers=2)
    prompts = random_prompts([17, 9], seed=5)
    expected = reference_generate(model, prompts, max_new_tokens=3, do_sample=False)
    runner = _patched(model, dense_prefill_tokens=0)
    assert [o.token_ids for o in model.generate_many(prompts, max_new_tokens=3, do_sample=False)] == expected
    assert runner.num_dense_steps == 0


# --- GPU: cuDNN / FlashAttention through SDPA, the compiled layers outside the graphs -------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])  # gemma2: softcap and windows stay paged
def test_gpu_float32_engine_with_dense_prefill_equals_stock_generate(arch, enforce_eager):
    # eager steps hand their long chunks to SDPA; with CUDA graphs every step here fits a graph and stays paged
    model = make_model(arch).cuda()
    prompts = random_prompts([40, 150, 9, 300, 77, 3], seed=7)
    expected = reference_generate(model, prompts, max_new_tokens=12, do_sample=False)
    hfpaged.patch(
        model, num_blocks=160, block_size=8, max_num_batched_tokens=128, dense_prefill_tokens=32,
        enforce_eager=enforce_eager,
    )  # fmt: skip
    runner = hfpaged.Engine(model).core.runner
    outputs = model.generate_many(prompts, max_new_tokens=12, do_sample=False)
    assert [o.token_ids for o in outputs] == expected
    if enforce_eager:
        assert runner.num_dense_steps > 0 and runner.num_graph_steps == 0
    else:
        assert runner.num_dense_steps == 0 and runner.num_graph_steps > 0
    again = model.generate_many(prompts[:2], max_new_tokens=12, do_sample=False)  # prefix hits: chunks with context
    assert [o.token_ids for o in again] == expected[:2]
    st = hfpaged.stats(model)
    assert st["num_free_blocks"] == st["num_blocks"]


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_bf16_attend_on_qwen3_heads(cache_dtype):
    # the engine's shapes (16 query / 8 KV heads of 128) in bf16: a decode row, a fresh 1,100-token chunk, a
    # 700-token chunk after 300 cached keys, a short chunk; against the float32 reference of the whole step
    q_lens, seq_lens = [1, 1100, 700, 20], [900, 1100, 1000, 50]
    batch = _batch(q_lens, seq_lens, torch.float32, heads=16, kv_heads=8, dim=128, block_size=16)
    q, key, value, k_cache, v_cache, tables, lens, cu, _ = batch
    scales = {}
    if cache_dtype == torch.float8_e4m3fn:
        scales = {"k_scale": torch.tensor([0.05]).cuda(), "v_scale": torch.tensor([0.05]).cuda()}
        k_cache, v_cache = (k_cache / 0.05).to(cache_dtype), (v_cache / 0.05).to(cache_dtype)  # within e4m3
    cuda = [t.cuda() for t in (q, key, value, k_cache, v_cache, tables, lens, cu)]
    q, key, value, k_cache, v_cache, tables, lens, cu = cuda
    key, value = key.bfloat16(), value.bfloat16()  # the step's own keys (fp8: read back from the cache instead)
    if cache_dtype == torch.bfloat16:
        k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    q16 = q.bfloat16()
    entries = dense_prefill.plan(_scheduled(*[(s - n, n) for n, s in zip(q_lens, seq_lens)]), 256)
    assert [e[0] for e in entries] == [1, 2]
    out = dense_prefill.attend(
        entries, paged_attention, q16, key, value, k_cache, v_cache, tables, lens, cu, scale=128**-0.5,
        max_seqlen_q=1100, max_seqlen_k=1100, **scales,
    )  # fmt: skip
    expected = paged_attention_reference(q16.float(), k_cache, v_cache, tables, lens, cu, scale=128**-0.5, **scales)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
