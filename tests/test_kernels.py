"""Triton kernels (hfpaged.kernels) against the torch reference in hfpaged.attention.

Without CUDA the kernels run in Triton's interpreter (fp32/fp16 only: bf16 is broken there) at
small sizes; with CUDA the same cases also run in bf16, plus the `gpu`-marked large cases.
"""

import importlib

import pytest
import torch

from hfpaged.kernels import paged_attention, paged_attention_reference, store_kv, store_kv_reference
from hfpaged.kernels.attention_config import AttentionConfig
from hfpaged.kernels.paged_attention import paged_attention_with_config

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def _cdiv(a, b):
    return -(-a // b)


def make_batch(
    q_lens,
    seq_lens,
    *,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    dtype,
    head_dim_v=None,
    table_tail="poison",
    q_view=True,
    seed=0,
):
    """A packed batch over a shuffled, NaN-poisoned paged cache.

    Slots past each sequence's length and spare blocks hold NaN; block-table entries past a
    sequence's blocks are -1 (table_tail="minus1") or ids of NaN blocks ("poison"), so any read
    the kernel should not make shows up in the output.
    """
    gen = torch.Generator().manual_seed(seed)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    needed = [_cdiv(s, block_size) for s in seq_lens]
    num_spare = 3
    num_blocks = sum(needed) + num_spare
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim_v, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(needed, default=0) + 2
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    spare = perm[sum(needed) :]
    k_cache[spare] = float("nan")
    v_cache[spare] = float("nan")
    start = 0
    for b, (seq_len, n) in enumerate(zip(seq_lens, needed)):
        ids = perm[start : start + n]
        start += n
        block_tables[b, :n] = ids.int()
        if table_tail == "poison":
            block_tables[b, n:] = spare[torch.randint(0, num_spare, (max_blocks - n,), generator=gen)].int()
        if n and seq_len % block_size:
            k_cache[ids[-1], seq_len % block_size :] = float("nan")
            v_cache[ids[-1], seq_len % block_size :] = float("nan")
    cu = [0]
    for q_len in q_lens:
        cu.append(cu[-1] + q_len)
    num_tokens = cu[-1]
    if q_view:  # what the engine passes: query[0].transpose(0, 1) of a [1, H, T, D] tensor
        q = torch.randn(1, num_heads, num_tokens, head_dim, generator=gen)[0].transpose(0, 1)
    else:
        q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    to = dict(device=DEVICE)
    return dict(
        q=q.to(dtype=dtype, **to),
        k_cache=k_cache.to(dtype=dtype, **to),
        v_cache=v_cache.to(dtype=dtype, **to),
        block_tables=block_tables.to(**to),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, **to),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, **to),
    )


def assert_close(out, ref, dtype):
    tol = TOLERANCE[dtype]
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), f"NaN in {int(out.isnan().sum())} output elements"
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    rel = (out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)
    assert rel < tol, f"relative error {rel:.2e} over {tol:.0e}"


def poisoned_out(batch):
    q, v_cache = batch["q"], batch["v_cache"]
    return torch.full((q.shape[0], q.shape[1], v_cache.shape[3]), float("nan"), dtype=q.dtype, device=q.device)


# (id, q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, window, softcap)
CASES = [
    ("decode_ragged", [1, 1, 1, 1], [1, 9, 33, 70], 4, 2, 64, 16, torch.float32, None, None),
    ("decode_gqa8_hd96_bs8", [1, 1, 1], [5, 30, 64], 8, 1, 96, 8, torch.float16, None, None),
    ("prefill_mha_bs32", [1, 20, 45], [1, 20, 45], 4, 4, 64, 32, torch.float32, None, None),
    ("chunk_after_prefix_hd128", [8, 17], [40, 60], 4, 2, 128, 16, torch.float16, None, None),
    ("mixed_empty_group3_window", [1, 0, 30, 5, 1], [25, 10, 30, 50, 3], 6, 2, 64, 8, torch.float32, 16, None),
    ("window_softcap_hd256_bs64", [1, 24], [50, 24], 2, 1, 256, 64, torch.float16, 9, 4.0),
    ("mixed_softcap_bs64", [3, 1, 12], [3, 70, 40], 4, 2, 64, 64, torch.float32, None, 2.0),
]
CASE_DTYPES = [None, torch.bfloat16] if CUDA else [None]


def case_batch(case, dtype_override=None, **overrides):
    """(batch, attention kwargs, dtype) of a ``CASES`` entry; ``overrides`` go to make_batch (e.g. head_dim_v)."""
    _, q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, window, softcap = case
    dtype = dtype_override or dtype
    batch = make_batch(
        q_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, table_tail="minus1" if CUDA else "poison", **overrides,
    )  # fmt: skip
    return batch, dict(scale=head_dim**-0.5, sliding_window=window, softcap=softcap), dtype


@pytest.mark.parametrize("dtype_override", CASE_DTYPES, ids=lambda d: "bf16" if d else "base")
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_paged_attention_matches_reference(case, dtype_override):
    q_lens, seq_lens = case[1], case[2]
    batch, kwargs, dtype = case_batch(case, dtype_override)
    ref = paged_attention_reference(**batch, **kwargs)
    assert not ref.isnan().any()
    assert_close(paged_attention(**batch, **kwargs), ref, dtype)
    hinted = paged_attention(**batch, **kwargs, max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens))
    assert_close(hinted, ref, dtype)
    # Forced configs: context split in 3 and 4 (16- and 32-key tiles: tiles span blocks when
    # block_size 8) and a wide 64-row tile; each into a NaN-poisoned output, so unwritten rows show.
    configs = (AttentionConfig(16, 16, 4, 1, num_splits=3), AttentionConfig(16, 32, 4, 1, num_splits=4),
               AttentionConfig(64, 32, 4, 1))  # fmt: skip
    for config in configs:
        out = paged_attention_with_config(**batch, **kwargs, config=config, out=poisoned_out(batch))
        assert_close(out, ref, dtype)


