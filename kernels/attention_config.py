"""Tile configurations for paged_attention, chosen from host integers only (CUDA-graph safe)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import cdiv, next_power_of_2

# Rows of one program's tile (query positions x query heads of one KV group) at or below which a
# batch counts as decode-like: small M tile, and the context may be split across programs.
DECODE_MAX_ROWS = 64
# Split-context (flash-decoding) limits.
MAX_SPLITS = 64
MIN_KEYS_PER_SPLIT = 128  # H100 sweep: B=1 x 2k decode 685 GB/s with 16 splits vs 563 with 8
PROGRAMS_PER_SM = 2
# Decode batches whose programs (sequences x KV heads) number between lo x SMs and hi x SMs, by the bytes of a K/V
# element as the dots see it (heads of <= 128 dims): (lo, hi, (TILE_N, num_warps, num_stages) or None for the
# DECODE_TILES one, grid programs per SM, min tiles per split, target programs per SM). The grid's split count
# comes from the batch size alone (graphs bake it); on the device each split covers at least min tiles and, with a
# target > 0, at least the batch's keys x KV heads / (target x SMs), so short contexts use fewer splits and the
# programs of a batch of mixed lengths are of about equal length. Other batches: PROGRAMS_PER_SM, 1, 0.
# H100 (session 14, Qwen3-0.6B heads 16/8 x 128, batches of 8-32 at 200-2k and 4.3k-8.7k keys of context,
# notes/kernels.md): bf16 0.86-0.97x of the time of the default rule, fp8 0.77-0.95x; the long-prompt workload
# +8% (bf16) / +10% (fp8) output tokens/s in the engine.
MID_BATCH_SPLITS: dict[int, tuple[float, float, tuple[int, int, int] | None, int, int, int]] = {
    2: (0.45, 2.0, (32, 4, 2), 8, 4, 4),
    1: (0.45, 2.0, (128, 4, 2), 8, 4, 0),
}
# Decode batches that the CUDA fp8 kernel runs (kernels/fp8_decode.py: one CTA of 4 warps per sequence x KV head x
# split, at most 4 CTAs per SM by registers): context splits bring the CTAs to about CUDA_FP8_CTAS_PER_SM per SM
# (rounded to the nearest count), each split covering at least CUDA_FP8_MIN_SPLIT_KEYS keys. H100 (session 33,
# notes/results/session33/call1, batches of 6-64 sequences at 4-8.7k, 0.3-1.4k and 0.1-0.6k keys, Qwen3 and
# Llama-3.2-1B heads): within 4% of the best split count of the sweep everywhere but at 16-32 sequences of
# 0.1-0.6k keys (1-2 us above no split at all), against up to 1.36x the best with MID_BATCH_SPLITS (tuned for
# Triton's tiles). 0: the CUDA kernel takes the Triton kernel's split rule (benchmarks compare the two).
CUDA_FP8_CTAS_PER_SM = 3
CUDA_FP8_MIN_SPLIT_KEYS = 128
# Decode tiles (TILE_N, num_warps, num_stages) by the bytes of one K/V element as the dots see it (the query's
# for 16/32-bit caches; 1 for fp8 caches with 16-bit queries, whose tiles are loaded at 1 byte per element),
# for head_dim_pad <= 128 and for larger heads. H100 sweep (bf16): 2 stages beat 3-4 (more programs per SM).
# fp8 (H100, examples/sweep_fp8_decode.py, session 7: B 64-256 x context 512-8k, 16 heads / 8 KV heads, hd 128):
# 128 keys / 4 warps / 3 stages is within 2% of the best everywhere and 1.1-1.5x the 2-byte choice (fp8 time per
# call 0.57-0.73 of bf16's); larger heads keep the 2-byte choice (not swept).
DECODE_TILES = {
    4: ((32, 4, 2), (16, 4, 2)),
    2: ((64, 4, 2), (32, 4, 2)),
    1: ((128, 4, 3), (32, 4, 2)),
}


@dataclass(frozen=True)
class AttentionConfig:
    """One launch shape: BLOCK_M rows x TILE_N keys per step; num_splits > 1 = split context + merge, each split
    covering at least ``min_split_tiles`` tiles of its sequence's keys (so short contexts leave splits empty) and, with
    ``split_target_programs``, at least 1/split_target_programs of all the batch's keys x KV heads."""

    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int
    num_splits: int = 1
    min_split_tiles: int = 1
    split_target_programs: int = 0  # > 0: splits sized on the device so the batch's keys make ~this many programs
    one_query: bool = False  # every sequence has exactly one query token (program i is sequence i: no lookup)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # Triton interpreter: a tiny "GPU", so CPU tests exercise the split path
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


