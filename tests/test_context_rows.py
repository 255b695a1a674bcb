"""Long prompt chunks read their cached context from rows copied once per call (context_rows.py), not by gathers.

``paged_attention`` copies the whole-tile part of the cached context of each chunk of at least CONTEXT_MIN_Q query
tokens (steps of at least CONTEXT_MIN_TOKENS tokens, with the step's rows usable) into contiguous rows, which the
kernel reads by TMA. The values are the cache's and the tiles keep their order, so the output must not change. On
the CPU the Triton interpreter runs it in float16 (bf16 is broken there).
"""

import importlib

import pytest
import torch
from models import make_model, random_prompts
from test_fp8_kernels import fp8_batch
from test_kernels import DEVICE, make_batch
from test_step_kv import SMALL_PREFILL, step_rows

import hfpaged
from hfpaged.kernels import paged_attention, paged_attention_reference
from hfpaged.kernels.context_rows import context_capacity, copy_context_rows
from hfpaged.kernels.paged_attention import context_rows_dtype, paged_attention_with_config

pa = importlib.import_module("hfpaged.kernels.paged_attention")

# decode rows, an empty sequence, a fresh prompt, chunks after a cached context (one past the capacity below)
Q_LENS = [40, 1, 37, 0, 50, 20, 24]
SEQ_LENS = [40, 33, 81, 12, 120, 100, 60]


def small_batch(q_lens=Q_LENS, seq_lens=SEQ_LENS, **kwargs):
    return make_batch(q_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8,
                      dtype=torch.float16, table_tail="minus1", **kwargs)  # fmt: skip


