"""Launches of the Triton attention kernel and of the split merge, shared by ``paged_attention_with_config``'s
launch over the whole batch and its launch over the leading one-token rows of a mixed step (``attend_leading_rows``).
"""

from __future__ import annotations

import torch

from ._checks import FP8_DTYPES, FP8_MAX, next_power_of_2
from .attention_config import AttentionConfig
from .attention_kernel import _paged_attention_kernel
from .dependent_launch import launch_options
from .fp8_decode import fp8_decode, fp8_decode_usable
from .split_merge import _merge_splits_kernel

LOG2E = 1.4426950408889634


def search_block(num_seqs: int) -> int:
    """How many cu_seqlens_q entries a program scans at once to find its sequence."""
    return 64 if num_seqs < 64 else (256 if num_seqs < 256 else 1024)


def split_workspace(rows: int, head_dim_v_pad: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Split-context partials of ``rows`` (token x head x split) rows: (acc, max, sum), fp32."""
    acc = torch.empty(rows * head_dim_v_pad, dtype=torch.float32, device=device)
    return (
        acc,
        torch.empty(rows, dtype=torch.float32, device=device),
        torch.empty(rows, dtype=torch.float32, device=device),
    )


def launch_attention_kernel(
    q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, split_bufs, *, config: AttentionConfig,
    num_programs: int, scale, softcap, sliding_window, k_scale, v_scale, sinks, descriptors, store, launch_pdl,
    leading_rows: int = 0, skip_fresh: bool = False,
) -> None:  # fmt: skip
    """One launch of ``_paged_attention_kernel`` (its parameters: attention_kernel.py). ``descriptors``: (k_step,
    v_step, k_ctx, v_ctx, ctx_offsets) or Nones; ``store``: (key, value, slots) or None; ``split_bufs``: (acc, max,
    sum) when config.num_splits > 1; ``leading_rows``: the kernel's LEADING_ROWS (0, 1 or 2); ``skip_fresh``: its
    SKIP_FRESH (sequences with no cached context left alone: prompt_gluon.py's kernel does them)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    head_dim_v = v_cache.shape[3]
    group = num_heads // num_kv_heads
    block_m = max(config.block_m, next_power_of_2(group))
    use_softcap = softcap is not None and softcap > 0
    use_window = sliding_window is not None and sliding_window > 0
    split = config.num_splits > 1
    fp8 = k_cache.dtype in FP8_DTYPES
    split_acc, split_max, split_sum = split_bufs if split else (out, out, out)  # unused without splits
    store_key, store_value, slots = store if store is not None else (seq_lens, seq_lens, seq_lens)  # unused if None
    store_strides = (*store_key.stride(), *store_value.stride()) if store is not None else (0,) * 6
    k_desc, v_desc, k_ctx_desc, v_ctx_desc, ctx_offsets = descriptors
    num_seqs = seq_lens.shape[0]
    # one-query launches: (sequence, KV head, split); others flatten (program, KV head) with the heads innermost
    grid = (num_programs, num_kv_heads) if config.one_query else (num_programs * num_kv_heads, 1)
    _paged_attention_kernel[(*grid, config.num_splits)](
        out,
        split_acc,
        split_max,
        split_sum,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        k_scale if fp8 else seq_lens,  # unused without fp8
        v_scale if fp8 else seq_lens,
        sinks if sinks is not None else seq_lens,  # unused without sinks
        k_desc,
        v_desc,
        k_ctx_desc,
        v_ctx_desc,
        ctx_offsets,
        store_key,
        store_value,
        slots,
        num_seqs,
        config.num_splits,
        config.min_split_tiles,
        config.split_target_programs,
        float(scale) / float(softcap) if use_softcap else float(scale) * LOG2E,
        float(softcap) * LOG2E if use_softcap else 1.0,
        int(sliding_window) if use_window else 0,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        *store_strides,
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_power_of_2(max(16, head_dim)),
        HEAD_DIM_V=head_dim_v,
        HEAD_DIM_V_PAD=next_power_of_2(max(16, head_dim_v)),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=max(1, block_m // group),
        TILE_N=config.tile_n,
        USE_SOFTCAP=use_softcap,
        USE_WINDOW=use_window,
        SPLIT=split,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SEARCH_BLOCK=16 if config.one_query else search_block(num_seqs),  # unused with one_query: one variant
        KV_FP8=fp8,
        STEP_KV=k_desc is not None,
        CTX_KV=ctx_offsets is not None,
        USE_PDL=launch_pdl,
        ONE_QUERY=config.one_query,
        STORE_KV=store is not None,
        FP8_MAX=FP8_MAX.get(k_cache.dtype, 0.0),
        USE_SINKS=sinks is not None,
        LEADING_ROWS=leading_rows,
        SKIP_FRESH=skip_fresh,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(launch_pdl),
    )


def merge_splits(out, split_bufs, num_rows: int, num_splits: int, sinks, launch_pdl: bool, leading_rows=None) -> None:
    """Combine the split partials of ``num_rows`` token rows into ``out``; ``leading_rows``: the step's
    ``cu_seqlens_q``: only the leading one-token rows (the others are not touched)."""
    num_heads, head_dim_v = out.shape[1], out.shape[2]
    head_dim_v_pad = next_power_of_2(max(16, head_dim_v))
    splits_pad = next_power_of_2(num_splits)
    split_acc, split_max, split_sum = split_bufs
    _merge_splits_kernel[(num_rows, num_heads)](
        out,
        split_acc,
        split_max,
        split_sum,
        sinks if sinks is not None else split_sum,  # unused without sinks
        num_splits,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM_V=head_dim_v,
        HEAD_DIM_V_PAD=head_dim_v_pad,
        SPLITS_PAD=splits_pad,
        USE_PDL=launch_pdl,
        USE_SINKS=sinks is not None,
        LEADING_ROWS=leading_rows is not None,
        cu_seqlens_q_ptr=leading_rows,
        num_warps=4 if splits_pad * head_dim_v_pad <= 4096 else 8,
        **launch_options(launch_pdl),
    )


def attend_leading_rows(
    q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, *, config: AttentionConfig, scale, softcap,
    sliding_window, k_scale, v_scale, sinks, launch_pdl,
) -> None:  # fmt: skip
    """Attention of a mixed step's leading one-token rows (sequence b with ``cu_seqlens_q[b : b + 2] = b, b + 1``: the
    decode rows ahead of its prompt chunks), as a decode batch of their own (``config``: a one-query config): the CUDA
    fp8 kernel where it applies, else the Triton kernel; a launch with LEADING_ROWS=2 then does the other rows.
    The step's K/V are already stored. Writes those rows of ``out`` only."""
    num_seqs, num_heads = seq_lens.shape[0], q.shape[1]
    split = config.num_splits > 1
    split_bufs = None
    if split:
        head_dim_v_pad = next_power_of_2(max(16, v_cache.shape[3]))
        split_bufs = split_workspace(num_seqs * num_heads * config.num_splits, head_dim_v_pad, q.device)
    if fp8_decode_usable(
        q, k_cache, v_cache, sliding_window=sliding_window, softcap=softcap, sinks=sinks,
        split_target_programs=config.split_target_programs, out=out,
    ):  # fmt: skip
        fp8_decode(
            q, k_cache, v_cache, block_tables, seq_lens, scale=scale, k_scale=k_scale, v_scale=v_scale, out=out,
            split=(*split_bufs, config.num_splits, config.min_split_tiles * config.tile_n) if split else None,
            leading_rows=cu_seqlens_q,
        )  # fmt: skip
    else:
        launch_attention_kernel(
            q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, split_bufs, config=config,
            num_programs=num_seqs, scale=scale, softcap=softcap, sliding_window=sliding_window, k_scale=k_scale,
            v_scale=v_scale, sinks=sinks, descriptors=(None,) * 5, store=None, launch_pdl=launch_pdl, leading_rows=1,
        )  # fmt: skip
    if split:
        merge_splits(out, split_bufs, num_seqs, config.num_splits, sinks, launch_pdl, leading_rows=cu_seqlens_q)