_SM_COUNTS: dict[int, int] = {}


def _cuda_sm_count(index: int) -> int:
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def split_count(active_programs: int, max_seqlen_k: int, sm_count: int, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Context splits that bring ``active_programs`` up to ``programs_per_sm`` per SM (1 = no split)."""
    target = programs_per_sm * sm_count
    if active_programs >= target:
        return 1
    splits = min(cdiv(target, max(active_programs, 1)), max_seqlen_k // MIN_KEYS_PER_SPLIT, MAX_SPLITS)
    return max(1, splits)


def cuda_fp8_split_count(active_programs: int, max_seqlen_k: int, sm_count: int) -> int:
    """Context splits for the CUDA fp8 decode kernel: ~CUDA_FP8_CTAS_PER_SM CTAs per SM (1 = no split)."""
    splits = (2 * CUDA_FP8_CTAS_PER_SM * sm_count + max(active_programs, 1)) // (2 * max(active_programs, 1))
    return max(1, min(splits, max_seqlen_k // CUDA_FP8_MIN_SPLIT_KEYS, MAX_SPLITS))


def decode_like(max_seqlen_q: int, group: int) -> bool:
    """Whether a batch whose longest query run is ``max_seqlen_q`` uses the decode tiles."""
    return max_seqlen_q * group <= DECODE_MAX_ROWS


def choose_config(
    *,
    num_tokens: int,
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    head_dim_pad: int,
    elem_size: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    device: torch.device,
    kv_elem_size: int | None = None,
    cuda_fp8_decode: bool = False,
) -> AttentionConfig:
    """Pick tiles and the number of context splits from shapes and the host hints (never device values).

    ``elem_size`` is the query's element size, ``kv_elem_size`` the cache's (None: the same; 1 for fp8).
    ``cuda_fp8_decode``: a batch of one query token per sequence runs on the CUDA fp8 decode kernel (its own split
    rule; the tiles are the Triton kernel's, should it run instead).
    """
    if decode_like(max_seqlen_q, group):
        block_m = max(16, next_power_of_2(max_seqlen_q * group))
        tiles_key = 1 if kv_elem_size == 1 and elem_size <= 2 else elem_size  # fp32 queries dot in fp32
        tile_n, num_warps, num_stages = DECODE_TILES.get(tiles_key, DECODE_TILES[2])[0 if head_dim_pad <= 128 else 1]
        block_q = max(1, block_m // group)
        active_programs = min(num_tokens, num_seqs * cdiv(max_seqlen_q, block_q)) * num_kv_heads
        sm_count = _sm_count(device)
        # one query token per sequence (each at most max_seqlen_q = 1, T of them over T sequences): programs map to
        # sequences by their index, without the search over cu_seqlens_q
        one_query = max_seqlen_q == 1 and num_tokens == num_seqs
        programs_per_sm, min_tiles, target_per_sm = PROGRAMS_PER_SM, 1, 0
        mid = MID_BATCH_SPLITS.get(tiles_key) if head_dim_pad <= 128 else None
        if mid is not None and mid[0] * sm_count <= active_programs <= mid[1] * sm_count:
            _, _, mid_tile, programs_per_sm, min_tiles, target_per_sm = mid
            if mid_tile is not None:
                tile_n, num_warps, num_stages = mid_tile
        if cuda_fp8_decode and one_query and CUDA_FP8_CTAS_PER_SM > 0:
            num_splits = cuda_fp8_split_count(active_programs, max_seqlen_k, sm_count)
            min_tiles = cdiv(CUDA_FP8_MIN_SPLIT_KEYS, tile_n)
            return AttentionConfig(block_m, tile_n, num_warps, num_stages, num_splits, min_tiles, 0, one_query)
        num_splits = split_count(active_programs, max_seqlen_k, sm_count, programs_per_sm)
        if num_splits == 1:
            return AttentionConfig(block_m, tile_n, num_warps, num_stages, one_query=one_query)
        return AttentionConfig(
            block_m, tile_n, num_warps, num_stages, num_splits, min_tiles, target_per_sm * sm_count, one_query
        )
    block_m, tile_n, num_warps, num_stages = prompt_tile(max_seqlen_q, group, head_dim_pad, elem_size)
    return AttentionConfig(block_m, tile_n, num_warps, num_stages, 1)


# Prompt tiles (BLOCK_M, TILE_N, num_warps, num_stages) of 16-bit queries. Heads of 65-128 dims: a batch whose longest
# query run is above SHORT_PROMPT_MAX_Q takes LONG_PROMPT_TILE, others SHORT_PROMPT_TILE; heads of <= 64 dims take
# SMALL_HEAD_PROMPT_TILE for every run. H100 (session 23, notes/results/session23/call1-2; bf16 and e4m3 caches, heads
# 16/8 x 128, 32/8 x 128, 32/8 x 64): long prompts (2 x 4k, 2k chunks after 2-6k of context) with 128-dim heads run
# best with 128 x 128 / 8 warps (64 x 32: 0.79-0.88x of it); prompts of up to ~1.5k tokens, alone or beside decode
# rows (whose program is a whole BLOCK_M tile), with 64 x 32 / 4 warps: 1.1-1.4x the long tile on 100-1,500-token
# prompts, 1.4-1.7x on chat steps (32-512-token prompts beside 1-240 decode rows); session 16's 128 x 32 / 4 warps
# was 1.0-1.25x there (bf16) and slower than the long tile with e4m3 caches. 64-dim heads: 64 x 64 / 4 warps / 2
# stages within 4% of the best of every shape, 1.1-1.2x the long tile on long prompts, 1.6-2.3x on chat steps.
SHORT_PROMPT_MAX_Q = 1536
LONG_PROMPT_TILE = (128, 128, 8, 3)
SHORT_PROMPT_TILE = (64, 32, 4, 3)
SMALL_HEAD_PROMPT_TILE = (64, 64, 4, 2)


def prompt_tile(max_seqlen_q: int, group: int, head_dim_pad: int, elem_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, TILE_N, num_warps, num_stages) of a batch that is not decode-like."""
    if elem_size == 4:
        tile = (64, 32, 4, 2) if head_dim_pad <= 128 else (32, 32, 4, 2)
    elif head_dim_pad <= 64:
        tile = SMALL_HEAD_PROMPT_TILE
    elif head_dim_pad <= 128:
        tile = LONG_PROMPT_TILE if max_seqlen_q > SHORT_PROMPT_MAX_Q else SHORT_PROMPT_TILE
    else:
        tile = (64, 64, 4, 2)
    return (max(tile[0], next_power_of_2(group)), *tile[1:])


def short_prompt_hint(*, group: int, head_dim_pad: int, elem_size: int) -> int | None:
    """A ``max_seqlen_q`` hint that picks the short-prompt tile where it differs from the long one (a CUDA graph
    captured with the largest hint of its bucket bakes the long tile: steps of short runs may replay a second graph
    captured with this hint), or None where every run length gets the same prompt tile."""
    short = prompt_tile(SHORT_PROMPT_MAX_Q, group, head_dim_pad, elem_size)
    long = prompt_tile(SHORT_PROMPT_MAX_Q + 1, group, head_dim_pad, elem_size)
    if short == long or decode_like(SHORT_PROMPT_MAX_Q, group):
        return None
    return SHORT_PROMPT_MAX_Q