@pytest.mark.parametrize("search_block", [64, 4], ids=["one-pass", "chunked"])
def test_copied_rows_are_the_cached_context(search_block):
    batch = small_batch()
    k_cache, v_cache, tables = batch["k_cache"], batch["v_cache"], batch["block_tables"]
    k_rows, v_rows, offsets = copy_context_rows(
        k_cache, v_cache, tables, batch["seq_lens"], batch["cu_seqlens_q"], capacity=96, tile_n=16, min_q=20,
        search_block=search_block,
    )  # fmt: skip
    # chunks of >= 20 tokens with >= one whole tile of context: b=2 (44 cached -> 32 rows), b=4 (70 -> 64 rows);
    # b=5 (80 -> 80 rows) would end past the 96 rows; b=6 (36 cached) follows it, so gets none either
    assert offsets.tolist() == [-1, -1, 0, -1, 32, -1, -1]
    for b, first, rows in ((2, 0, 32), (4, 32, 64)):
        pos = torch.arange(rows)
        blocks = tables[b, pos // 8].long()
        assert torch.equal(k_rows[first : first + rows], k_cache[blocks, pos % 8])
        assert torch.equal(v_rows[first : first + rows], v_cache[blocks, pos % 8])


def test_capacity_is_a_whole_number_of_tiles_within_the_byte_cap():
    batch = small_batch()
    k_cache, v_cache = batch["k_cache"], batch["v_cache"]  # 2 heads x (32 + 32) x 2 bytes = 256 bytes a row
    half = torch.float16
    # the longest sequence plus twice the step's tokens, whole tiles
    assert context_capacity(100, 60, k_cache, v_cache, 16, 1 << 20, half) == 256
    assert context_capacity(100, 5000, k_cache, v_cache, 16, 1 << 22, half) == 5200
    assert context_capacity(1000, 0, k_cache, v_cache, 16, 256 * 100, half) == 96  # 100 rows' bytes -> 96
    assert context_capacity(1000, 0, k_cache, v_cache, 16, 256 * 100, torch.float32) == 48  # rows twice as wide
    assert context_capacity(4, 3, k_cache, v_cache, 16, 1 << 20, half) == 0
    with pytest.raises(ValueError, match="capacity must be a positive multiple of tile_n=16, got 40"):
        copy_context_rows(k_cache, v_cache, batch["block_tables"], batch["seq_lens"], batch["cu_seqlens_q"],
                          capacity=40, tile_n=16, min_q=1, search_block=64)  # fmt: skip


def test_context_rows_give_the_gathered_result(monkeypatch):
    batch = small_batch()
    key, value = step_rows(batch, Q_LENS, SEQ_LENS)
    kwargs = dict(scale=32**-0.5, config=SMALL_PREFILL)
    gathered = paged_attention_with_config(**batch, **kwargs)
    with_rows = paged_attention_with_config(**batch, step_kv=(key, value), context_rows=96, context_min_q=20, **kwargs)
    assert torch.equal(with_rows, gathered)  # the same values in the same tile order
    ref = paged_attention_reference(**batch, scale=32**-0.5)
    torch.testing.assert_close(with_rows.float(), ref.float(), rtol=2e-3, atol=2e-3)

    # the rows are read: zeroed copies change exactly the sequences that have rows
    def zeroed(*args, **kw):
        k_rows, v_rows, offsets = copy_context_rows(*args, **kw)
        return torch.zeros_like(k_rows), torch.zeros_like(v_rows), offsets

    monkeypatch.setattr(pa, "copy_context_rows", zeroed)
    zeros = paged_attention_with_config(**batch, step_kv=(key, value), context_rows=96, context_min_q=20, **kwargs)
    cu = batch["cu_seqlens_q"].tolist()
    for b in range(len(Q_LENS)):
        changed = not torch.equal(zeros[cu[b] : cu[b + 1]], gathered[cu[b] : cu[b + 1]])
        assert changed == (b in (2, 4)), f"sequence {b}"


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
def test_fp8_caches_copy_whole_sequences(fmt, q_dtype, monkeypatch):
    # fp8 caches: the step's rows are not the stored (quantized) keys, so the rows cover every whole tile of the
    # sequence, its own just stored keys included; the kernel converts them as it converts gathered tiles
    batch, _ = fp8_batch(Q_LENS, SEQ_LENS, fmt, q_dtype, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8)
    k_cache, v_cache, tables = batch["k_cache"], batch["v_cache"], batch["block_tables"]
    rows_dtype = context_rows_dtype(q_dtype, fmt)
    assert rows_dtype == (torch.float16 if q_dtype == torch.float16 else torch.float32)
    k_rows, v_rows, offsets = copy_context_rows(
        k_cache, v_cache, tables, batch["seq_lens"], batch["cu_seqlens_q"], capacity=192, tile_n=16, min_q=20,
        search_block=64, whole_sequence=True, rows_dtype=rows_dtype,
    )  # fmt: skip
    # b=0 (40 keys -> 32 rows), b=2 (81 -> 80 rows); b=4 (120 -> 112 rows) would end past the 192 rows
    assert offsets.tolist() == [0, -1, 32, -1, -1, -1, -1]
    for b, first, rows in ((0, 0, 32), (2, 32, 80)):
        pos = torch.arange(rows)
        blocks = tables[b, pos // 8].long()
        # converted once, exactly (every fp8 value is a 16-bit float)
        assert torch.equal(k_rows[first : first + rows], k_cache[blocks, pos % 8].to(rows_dtype))
        assert torch.equal(v_rows[first : first + rows], v_cache[blocks, pos % 8].to(rows_dtype))
    assert context_rows_dtype(torch.bfloat16, fmt) == torch.float16  # bf16 queries dot fp8 tiles in fp16
    assert context_rows_dtype(torch.bfloat16, torch.bfloat16) == torch.bfloat16
    step_kv = tuple(torch.zeros(sum(Q_LENS), 2, 32, dtype=q_dtype) for _ in range(2))  # unquantized: never read
    kwargs = dict(scale=32**-0.5, config=SMALL_PREFILL)
    gathered = paged_attention_with_config(**batch, **kwargs)
    with_rows = paged_attention_with_config(**batch, step_kv=step_kv, context_rows=192, context_min_q=20, **kwargs)
    if q_dtype == torch.float16:
        assert torch.equal(with_rows, gathered)
    else:  # float32 dots of the same values, the keys' tile laid out otherwise: the interpreter's summation order
        torch.testing.assert_close(with_rows, gathered, rtol=1e-5, atol=1e-6)

    def zeroed(*args, **kw):
        k_rows, v_rows, offsets = copy_context_rows(*args, **kw)
        return torch.zeros_like(k_rows), torch.zeros_like(v_rows), offsets

    monkeypatch.setattr(pa, "copy_context_rows", zeroed)
    zeros = paged_attention_with_config(**batch, step_kv=step_kv, context_rows=192, context_min_q=20, **kwargs)
    cu = batch["cu_seqlens_q"].tolist()
    for b in range(len(Q_LENS)):
        changed = not torch.equal(zeros[cu[b] : cu[b + 1]], gathered[cu[b] : cu[b + 1]])
        assert changed == (b in (0, 2)), f"sequence {b}"


def test_context_rows_with_softcap_and_not_with_a_window(monkeypatch):
    batch = small_batch()
    key, value = step_rows(batch, Q_LENS, SEQ_LENS)
    calls = []
    monkeypatch.setattr(pa, "copy_context_rows", lambda *a, **k: calls.append(1) or copy_context_rows(*a, **k))
    for extra in (dict(softcap=3.0), dict(sliding_window=30)):
        kwargs = dict(scale=32**-0.5, config=SMALL_PREFILL, **extra)
        gathered = paged_attention_with_config(**batch, **kwargs)
        out = paged_attention_with_config(**batch, step_kv=(key, value), context_rows=96, context_min_q=20, **kwargs)
        assert torch.equal(out, gathered)
        ref = paged_attention_reference(**batch, scale=32**-0.5, **{k: v for k, v in extra.items()})
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-3, atol=2e-3)
    assert calls == [1]  # with a window the context stays gathered: no copy


def test_public_paged_attention_copies_the_context_of_long_steps(monkeypatch):
    # a chunk of 200 tokens after 100 cached, beside a decode row; the thresholds lowered to this size
    q_lens, seq_lens = [200, 1], [300, 30]
    batch = make_batch(q_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                       dtype=torch.float16, table_tail="minus1")  # fmt: skip
    key, value = step_rows(batch, q_lens, seq_lens)
    hints = dict(max_seqlen_q=200, max_seqlen_k=300)
    offsets = []
    monkeypatch.setattr(pa, "copy_context_rows", lambda *a, **k: offsets.append(copy_context_rows(*a, **k)[2]) or (
        copy_context_rows(*a, **k)))  # fmt: skip
    plain = paged_attention(**batch, scale=32**-0.5, key=key, value=value, **hints)
    assert not offsets  # 201 tokens: under CONTEXT_MIN_TOKENS
    monkeypatch.setattr(pa, "CONTEXT_MIN_TOKENS", 128)
    monkeypatch.setattr(pa, "CONTEXT_MIN_Q", 64)
    monkeypatch.setattr(pa, "CONTEXT_MIN_RUN", 0)  # runs of any length
    out = paged_attention(**batch, scale=32**-0.5, key=key, value=value, **hints)
    assert [o.tolist() for o in offsets] == [[0, -1]]
    assert torch.equal(out, plain)
    # 16-bit caches copy only for steps with a run of at least CONTEXT_MIN_RUN (the hint says); fp8 caches always
    monkeypatch.setattr(pa, "CONTEXT_MIN_RUN", 201)
    offsets.clear()
    assert torch.equal(paged_attention(**batch, scale=32**-0.5, key=key, value=value, **hints), plain)
    assert not offsets
    assert torch.equal(paged_attention(**batch, scale=32**-0.5, key=key, value=value, max_seqlen_q=201,
                                       max_seqlen_k=300), plain)  # fmt: skip
    assert len(offsets) == 1
    scale = torch.tensor([0.02])
    fp8 = {name: (batch[name].float() / scale).to(torch.float8_e4m3fn) for name in ("k_cache", "v_cache")}
    offsets.clear()
    paged_attention(**{**batch, **fp8}, scale=32**-0.5, key=key, value=value, k_scale=scale, v_scale=scale, **hints)
    assert len(offsets) == 1


def spy_on_copies(monkeypatch) -> list[torch.Tensor]:
    """The offsets of every copy ``paged_attention`` makes from now on."""
    copied = []

    def spy(*args, **kwargs):
        out = copy_context_rows(*args, **kwargs)
        copied.append(out[2])
        return out

    monkeypatch.setattr(pa, "copy_context_rows", spy)
    return copied


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_engine_copies_context_rows_and_keeps_its_tokens(kv_cache_dtype, monkeypatch):
    # fp16 model, Triton kernels (interpreted), prompts chunked over several steps with the thresholds lowered:
    # chunks after the first read their context (fp8 caches: all their keys) from copied rows; the greedy tokens
    # equal those without the copy
    prompts = random_prompts([200, 90, 7], seed=11)
    results = []
    copied = spy_on_copies(monkeypatch)
    monkeypatch.setattr(pa, "CONTEXT_MIN_Q", 32)
    monkeypatch.setattr(pa, "CONTEXT_MIN_RUN", 0)  # runs of any length
    for min_tokens in (64, 1 << 30):
        monkeypatch.setattr(pa, "CONTEXT_MIN_TOKENS", min_tokens)
        model = make_model("qwen3", num_hidden_layers=1, dtype=torch.float16)
        hfpaged.patch(model, num_blocks=64, block_size=8, attention_backend="triton", max_num_batched_tokens=96,
                      async_scheduling=False, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
        got = [o.token_ids for o in model.generate_many(prompts, max_new_tokens=4, do_sample=False)]
        if len(results) == 0:
            assert any((o >= 0).any() for o in copied), "no chunk read copied context rows"
            copied.clear()
        # a prompt sharing the first 160 tokens of the first one: a prefix-cache hit, its 100 new tokens one chunk
        # that reads the cached 160 (from rows, with the copy on)
        hits = hfpaged.stats(model)["prefix_cache_hits"]
        got += [o.token_ids for o in model.generate_many([prompts[0][:160] + prompts[1][:100]], max_new_tokens=4,
                                                         do_sample=False)]  # fmt: skip
        assert hfpaged.stats(model)["prefix_cache_hits"] - hits == 160
        assert any((o >= 0).any() for o in copied) == (len(results) == 0)
        copied.clear()
        st = hfpaged.stats(model)
        assert st["num_free_blocks"] == st["num_blocks"]
        results.append(got)
    assert results[0] == results[1]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_context_rows_under_preemption(mode, monkeypatch):
    # a pool too small for the three sequences at once: preempted requests are prefilled again in chunks (their
    # context re-read from recomputed or swapped-in blocks); the tokens equal those without the copy
    from hfpaged.kernels import attention_config

    prompts = random_prompts([150, 130, 110], seed=12)
    monkeypatch.setattr(pa, "CONTEXT_MIN_Q", 16)
    monkeypatch.setattr(pa, "CONTEXT_MIN_RUN", 0)  # runs of any length
    # 32-key prompt tiles for these 16-dim heads (64 by default): the chunks of this small pool hold whole tiles
    monkeypatch.setattr(attention_config, "SMALL_HEAD_PROMPT_TILE", (64, 32, 4, 2))
    copied = spy_on_copies(monkeypatch)
    results = []
    for min_tokens in (32, 1 << 30):
        monkeypatch.setattr(pa, "CONTEXT_MIN_TOKENS", min_tokens)
        model = make_model("qwen3", num_hidden_layers=1, dtype=torch.float16)
        hfpaged.patch(model, num_blocks=32, block_size=8, attention_backend="triton", preemption_mode=mode,
                      max_num_batched_tokens=96, async_scheduling=False)  # fmt: skip
        results.append([o.token_ids for o in model.generate_many(prompts, max_new_tokens=40, do_sample=False)])
        st = hfpaged.stats(model)
        assert st["num_preemptions"] > 0 and st["num_free_blocks"] == st["num_blocks"]
        assert any((o >= 0).any() for o in copied) == (len(results) == 1)
        copied.clear()
    assert results[0] == results[1]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "q_lens,seq_lens", [([4096], [6144]), ([1, 3000, 1, 700, 2048], [900, 5000, 2000, 1500, 2048])]
)
def test_gpu_bf16_context_rows(q_lens, seq_lens):
    # Qwen3's heads; chunks after 2-4k cached tokens beside decode rows and a fresh prompt, through the public API
    batch = make_batch(q_lens, seq_lens, num_heads=16, num_kv_heads=8, head_dim=128, block_size=16,
                       dtype=torch.bfloat16, table_tail="minus1")  # fmt: skip
    key, value = step_rows(batch, q_lens, seq_lens)
    kwargs = dict(scale=128**-0.5, max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens))
    assert sum(q_lens) >= pa.CONTEXT_MIN_TOKENS
    out = paged_attention(**batch, key=key, value=value, **kwargs)
    torch.testing.assert_close(out, paged_attention(**batch, **kwargs), rtol=0, atol=0)  # same values, same math
    ref = paged_attention_reference(**batch, scale=128**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = paged_attention(**batch, key=key, value=value, **kwargs)
    graph.replay()
    torch.testing.assert_close(captured, out, rtol=0, atol=0)
    assert DEVICE.type == "cuda"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_gpu_fp8_context_rows(fmt, monkeypatch):
    # bf16 queries over an fp8 cache (dots in fp16): a fresh prompt, a chunk after 2k cached keys, decode rows; the
    # rows of the whole sequences give the gathered result bitwise, also replayed from a CUDA graph
    q_lens, seq_lens = [3000, 1, 2048, 1], [5000, 900, 2048, 3000]
    batch, _ = fp8_batch(q_lens, seq_lens, fmt, torch.bfloat16, num_heads=16, num_kv_heads=8, head_dim=128,
                         block_size=16, table_tail="minus1")  # fmt: skip
    step_kv = tuple(torch.zeros(sum(q_lens), 8, 128, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    kwargs = dict(scale=128**-0.5, max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens))
    assert sum(q_lens) >= pa.CONTEXT_MIN_TOKENS
    copied = spy_on_copies(monkeypatch)
    out = paged_attention(**batch, key=step_kv[0], value=step_kv[1], **kwargs)
    assert [o.tolist() for o in copied] == [[0, -1, 4992, -1]]  # 5000 -> 4992 rows, then 2048 rows
    torch.testing.assert_close(out, paged_attention(**batch, **kwargs), rtol=0, atol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = paged_attention(**batch, key=step_kv[0], value=step_kv[1], **kwargs)
    graph.replay()
    torch.testing.assert_close(captured, out, rtol=0, atol=0)


@pytest.mark.slow
def test_context_rows_with_overlapped_steps_callers_and_changed_weights(monkeypatch):
    # overlapped (async) steps, two callers at once sharing the engine's steps, then a weight changed in place and
    # a second round: the tokens with the copy equal those without it, call for call
    from test_concurrency import run_threads

    calls = [random_prompts([200, 40, 110], seed=21), random_prompts([180, 9], seed=22)]
    monkeypatch.setattr(pa, "CONTEXT_MIN_Q", 32)
    monkeypatch.setattr(pa, "CONTEXT_MIN_RUN", 0)  # runs of any length
    copied = spy_on_copies(monkeypatch)
    results = []
    for min_tokens in (64, 1 << 30):
        monkeypatch.setattr(pa, "CONTEXT_MIN_TOKENS", min_tokens)
        model = make_model("qwen3", num_hidden_layers=1, dtype=torch.float16)
        hfpaged.patch(model, num_blocks=96, block_size=8, attention_backend="triton", max_num_batched_tokens=96,
                      async_scheduling=True)  # fmt: skip
        got = []
        for _ in range(2):
            outs = [None] * len(calls)

            def caller(i, model=model, outs=outs):
                def run():
                    outs[i] = [o.token_ids for o in model.generate_many(calls[i], max_new_tokens=6, do_sample=False)]

                return run

            run_threads(*(caller(i) for i in range(len(calls))))
            got.append(outs)
            with torch.no_grad():
                model.model.layers[0].self_attn.k_proj.weight.mul_(-1.5)  # in place: the next round's keys change
        st = hfpaged.stats(model)
        assert st["num_free_blocks"] == st["num_blocks"]
        assert got[0] != got[1], "the changed weight changed nothing"
        assert any((o >= 0).any() for o in copied) == (min_tokens == 64)
        copied.clear()
        results.append(got)
    assert results[0] == results[1]