class _NaNWorkspaceTorch:
    """Stands in for ``torch`` in paged_attention.py: every torch.empty there (the split workspace) is NaN-filled,
    so a partial the merge reads without the kernel having written it shows in the output."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        return torch.empty(*args, **kwargs).fill_(float("nan"))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_split_min_tiles_leaves_short_contexts_fewer_splits(case, monkeypatch):
    # min_split_tiles > 1: a split covers at least that many tiles, so splits past a short context's keys are empty:
    # they write only "no keys" (max -inf, sum 0) and the merge must not read their (unwritten) accumulators.
    pa_module = importlib.import_module("hfpaged.kernels.paged_attention")  # the package exports the function

    _, q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, window, softcap = case
    batch = make_batch(
        q_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, table_tail="minus1" if CUDA else "poison",
    )  # fmt: skip
    kwargs = dict(scale=head_dim**-0.5, sliding_window=window, softcap=softcap)
    ref = paged_attention_reference(**batch, **kwargs)
    monkeypatch.setattr(pa_module, "torch", _NaNWorkspaceTorch())
    # (splits, min tiles, target programs): with a target the splits are sized from the batch's total keys on the
    # device (3 programs: about one split per sequence and KV head; 40: as many as the grid allows)
    for splits, min_tiles, target in ((8, 2, 0), (5, 3, 0), (16, 1, 0), (3, 64, 0), (8, 1, 3), (6, 2, 40), (4, 1, 1)):
        config = AttentionConfig(
            16, 16, 4, 1, num_splits=splits, min_split_tiles=min_tiles, split_target_programs=target
        )
        out = paged_attention_with_config(**batch, **kwargs, config=config, out=poisoned_out(batch))
        assert_close(out, ref, dtype)


def test_mid_size_decode_batches_get_their_own_tiles_and_split_rule():
    # attention_config.MID_BATCH_SPLITS: decode batches of 0.45-2 programs (sequences x KV heads) per SM; the CPU
    # counts as a 4-SM GPU (so 2-8 programs)
    from hfpaged.kernels import attention_config as ac

    def decode(num_seqs, kv_elem_size=2, num_kv_heads=1, head_dim_pad=128):
        return ac.choose_config(
            num_tokens=num_seqs, num_seqs=num_seqs, num_kv_heads=num_kv_heads, group=2, head_dim_pad=head_dim_pad,
            elem_size=2, kv_elem_size=kv_elem_size, max_seqlen_q=1, max_seqlen_k=8192, device=torch.device("cpu"),
        )  # fmt: skip

    bf16, fp8 = ac.MID_BATCH_SPLITS[2], ac.MID_BATCH_SPLITS[1]
    mid = decode(4)
    assert (mid.tile_n, mid.num_warps, mid.num_stages) == bf16[2]
    assert mid.num_splits == ac.split_count(4, 8192, 4, bf16[3]) > 1
    assert (mid.min_split_tiles, mid.split_target_programs) == (bf16[4], bf16[5] * 4)
    mid8 = decode(4, kv_elem_size=1)
    assert (mid8.tile_n, mid8.num_warps, mid8.num_stages) == fp8[2]
    assert (mid8.min_split_tiles, mid8.split_target_programs) == (fp8[4], fp8[5] * 4)
    assert decode(2, num_kv_heads=2) == mid  # programs, not sequences, pick the rule
    # outside the range, and heads over 128 dims: the default tiles and split rule
    for config, tiles in ((decode(1), ac.DECODE_TILES[2][0]), (decode(9), ac.DECODE_TILES[2][0]),
                          (decode(4, head_dim_pad=256), ac.DECODE_TILES[2][1])):  # fmt: skip
        assert (config.tile_n, config.num_warps, config.num_stages) == tiles
        assert (config.min_split_tiles, config.split_target_programs) == (1, 0)
    assert decode(1).num_splits == ac.split_count(1, 8192, 4)
    assert decode(9).num_splits == 1


def test_cuda_fp8_decode_batches_take_their_own_split_rule():
    # attention_config.CUDA_FP8_CTAS_PER_SM: ~3 CTAs per SM (rounded), splits of at least CUDA_FP8_MIN_SPLIT_KEYS
    # keys; only batches of one query token per sequence (the ones the CUDA kernel runs)
    from hfpaged.kernels import attention_config as ac

    assert ac.CUDA_FP8_CTAS_PER_SM == 3 and ac.CUDA_FP8_MIN_SPLIT_KEYS == 128
    # an H100's 132 SMs: 396 CTAs over the sequences x KV heads
    for programs, splits in ((16, 25), (48, 8), (96, 4), (144, 3), (200, 2), (264, 2), (265, 1), (2048, 1)):
        assert ac.cuda_fp8_split_count(programs, 40960, 132) == splits, programs
    assert ac.cuda_fp8_split_count(16, 300, 132) == 2  # short contexts: at most one split per 128 keys
    assert ac.cuda_fp8_split_count(16, 100, 132) == 1
    assert ac.cuda_fp8_split_count(1, 1 << 20, 132) == ac.MAX_SPLITS

    def decode(num_seqs, num_tokens=None, max_q=1, cuda=True):
        return ac.choose_config(
            num_tokens=num_tokens or num_seqs, num_seqs=num_seqs, num_kv_heads=2, group=2, head_dim_pad=128,
            elem_size=2, kv_elem_size=1, max_seqlen_q=max_q, max_seqlen_k=8192, device=torch.device("cpu"),
            cuda_fp8_decode=cuda,
        )  # fmt: skip

    sms = ac._sm_count(torch.device("cpu"))  # the CPU counts as a 4-SM GPU: 12 CTAs
    for num_seqs in (1, 2, 3, 4, 6, 64):
        config = decode(num_seqs)
        assert config.one_query and config.split_target_programs == 0
        assert config.num_splits == ac.cuda_fp8_split_count(num_seqs * 2, 8192, sms)
        assert config.min_split_tiles * config.tile_n == ac.CUDA_FP8_MIN_SPLIT_KEYS
        # the tiles are the Triton kernel's own choice, should it run the batch instead
        triton = decode(num_seqs, cuda=False)
        assert (config.block_m, config.tile_n, config.num_warps, config.num_stages) == (
            triton.block_m, triton.tile_n, triton.num_warps, triton.num_stages)  # fmt: skip
    assert [decode(n).num_splits for n in (1, 2, 3, 6, 64)] == [6, 3, 2, 1, 1]
    # several query tokens per sequence (or fewer tokens than sequences): the Triton rule, flag or not
    assert decode(2, num_tokens=4, max_q=2) == decode(2, num_tokens=4, max_q=2, cuda=False)


def test_prompt_tiles_by_longest_query_run_and_the_short_prompt_hint():
    # 16-bit queries over heads of <= 128 dims: runs above SHORT_PROMPT_MAX_Q take the long tile, others the short;
    # short_prompt_hint names the hint that picks the short tile only where the two differ
    from hfpaged.kernels import attention_config as ac

    def prompt(max_q, elem_size=2, head_dim_pad=128, group=2):
        return ac.choose_config(
            num_tokens=8192, num_seqs=257, num_kv_heads=8, group=group, head_dim_pad=head_dim_pad, elem_size=elem_size,
            max_seqlen_q=max_q, max_seqlen_k=8192, device=torch.device("cpu"),
        )  # fmt: skip

    def tile(config):
        return (config.block_m, config.tile_n, config.num_warps, config.num_stages)

    limit = ac.SHORT_PROMPT_MAX_Q
    assert tile(prompt(limit + 1)) == tile(prompt(8192)) == ac.LONG_PROMPT_TILE
    assert tile(prompt(limit)) == tile(prompt(100)) == ac.SHORT_PROMPT_TILE != ac.LONG_PROMPT_TILE
    assert tile(prompt(100, group=128))[0] == 128  # one program holds a whole group of query heads
    assert ac.short_prompt_hint(group=2, head_dim_pad=128, elem_size=2) == limit
    assert ac.short_prompt_hint(group=8, head_dim_pad=128, elem_size=2) == limit
    assert tile(prompt(100, head_dim_pad=64)) == tile(prompt(8192, head_dim_pad=64)) == ac.SMALL_HEAD_PROMPT_TILE
    for elem_size, head_dim_pad in ((4, 128), (2, 256), (2, 64)):  # one prompt tile for every run length: no variants
        assert tile(prompt(limit, elem_size, head_dim_pad)) == tile(prompt(8192, elem_size, head_dim_pad))
        assert ac.short_prompt_hint(group=2, head_dim_pad=head_dim_pad, elem_size=elem_size) is None


@pytest.mark.parametrize("fp8", [False, True], ids=["16bit", "fp8"])
def test_mid_size_decode_batch_through_paged_attention(fp8):
    # A decode batch of ~1 program per SM (the CPU counts as 4 SMs) through the public paged_attention: the
    # MID_BATCH_SPLITS tile, several splits sized on the device from the batch's keys, contexts from 40 to 700 keys
    # (the short ones leave splits empty), against the reference; 16-bit queries (fp16 on the CPU, bf16 on CUDA)
    # over a 16-bit or an e4m3 cache.
    from hfpaged.kernels import attention_config as ac

    dtype = torch.bfloat16 if CUDA else torch.float16
    num_kv_heads = 8 if CUDA else 2
    num_seqs = max(2, ac._sm_count(DEVICE) // num_kv_heads)
    seq_lens = torch.randint(40, 701, (num_seqs,), generator=torch.Generator().manual_seed(3)).tolist()
    batch = make_batch([1] * num_seqs, seq_lens, num_heads=2 * num_kv_heads, num_kv_heads=num_kv_heads, head_dim=64,
                       block_size=16, dtype=dtype, table_tail="minus1")  # fmt: skip
    hints = dict(max_seqlen_q=1, max_seqlen_k=max(seq_lens))
    config = ac.choose_config(
        num_tokens=num_seqs, num_seqs=num_seqs, num_kv_heads=num_kv_heads, group=2, head_dim_pad=64, elem_size=2,
        kv_elem_size=1 if fp8 else 2, device=DEVICE, **hints,
    )  # fmt: skip
    rule = ac.MID_BATCH_SPLITS[1 if fp8 else 2]
    assert (config.tile_n, config.num_warps, config.num_stages) == rule[2] and config.num_splits > 1
    assert config.min_split_tiles == rule[4] and config.split_target_programs == rule[5] * ac._sm_count(DEVICE)
    kwargs = dict(scale=0.125)
    if fp8:
        scale = torch.tensor([0.02], device=DEVICE)
        for name in ("k_cache", "v_cache"):  # NaN slots stay NaN in e4m3: any read of them still shows
            batch[name] = (batch[name].float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        kwargs.update(k_scale=scale, v_scale=scale)
        ref = paged_attention_reference(**dict(batch, q=batch["q"].double()), **kwargs).to(dtype)
    else:
        ref = paged_attention_reference(**batch, **kwargs)
    assert_close(paged_attention(**batch, **kwargs, **hints), ref, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_warm_up_compiles_every_decode_variant(cache_dtype):
    # After warm_up, decode batches of every size up to max_num_seqs (as the graphs meet them: the context hint is
    # the whole graph width, the step's K/V stored by the kernel) compile no new paged_attention variant.
    from hfpaged.kernels.attention_kernel import _paged_attention_kernel
    from hfpaged.kernels.warmup import warm_up

    num_heads, num_kv_heads, head_dim, max_num_seqs = 16, 8, 128, 48
    k_cache = torch.zeros(2048, 16, num_kv_heads, head_dim, device="cuda", dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    fp8 = cache_dtype == torch.float8_e4m3fn
    scales = (torch.ones(1, device="cuda"), torch.ones(1, device="cuda")) if fp8 else None
    warm_up(k_cache, v_cache, num_heads=num_heads, sliding_window=None, softcap=None, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=256, dtype=torch.bfloat16, kv_scales=scales)  # fmt: skip

    def variants():
        return sum(len(entry[0]) for entry in _paged_attention_kernel.device_caches.values())

    before = variants()
    extra = {"k_scale": scales[0], "v_scale": scales[1]} if fp8 else {}
    for num_seqs in range(1, max_num_seqs + 1):
        table = torch.arange(64, device="cuda", dtype=torch.int32).repeat(num_seqs, 1)
        q = torch.randn(num_seqs, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(num_seqs, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        slots = torch.full((num_seqs,), -1, device="cuda", dtype=torch.int32)
        paged_attention(q, k_cache, v_cache, table, torch.full((num_seqs,), 1000, device="cuda", dtype=torch.int32),
                        torch.arange(num_seqs + 1, device="cuda", dtype=torch.int32), scale=0.1, max_seqlen_q=1,
                        max_seqlen_k=40960, key=kv, value=kv, slot_mapping=slots, **extra)  # fmt: skip
    assert variants() == before


# (block_size, head_dim, num_heads, num_kv_heads, dtype, window, softcap): every block size and
# head dim once, on random mixes of decodes, prompts, chunks after a prefix and empty sequences.
RANDOM_MIXES = [
    (8, 128, 4, 1, torch.float16, 5, None),
    (16, 256, 2, 2, torch.float32, None, 3.0),
    (4, 96, 6, 3, torch.float32, 33, None),  # block_size 4: the engine's own GPU tests use it
    (64, 64, 8, 2, torch.float16, 20, 10.0),
]


@pytest.mark.parametrize("dtype_override", CASE_DTYPES, ids=lambda d: "bf16" if d else "base")
@pytest.mark.parametrize("mix", RANDOM_MIXES, ids=[f"bs{m[0]}_hd{m[1]}" for m in RANDOM_MIXES])
def test_paged_attention_random_mixes(mix, dtype_override):
    block_size, head_dim, num_heads, num_kv_heads, dtype, window, softcap = mix
    dtype = dtype_override or dtype
    gen = torch.Generator().manual_seed(block_size * head_dim)
    seq_lens = torch.randint(1, 90, (6,), generator=gen).tolist()
    kinds = torch.randint(0, 4, (6,), generator=gen).tolist()  # decode, prompt, chunk, empty
    q_lens = [[1, s, max(1, s // 4), 0][k] for s, k in zip(seq_lens, kinds)]
    batch = make_batch(q_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       block_size=block_size, dtype=dtype, seed=block_size)  # fmt: skip
    kwargs = dict(scale=head_dim**-0.5, sliding_window=window, softcap=softcap)
    ref = paged_attention_reference(**batch, **kwargs)
    for config in (None, AttentionConfig(16, 32, 4, 1, num_splits=2), AttentionConfig(32, 16, 4, 1)):
        if config is None:
            out = paged_attention(**batch, **kwargs)
        else:
            out = paged_attention_with_config(**batch, **kwargs, config=config, out=poisoned_out(batch))
        assert_close(out, ref, dtype)


@pytest.mark.parametrize("num_seqs", [70, 1030], ids=["one_lookup_load", "chunked_lookup"])
def test_paged_attention_many_sequences(num_seqs):
    # Sequence lookup: one vector load for up to 1023 sequences, chunked counting beyond.
    gen = torch.Generator().manual_seed(num_seqs)
    seq_lens = torch.randint(1, 20, (num_seqs,), generator=gen).tolist()
    q_lens = [int(k) for k in torch.randint(0, 2, (num_seqs,), generator=gen)]  # decodes and empties
    batch = make_batch(q_lens, seq_lens, num_heads=2, num_kv_heads=1, head_dim=16, block_size=8,
                       dtype=torch.float32)  # fmt: skip
    ref = paged_attention_reference(**batch, scale=0.3)
    out = paged_attention_with_config(**batch, scale=0.3, config=AttentionConfig(16, 16, 4, 1),
                                      out=poisoned_out(batch))  # fmt: skip
    assert_close(out, ref, torch.float32)


def test_paged_attention_table_tails_minus_one():
    batch = make_batch([1, 7], [19, 7], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
                       dtype=torch.float32, table_tail="minus1", q_view=False)  # fmt: skip
    ref = paged_attention_reference(**batch, scale=0.125)
    assert_close(paged_attention(**batch, scale=0.125), ref, torch.float32)


def test_paged_attention_no_queries():
    batch = make_batch([0, 0], [5, 9], num_heads=2, num_kv_heads=1, head_dim=32, block_size=8, dtype=torch.float32)
    out = paged_attention(**batch, scale=1.0, max_seqlen_q=1, max_seqlen_k=16)
    assert out.shape == (0, 2, 32)


def test_paged_attention_head_dim_v():
    batch = make_batch([1, 9], [12, 9], num_heads=4, num_kv_heads=2, head_dim=64, head_dim_v=32,
                       block_size=16, dtype=torch.float32)  # fmt: skip
    ref = paged_attention_reference(**batch, scale=0.125)
    assert_close(paged_attention(**batch, scale=0.125), ref, torch.float32)


STORE_CASES = [
    # (block_size, num_kv_heads, head_dim, dtype, slot dtype, non-contiguous key/value)
    (16, 2, 64, torch.float32, torch.int64, True),
    (8, 3, 96, torch.float16, torch.int32, False),
    (64, 1, 256, torch.float16, torch.int64, True),
]


@pytest.mark.parametrize("block_size,num_kv_heads,head_dim,dtype,slot_dtype,view", STORE_CASES)
def test_store_kv_matches_reference(block_size, num_kv_heads, head_dim, dtype, slot_dtype, view):
    gen = torch.Generator().manual_seed(1)
    num_blocks, num_tokens = 6, 13
    if view:
        key = torch.randn(1, num_kv_heads, num_tokens, head_dim, generator=gen)[0].transpose(0, 1)
        value = torch.randn(1, num_kv_heads, num_tokens, head_dim, generator=gen)[0].transpose(0, 1)
    else:
        key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
        value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 5, 11]] = -1
    sentinel = -777.0
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), sentinel, dtype=dtype)
    v_cache = torch.full_like(k_cache, sentinel)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_reference(key.to(dtype), value.to(dtype), k_ref, v_ref, slots)
    args = [t.to(DEVICE) for t in (key.to(dtype), value.to(dtype), k_cache, v_cache, slots.to(slot_dtype))]
    store_kv(*args)
    # Exact copy into the mapped slots; every other slot still holds the sentinel.
    assert torch.equal(args[2].cpu(), k_ref)
    assert torch.equal(args[3].cpu(), v_ref)
    assert int((k_ref != sentinel).sum()) == (num_tokens - 3) * num_kv_heads * head_dim


def test_store_kv_casts_to_cache_dtype():
    key = torch.randn(4, 2, 32)
    k_cache = torch.zeros(2, 8, 2, 32, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 0, 9, 15])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_reference(key, key * 2, k_ref, v_ref, slots)
    dev = [t.to(DEVICE) for t in (key, key * 2, k_cache, v_cache, slots)]
    store_kv(*dev)
    assert torch.equal(dev[2].cpu(), k_ref) and torch.equal(dev[3].cpu(), v_ref)


# ---- wrapper checks -------------------------------------------------------------------------


def _small_batch(**overrides):
    batch = make_batch([1, 3], [4, 3], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=torch.float32)
    batch.update(overrides)
    return batch


@pytest.mark.parametrize(
    "overrides,error,pattern",
    [
        (
            lambda b: dict(block_tables=b["block_tables"].long()),
            TypeError,
            "block_tables must have dtype in \\(int32\\)",
        ),
        (lambda b: dict(q=b["q"].half()), TypeError, "k_cache dtype torch.float32 differs from q dtype torch.float16"),
        (lambda b: dict(q=b["q"][..., :16]), ValueError, r"k_cache.shape\[3\] must be 16 .*got 32"),
        (
            lambda b: dict(q=b["q"][:, :3]),
            ValueError,
            r"num_heads \(q.shape\[1\] = 3\) must be a multiple of num_kv_heads",
        ),
        (lambda b: dict(seq_lens=b["seq_lens"][:1]), ValueError, r"block_tables.shape\[0\] must be 1"),
        (lambda b: dict(cu_seqlens_q=b["cu_seqlens_q"][:2]), ValueError, r"cu_seqlens_q.shape\[0\] must be 3"),
        (lambda b: dict(q=b["q"][0]), ValueError, "q must have 3 dimensions"),
        (lambda b: dict(v_cache=b["v_cache"][:, :4]), ValueError, r"v_cache.shape\[1\] must be 8"),
        (lambda b: dict(seq_lens=b["seq_lens"].to("meta")), ValueError, "seq_lens is on meta but q is on"),
        (lambda b: dict(k_cache=[1, 2]), TypeError, "k_cache must be a torch.Tensor, got list"),
    ],
    ids=[
        "table_dtype",
        "cache_dtype",
        "head_dim",
        "gqa",
        "num_seqs",
        "cu_len",
        "q_ndim",
        "block_size",
        "device",
        "type",
    ],
)
def test_paged_attention_errors(overrides, error, pattern):
    batch = _small_batch()
    batch.update(overrides(batch))
    with pytest.raises(error, match=pattern):
        paged_attention(**batch, scale=1.0)


def test_paged_attention_error_cu_seqlens_total():
    batch = _small_batch()
    batch["cu_seqlens_q"] = batch["cu_seqlens_q"].clone()
    batch["cu_seqlens_q"][-1] = 5
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] = 5 must equal q.shape\[0\] = 4"):
        paged_attention(**batch, scale=1.0)


def test_paged_attention_error_scale():
    with pytest.raises(ValueError, match="scale must be a positive float, got 0.0"):
        paged_attention(**_small_batch(), scale=0.0)


def test_paged_attention_error_bad_hint():
    with pytest.raises(TypeError, match="max_seqlen_k must be a non-negative host int"):
        paged_attention(**_small_batch(), scale=1.0, max_seqlen_q=1, max_seqlen_k=torch.tensor(4))


def test_paged_attention_error_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cpu = {k: v.cpu() for k, v in _small_batch().items()}
    with pytest.raises(ValueError, match="need CUDA tensors, got cpu"):
        paged_attention(**cpu, scale=1.0)


def _store_args():
    key = torch.randn(4, 2, 32, device=DEVICE)
    cache = torch.zeros(3, 8, 2, 32, device=DEVICE)
    return [key, key.clone(), cache, cache.clone(), torch.arange(4, device=DEVICE)]


@pytest.mark.parametrize(
    "index,replace,error,pattern",
    [
        (4, lambda a: a.float(), TypeError, "slot_mapping must have dtype in \\(int32, int64\\), got float32"),
        (4, lambda a: a[:3], ValueError, r"slot_mapping.shape\[0\] must be 4"),
        (1, lambda a: a[:, :1], ValueError, r"value.shape\[1\] must be 2"),
        (2, lambda a: a[:, :, :1], ValueError, r"k_cache.shape\[2\] must be 2"),
        (3, lambda a: a[:2], ValueError, r"v_cache.shape\[0\] must be 3"),
        (0, lambda a: a.int(), TypeError, "key must have dtype in"),
        (0, lambda a: a.to("meta"), ValueError, "value is on .* but key is on meta"),
    ],
    ids=["slot_dtype", "slot_len", "value_heads", "cache_heads", "v_blocks", "key_dtype", "device"],
)
def test_store_kv_errors(index, replace, error, pattern):
    args = _store_args()
    args[index] = replace(args[index])
    with pytest.raises(error, match=pattern):
        store_kv(*args)


# ---- GPU: bf16 and large sizes --------------------------------------------------------------


def _gpu_batch(q_lens, seq_lens, dtype=torch.bfloat16, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16):
    return make_batch(q_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      block_size=block_size, dtype=dtype, table_tail="minus1")  # fmt: skip


@pytest.mark.gpu
def test_gpu_prefill_4k_bf16():
    batch = _gpu_batch([4096], [4096])
    ref = paged_attention_reference(**batch, scale=128**-0.5)
    assert_close(paged_attention(**batch, scale=128**-0.5), ref, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_decode_32k_split_bf16():
    batch = _gpu_batch([1, 1], [32768, 20000])
    ref = paged_attention_reference(**batch, scale=128**-0.5)
    out = paged_attention(**batch, scale=128**-0.5, max_seqlen_q=1, max_seqlen_k=32768)
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_head_dim_256_window_softcap(dtype):
    # Gemma-2-like: head_dim 256, GQA 2, window 512, softcap 50; decodes, a prompt and a chunk.
    q_lens, seq_lens = [1, 1, 700, 300, 1], [3000, 90, 700, 1500, 513]
    batch = _gpu_batch(q_lens, seq_lens, dtype=dtype, num_heads=8, num_kv_heads=4, head_dim=256)
    kwargs = dict(scale=256**-0.5, sliding_window=512, softcap=50.0)
    assert_close(paged_attention(**batch, **kwargs), paged_attention_reference(**batch, **kwargs), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size,head_dim", [(8, 64), (16, 96), (32, 128), (64, 64)])
def test_gpu_mixed_batch_bf16(block_size, head_dim):
    gen = torch.Generator().manual_seed(block_size)
    seq_lens = torch.randint(1, 2500, (40,), generator=gen).tolist()
    kinds = torch.randint(0, 4, (40,), generator=gen).tolist()  # decode, prompt, chunk, empty
    q_lens = [[1, s, max(1, s // 3), 0][k] for s, k in zip(seq_lens, kinds)]
    batch = _gpu_batch(q_lens, seq_lens, num_heads=16, num_kv_heads=4, head_dim=head_dim, block_size=block_size)
    kwargs = dict(scale=head_dim**-0.5)
    ref = paged_attention_reference(**batch, **kwargs)
    assert_close(paged_attention(**batch, **kwargs), ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "q_lens,seq_lens", [([1] * 6, [1, 100, 2000, 5000, 77, 4096]), ([1, 300, 2], [900, 300, 1200])]
)
def test_gpu_fp32_is_exact(q_lens, seq_lens):
    # fp32 inputs use IEEE fp32 dots (no tf32): the engine's fp32 parity tests depend on it.
    batch = _gpu_batch(q_lens, seq_lens, dtype=torch.float32, num_heads=8, num_kv_heads=2)
    out = paged_attention(**batch, scale=128**-0.5)
    ref = paged_attention_reference(**batch, scale=128**-0.5)
    assert_close(out, ref, torch.float32)
    assert (out - ref).abs().max() < 2e-5


@pytest.mark.gpu
def test_gpu_hints_do_not_sync():
    batch = _gpu_batch([1] * 8, [100 * (i + 1) for i in range(8)])
    prefill = _gpu_batch([64, 1], [64, 300])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = paged_attention(**batch, scale=0.1, max_seqlen_q=1, max_seqlen_k=1024)
        paged_attention(**prefill, scale=0.1, max_seqlen_q=64, max_seqlen_k=300)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close(out, paged_attention_reference(**batch, scale=0.1), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_cuda_graph_decode():
    # Capture once with fixed shapes and hints; replay after changing lengths, tables and data in place.
    static = _gpu_batch([1] * 4, [4000] * 4)
    kwargs = dict(scale=128**-0.5, max_seqlen_q=1, max_seqlen_k=8192)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_attention(**static, **kwargs)  # compile / warm up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(**static, **kwargs)
    for seq_lens in ([4000, 50, 900, 2048], [1, 1, 1, 1], [3999, 10, 901, 100]):
        static["seq_lens"].copy_(torch.tensor(seq_lens, dtype=torch.int32))
        static["block_tables"].copy_(static["block_tables"][torch.randperm(4, device="cuda")])
        for name in ("q", "k_cache", "v_cache"):
            static[name].normal_()
        graph.replay()
        ref = paged_attention_reference(**static, scale=kwargs["scale"])
        assert_close(out, ref, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_store_kv_large_bf16():
    num_tokens, num_kv_heads, head_dim, block_size, num_blocks = 5000, 8, 128, 16, 600
    key = torch.randn(1, num_kv_heads, num_tokens, head_dim, device="cuda", dtype=torch.bfloat16)[0].transpose(0, 1)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]
    slots[::7] = -1
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), -7.0, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.full_like(k_cache, -7.0)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_reference(key, value, k_ref, v_ref, slots)
    store_kv(key, value, k_cache, v_cache, slots.int())
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_warm_up_runs_every_variant_once_first_alone_then_in_threads():
    import threading

    from hfpaged.kernels.warmup import run_all

    seen, lock, first_done = [], threading.Lock(), threading.Event()

    def run(index: int) -> None:
        if index != 0:
            assert first_done.is_set()  # the first entry ran alone, before the pool started
        assert torch.is_inference_mode_enabled()  # the caller's mode reaches the threads
        with lock:
            seen.append((index, threading.current_thread().name))
        if index == 0:
            first_done.set()

    with torch.inference_mode():
        run_all(run, [(i,) for i in range(12)], torch.device("cpu"), workers=4)
    assert sorted(i for i, _ in seen) == list(range(12))
    assert seen[0] == (0, threading.current_thread().name)
    assert {name for i, name in seen if i} <= {f"hfpaged-warmup_{n}" for n in range(4)}

    def failing(index: int) -> None:
        if index == 7:
            raise ValueError("variant 7 failed")

    with pytest.raises(ValueError, match="variant 7 failed"):
        run_all(failing, [(i,) for i in range(12)], torch.device("cpu"), workers=4)
    order = []
    run_all(lambda i: order.append(i), [(i,) for i in range(5)], torch.device("cpu"))  # no pool off CUDA
    assert order == list(range(5))


def test_warm_up_threads_setting_is_checked(monkeypatch):
    from hfpaged.kernels import warmup

    monkeypatch.setenv("HFPAGED_WARMUP_THREADS", "3")
    assert warmup._threads_from_env() == 3
    for bad in ("0", "-2", "eight", ""):
        monkeypatch.setenv("HFPAGED_WARMUP_THREADS", bad)
        with pytest.raises(ValueError, match="HFPAGED_WARMUP_THREADS must be a positive integer"):
            warmup._threads_from_env()


def _layer_chain(batch, caches, slots, launch_pdl, kwargs):
    """Layers of torch ops feeding store_kv and paged_attention (as in a model): each layer's new K/V and queries
    come from the previous layer's output, so a kernel that started before its inputs were written would show."""
    x = batch["q"]
    for k_cache, v_cache in caches:
        h = x * 1.5 - 0.25  # the projections' stand-ins: written by the kernels just before store_kv
        key = h[:, : k_cache.shape[2]].contiguous()
        store_kv(key, torch.tanh(key), k_cache, v_cache, slots, launch_pdl=launch_pdl)
        x = paged_attention(
            h, k_cache, v_cache, batch["block_tables"], batch["seq_lens"], batch["cu_seqlens_q"],
            launch_pdl=launch_pdl, **kwargs,
        )  # fmt: skip
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["decode_split", "mixed"])
def test_gpu_dependent_launch_equals_plain_launch_in_a_graph(kind):
    from hfpaged.kernels.dependent_launch import dependent_launch_supported

    if not dependent_launch_supported(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    if kind == "decode_split":  # few sequences: split context, then the merge kernel
        q_lens, seq_lens, max_q = [1] * 3, [3000, 700, 4096], 1
    else:
        q_lens, seq_lens, max_q = [1, 300, 1, 57], [2000, 300, 64, 900], 300
    batch = _gpu_batch(q_lens, seq_lens, num_heads=16, num_kv_heads=8)
    kwargs = dict(scale=128**-0.5, max_seqlen_q=max_q, max_seqlen_k=4096)
    # the new tokens' slots: each sequence's last q_len positions, through its block table
    table = batch["block_tables"].cpu()
    slots = []
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        slots += [int(table[b, p // 16]) * 16 + p % 16 for p in range(seq_len - q_len, seq_len)]
    slots = torch.tensor(slots, dtype=torch.int32, device="cuda")
    base = [(batch["k_cache"].nan_to_num(0.0), batch["v_cache"].nan_to_num(0.0)) for _ in range(6)]

    def run(launch_pdl, caches):
        return _layer_chain(batch, caches, slots, launch_pdl, kwargs)

    plain = run(False, [(k.clone(), v.clone()) for k, v in base])
    eager = run(True, [(k.clone(), v.clone()) for k, v in base])
    assert torch.equal(plain, eager)  # the same kernels on the same data: bit for bit

    caches = [(k.clone(), v.clone()) for k, v in base]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(True, caches)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(True, caches)
    for seed in range(5):
        torch.manual_seed(seed)
        batch["q"].normal_()
        for (k, v), (k0, v0) in zip(caches, base):
            k.copy_(k0)
            v.copy_(v0)
        graph.replay()
        expected = run(False, [(k0.clone(), v0.clone()) for k0, v0 in base])
        torch.cuda.synchronize()
        assert torch.equal(out, expected), f"replay {seed}: {(out != expected).sum()} elements differ"


@pytest.mark.parametrize("group", [1, 2, 4], ids=["mha", "group2", "group4"])
def test_one_query_decode_map_equals_the_searched_map(group):
    # AttentionConfig.one_query (every sequence has one query token: program i is sequence i, one program per
    # sequence) against the kernel's search over cu_seqlens_q, bitwise, into NaN-poisoned outputs; with a split and
    # without. choose_config sets it only for such batches.
    from hfpaged.kernels import attention_config as ac

    seq_lens = [1, 17, 40, 3, 64, 33, 5, 70]
    batch = make_batch([1] * len(seq_lens), seq_lens, num_heads=2 * group, num_kv_heads=2, head_dim=32,
                       block_size=16, dtype=torch.float16 if not CUDA else torch.bfloat16)  # fmt: skip
    for config in (AttentionConfig(16, 16, 4, 1), AttentionConfig(16, 32, 4, 1, num_splits=3)):
        searched = paged_attention_with_config(**batch, scale=0.2, config=config, out=poisoned_out(batch))
        direct = paged_attention_with_config(
            **batch, scale=0.2, config=ac.AttentionConfig(**{**vars(config), "one_query": True}),
            out=poisoned_out(batch),
        )  # fmt: skip
        assert not searched.isnan().any()
        assert torch.equal(direct, searched)

    def chosen(num_tokens, num_seqs, max_seqlen_q):
        return ac.choose_config(
            num_tokens=num_tokens, num_seqs=num_seqs, num_kv_heads=2, group=group, head_dim_pad=32, elem_size=2,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=70, device=torch.device("cpu"),
        ).one_query  # fmt: skip

    assert chosen(8, 8, 1)
    assert not chosen(9, 8, 2)  # a sequence with two query tokens
    assert not chosen(7, 8, 1)  # a sequence with none
    assert not chosen(16, 8, 4)


# Value heads of another size than query/key heads (MLA: DeepSeek-V3's 192 / 128, MiMo-V2-Flash): a CASES entry
# (block size 16) and the value heads' size
VALUE_HEAD_CASES = [
    (("decode_24_16", [1, 1, 1, 1], [3, 17, 40, 90], 4, 4, 24, 16, torch.float32, None, None), 16),
    (("mixed_192_128", [1, 30, 7, 1], [50, 30, 60, 9], 4, 2, 192, 16, torch.float16, None, None), 128),
    (("prompt_64_32_window_softcap", [1, 20, 33], [40, 20, 70], 4, 2, 64, 16, torch.float32, 16, 3.0), 32),
    (("chunk_48_128", [9, 1], [70, 33], 2, 1, 48, 16, torch.float16, None, None), 128),
]


@pytest.mark.parametrize("dtype_override", CASE_DTYPES, ids=lambda d: "bf16" if d else "base")
@pytest.mark.parametrize("case,head_dim_v", VALUE_HEAD_CASES, ids=[c[0][0] for c in VALUE_HEAD_CASES])
def test_value_heads_of_another_size(case, head_dim_v, dtype_override):
    q_lens, seq_lens, num_kv_heads, head_dim = case[1], case[2], case[4], case[5]
    batch, kwargs, dtype = case_batch(case, dtype_override, head_dim_v=head_dim_v)
    ref = paged_attention_reference(**batch, **kwargs)
    assert ref.shape[-1] == head_dim_v and not ref.isnan().any()
    assert_close(paged_attention(**batch, **kwargs), ref, dtype)
    configs = (AttentionConfig(16, 16, 4, 1, num_splits=3), AttentionConfig(64, 32, 4, 1))
    for config in configs:
        assert_close(paged_attention_with_config(**batch, **kwargs, config=config, out=poisoned_out(batch)), ref, dtype)
    # the step's own K/V given and stored first (decode steps: by the attention kernel itself)
    gen = torch.Generator().manual_seed(9)
    num_tokens = sum(q_lens)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(batch["q"])
    value = torch.randn(num_tokens, num_kv_heads, head_dim_v, generator=gen).to(batch["q"])
    tables = batch["block_tables"].long().cpu()
    slots = torch.tensor(
        [
            int(tables[b, p // 16]) * 16 + p % 16
            for b, (q, s) in enumerate(zip(q_lens, seq_lens))
            for p in range(s - q, s)
        ]
    ).to(batch["q"].device)
    stored = {**batch, "k_cache": batch["k_cache"].clone(), "v_cache": batch["v_cache"].clone()}
    expected = paged_attention_reference(**stored, **kwargs, key=key, value=value, slot_mapping=slots)
    out = paged_attention(**batch, **kwargs, key=key, value=value, slot_mapping=slots.int(),
                          max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens))  # fmt: skip
    assert_close(out, expected, dtype)
    assert torch.equal(batch["v_cache"].float().nan_to_num(7.0), stored["v_cache"].float().nan_to_num(7.0))


def test_value_heads_of_another_size_with_fp8_caches():
    batch = make_batch([1, 1, 20, 6], [30, 70, 20, 50], num_heads=4, num_kv_heads=2, head_dim=48, head_dim_v=32,
                       block_size=16, dtype=torch.float16)  # fmt: skip
    scales = {"k_scale": torch.tensor([0.02], device=DEVICE), "v_scale": torch.tensor([0.03], device=DEVICE)}
    for name, scale in (("k_cache", scales["k_scale"]), ("v_cache", scales["v_scale"])):
        batch[name] = (batch[name].float() / scale).clamp(-200, 200).to(torch.float8_e4m3fn)
    ref = paged_attention_reference(**batch, **scales, scale=48**-0.5)
    assert_close(paged_attention(**batch, **scales, scale=48**-0.5), ref, torch.float16)
    config = AttentionConfig(16, 32, 4, 1, num_splits=3)
    assert_close(paged_attention_with_config(**batch, **scales, scale=48**-0.5, config=config), ref, torch.float16)


def _strided(t: torch.Tensor, fill: int) -> torch.Tensor:
    """The values of ``t`` in a view whose last dimension has stride 2 (the other elements hold ``fill``)."""
    wide = torch.stack([t, torch.full_like(t, fill)], -1)
    return wide.reshape(*t.shape[:-1], -1)[..., ::2]


@pytest.mark.parametrize("name", ["seq_lens", "block_tables", "cu_seqlens_q", "slot_mapping"])
def test_strided_index_tensors_are_read_by_value(name):
    # the kernels read lengths, offsets, block-table rows and slots with stride 1: a strided view (same values) gave
    # wrong outputs or corrupted memory before; now it is read as a contiguous copy
    batch = make_batch([1, 1, 30, 1], [200, 7, 50, 9], num_heads=4, num_kv_heads=1, head_dim=32, block_size=8,
                       dtype=torch.float32, table_tail="minus1")  # fmt: skip
    num_tokens = batch["q"].shape[0]
    key = torch.randn(num_tokens, 1, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    value = torch.randn(num_tokens, 1, 32, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    used = set(batch["block_tables"].flatten().tolist())
    free = [b for b in range(batch["k_cache"].shape[0]) if b not in used]
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=DEVICE)  # 8 tokens into a block none reads
    slots[:8] = torch.arange(8, device=DEVICE) + free[0] * 8
    args = dict(batch, key=key, value=value, slot_mapping=slots)
    expected = {n: args[n].clone() for n in ("k_cache", "v_cache")}
    reference = paged_attention(**dict(args, k_cache=expected["k_cache"], v_cache=expected["v_cache"]), scale=0.2)
    view = _strided(args[name], 999 if name == "cu_seqlens_q" else 5)
    assert torch.equal(view, args[name]) and not view.is_contiguous()
    out = paged_attention(**dict(args, **{name: view}), scale=0.2)
    assert torch.equal(out, reference)
    assert torch.equal(args["k_cache"].nan_to_num(7.0), expected["k_cache"].nan_to_num(7.0))
    assert torch.equal(args["v_cache"].nan_to_num(7.0), expected["v_cache"].nan_to_num(7.0))


def test_store_kv_reads_a_strided_slot_mapping_by_value():
    key = torch.randn(6, 2, 16, device=DEVICE)
    caches = [torch.zeros(4, 4, 2, 16, device=DEVICE) for _ in range(4)]
    slots = torch.tensor([3, 9, -1, 0, 14, 5], dtype=torch.int64, device=DEVICE)
    store_kv(key, key, caches[0], caches[1], slots)
    store_kv(key, key, caches[2], caches[3], _strided(slots, 2))
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
