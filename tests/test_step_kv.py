"""Prompt chunks read the keys computed in their own step from the step's rows (TMA), not through the block table.

``paged_attention(..., key=, value=)`` takes the step's keys and values as ``store_kv`` just stored them; unmasked
tiles wholly past a sequence's cached context then load whole boxes of those rows. The values are the cache's, so
the output must not change. On the CPU the Triton interpreter runs it in float16 (bf16 is broken there).
"""

import importlib

import pytest
import torch
from models import make_model, random_prompts
from test_kernels import DEVICE, make_batch

import hfpaged
from hfpaged.kernels import paged_attention, paged_attention_reference
from hfpaged.kernels.attention_config import AttentionConfig
from hfpaged.kernels.paged_attention import paged_attention_with_config, step_kv_usable

SMALL_PREFILL = AttentionConfig(block_m=32, tile_n=16, num_warps=4, num_stages=2)


def step_rows(batch, q_lens, seq_lens, strided=True):
    """The step's own keys/values [T, kv_heads, D]: the last q_len positions of each sequence, read from the cache
    (as the model computed them before store_kv); ``strided``: as the engine passes them, views of [1, H, T, D]."""
    k_cache, v_cache, tables = batch["k_cache"], batch["v_cache"], batch["block_tables"]
    block_size = k_cache.shape[1]
    keys, values = [], []
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        pos = torch.arange(seq_len - q_len, seq_len, device=k_cache.device)
        blocks = tables[b, pos // block_size].long()
        keys.append(k_cache[blocks, pos % block_size])
        values.append(v_cache[blocks, pos % block_size])
    key, value = torch.cat(keys), torch.cat(values)
    if strided:
        key = key.transpose(0, 1).contiguous()[None][0].transpose(0, 1)
        value = value.transpose(0, 1).contiguous()[None][0].transpose(0, 1)
    return key, value


# (q_lens, seq_lens): fresh prompts, a chunk after a cached prefix, decode rows and an empty sequence beside them
STEPS = [
    ([40, 1, 70], [40, 33, 70]),
    ([1, 37, 0, 1], [20, 81, 12, 5]),
    ([64, 20], [64, 100]),
]


@pytest.mark.parametrize("strided", [True, False], ids=["views", "contiguous"])
@pytest.mark.parametrize("q_lens,seq_lens", STEPS)
def test_step_rows_give_the_gathered_result(q_lens, seq_lens, strided):
    batch = make_batch(q_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8,
                       dtype=torch.float16, table_tail="minus1")  # fmt: skip
    key, value = step_rows(batch, q_lens, seq_lens, strided)
    assert step_kv_usable(batch["q"], batch["k_cache"], batch["v_cache"], key, value)
    gathered = paged_attention_with_config(**batch, scale=32**-0.5, config=SMALL_PREFILL)
    with_rows = paged_attention_with_config(**batch, scale=32**-0.5, config=SMALL_PREFILL, step_kv=(key, value))
    torch.testing.assert_close(with_rows, gathered, rtol=1e-3, atol=1e-3)
    ref = paged_attention_reference(**batch, scale=32**-0.5)
    torch.testing.assert_close(with_rows.float(), ref.float(), rtol=2e-3, atol=2e-3)
    # the rows are read: zeroed step keys change the sequences that have whole tiles past their context
    zeros = paged_attention_with_config(
        **batch, scale=32**-0.5, config=SMALL_PREFILL, step_kv=(torch.zeros_like(key), torch.zeros_like(value))
    )
    cu = batch["cu_seqlens_q"].tolist()
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        rows = slice(cu[b], cu[b + 1])
        context = seq_len - q_len
        whole_step_tiles = -(-context // 16) * 16 + 16 <= seq_len - 32  # a full tile past the context, unmasked
        changed = not torch.equal(zeros[rows], gathered[rows])
        if whole_step_tiles:
            assert changed, f"sequence {b}: its step rows were not read"
        if q_len <= 1:
            assert not changed  # decode rows attend through the cache


def test_step_rows_with_window_and_softcap():
    # a sliding window (its edge tiles stay gathered and masked) and a softcap over the step-row tiles
    q_lens, seq_lens = [70, 1, 40], [70, 50, 90]
    batch = make_batch(q_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8,
                       dtype=torch.float16, table_tail="minus1")  # fmt: skip
    key, value = step_rows(batch, q_lens, seq_lens)
    kwargs = dict(scale=32**-0.5, sliding_window=40, softcap=3.0, config=SMALL_PREFILL)
    gathered = paged_attention_with_config(**batch, **kwargs)
    with_rows = paged_attention_with_config(**batch, step_kv=(key, value), **kwargs)
    torch.testing.assert_close(with_rows, gathered, rtol=1e-3, atol=1e-3)
    ref = paged_attention_reference(**batch, scale=32**-0.5, sliding_window=40, softcap=3.0)
    torch.testing.assert_close(with_rows.float(), ref.float(), rtol=2e-3, atol=2e-3)
    zeros = paged_attention_with_config(**batch, step_kv=(key * 0, value * 0), **kwargs)
    assert not torch.equal(zeros[:70], gathered[:70])  # the prompt's interior tiles inside the window were read


def test_public_paged_attention_takes_the_step_rows():
    # the prefill tiles (block_m / 2 positions x 2 heads, tile_n keys): query blocks starting at or past tile_n
    # have whole tiles of the prompt's own keys below them (the diagonal tiles stay masked, through the cache)
    from hfpaged.kernels.paged_attention import config_for_batch

    q_lens, seq_lens = [200, 1], [200, 30]
    batch = make_batch(q_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                       dtype=torch.float16, table_tail="minus1")  # fmt: skip
    key, value = step_rows(batch, q_lens, seq_lens)
    hints = dict(max_seqlen_q=200, max_seqlen_k=200)
    config = config_for_batch(201, 2, 4, torch.float16, batch["k_cache"], batch["v_cache"], **hints)
    block_q = config.block_m // 2
    first = -(-config.tile_n // block_q) * block_q  # the first query block with a whole tile below it
    assert 0 < first < 200
    out = paged_attention(**batch, scale=32**-0.5, key=key, value=value, **hints)
    torch.testing.assert_close(out, paged_attention(**batch, scale=32**-0.5), rtol=1e-3, atol=1e-3)
    wrong = paged_attention(**batch, scale=32**-0.5, key=key * 0, value=value * 0, **hints)
    assert torch.equal(wrong[:first], out[:first]) and not torch.equal(wrong[first:200], out[first:200])
    assert torch.equal(wrong[200:], out[200:])  # the decode row


def test_step_rows_are_ignored_where_they_cannot_serve():
    # float32 (no 16-bit TMA path), a 96-wide head (not one power-of-two box), misaligned rows: gathered as before
    for dtype, head_dim, offset in ((torch.float32, 32, 0), (torch.float16, 96, 0), (torch.float16, 32, 1)):
        batch = make_batch([40], [40], num_heads=2, num_kv_heads=1, head_dim=head_dim, block_size=8, dtype=dtype,
                           table_tail="minus1")  # fmt: skip
        key, value = step_rows(batch, [40], [40], strided=False)
        key, value = torch.zeros_like(key), torch.zeros_like(value)  # read, they would change the output
        if offset:  # a view starting one element in: its base is not 16-byte aligned
            key = key.new_zeros(key.numel() + 1)[offset:].view_as(key)
        assert not step_kv_usable(batch["q"], batch["k_cache"], batch["v_cache"], key, value)
        out = paged_attention_with_config(**batch, scale=0.2, config=SMALL_PREFILL, step_kv=(key, value))
        assert torch.equal(out, paged_attention_with_config(**batch, scale=0.2, config=SMALL_PREFILL))


def test_step_rows_errors():
    batch = make_batch([40], [40], num_heads=2, num_kv_heads=1, head_dim=32, block_size=8, dtype=torch.float16,
                       table_tail="minus1")  # fmt: skip
    key, value = step_rows(batch, [40], [40])
    with pytest.raises(ValueError, match="key and value go together"):
        paged_attention(**batch, scale=0.2, key=key)
    with pytest.raises(ValueError, match=r"value must be \[40, 1, 32\] torch.float16 .* got \[39, 1, 32\]"):
        paged_attention(**batch, scale=0.2, key=key, value=value[:39])


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens,seq_lens", [([4096], [4096]), ([1, 3000, 1, 700], [900, 3000, 2000, 1500])])
def test_gpu_bf16_step_rows(q_lens, seq_lens):
    batch = make_batch(q_lens, seq_lens, num_heads=16, num_kv_heads=8, head_dim=128, block_size=16,
                       dtype=torch.bfloat16, table_tail="minus1")  # fmt: skip
    key, value = step_rows(batch, q_lens, seq_lens)
    kwargs = dict(scale=128**-0.5, max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens))
    out = paged_attention(**batch, key=key, value=value, **kwargs)
    torch.testing.assert_close(out, paged_attention(**batch, **kwargs), rtol=0, atol=0)  # same values, same math
    ref = paged_attention_reference(**batch, scale=128**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    # in a CUDA graph (the mixed steps' graphs capture it with the step's rows at fixed addresses)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = paged_attention(**batch, key=key, value=value, **kwargs)
    graph.replay()
    torch.testing.assert_close(captured, out, rtol=0, atol=0)
    assert DEVICE.type == "cuda"


def test_engine_passes_the_step_rows_and_keeps_its_tokens(monkeypatch):
    # fp16 model, Triton kernels (interpreted): prompt steps hand their keys to the kernel, which reads them by TMA;
    # the greedy tokens equal those of the gathered path (step rows refused), prompts chunked over several steps
    pa = importlib.import_module("hfpaged.kernels.paged_attention")
    prompts = random_prompts([150, 90, 7], seed=11)
    results, built = [], []
    original = pa._step_descriptor
    monkeypatch.setattr(pa, "_step_descriptor", lambda t, n: built.append(n) or original(t, n))
    for usable in (pa.step_kv_usable, lambda *args: False):
        monkeypatch.setattr(pa, "step_kv_usable", usable)
        model = make_model("qwen3", num_hidden_layers=2, dtype=torch.float16)
        hfpaged.patch(model, num_blocks=64, block_size=8, attention_backend="triton", max_num_batched_tokens=128,
                      async_scheduling=False)  # fmt: skip
        results.append([o.token_ids for o in model.generate_many(prompts, max_new_tokens=4, do_sample=False)])
        if not results[1:]:
            assert built, "no prompt step read its own rows"
            built.clear()
    assert not built
    assert results[0] == results[1]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_step_rows_under_preemption(mode, monkeypatch):
    # a pool too small for the three sequences at once: requests are preempted (recomputed or swapped out and back)
    # and their prompts prefilled again; the tokens still equal the gathered path's
    pa = importlib.import_module("hfpaged.kernels.paged_attention")
    prompts = random_prompts([70, 60, 50], seed=12)
    results = []
    for usable in (pa.step_kv_usable, lambda *args: False):
        monkeypatch.setattr(pa, "step_kv_usable", usable)
        model = make_model("qwen3", num_hidden_layers=2, dtype=torch.float16)
        hfpaged.patch(model, num_blocks=20, block_size=8, attention_backend="triton", preemption_mode=mode,
                      async_scheduling=False)  # fmt: skip
        results.append([o.token_ids for o in model.generate_many(prompts, max_new_tokens=40, do_sample=False)])
        st = hfpaged.stats(model)
        assert st["num_preemptions"] > 0 and st["num_free_blocks"] == st["num_blocks"]
    assert results[0] == results[1]
