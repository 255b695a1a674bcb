"""Compile the Triton kernel variants a run will meet up front, instead of inside the first steps that need them.

``paged_attention`` compiles a variant per tile config (picked from the longest query run and the split
count) and per sequence-search width (a compile-time constant: fewer than 64 sequences, fewer than 256, or
more), and with it the one that stores the step's K/V itself (one query token per sequence) or
``store_kv`` (several). One batch of each kind is enough: uniform query lengths and one
long run among one-token decodes (mixed steps), for every search width up to ``max_num_seqs``.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from ._checks import cdiv
from .compile_ahead import recording
from .paged_attention import SEARCH_BLOCK_SEQ_COUNTS, config_for_batch, paged_attention, search_block

QUERY_LENGTHS = (1, 2, 4, 8, 16, 32, 64, 256, 2048)


def _threads_from_env() -> int:
    """``HFPAGED_WARMUP_THREADS`` (default 8): Triton compiles overlapping in threads (see run_all); 1: one at a time."""
    value = os.environ.get("HFPAGED_WARMUP_THREADS", "8")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"HFPAGED_WARMUP_THREADS must be a positive integer, got {value!r}")
    return int(value)


WARMUP_THREADS = _threads_from_env()


def warm_up(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    num_heads: int,
    sliding_window: int | None,
    softcap: float | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    column_multiple: int = 16,
    dtype: torch.dtype | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    launch_pdl: bool = False,
    sinks_dtype: torch.dtype | None = None,
) -> None:
    """Run every variant once on one layer's caches (writing nothing: every slot is -1).

    ``column_multiple``: the caller pads block-table rows to a multiple of this (the row stride is a
    specialized kernel argument). fp8 caches need the query ``dtype`` and the layer's ``kv_scales``.
    ``launch_pdl``: the variants with programmatic dependent launch (as the engine will launch them).
    ``sinks_dtype``: the layer passes attention sinks of this dtype (the variants that read them).
    """
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    device, dtype = k_cache.device, dtype or k_cache.dtype  # dtype: the queries' (fp8 caches: the model's)
    options = {} if kv_scales is None else {"k_scale": kv_scales[0], "v_scale": kv_scales[1]}
    if sinks_dtype is not None:
        options["sinks"] = torch.zeros(num_heads, dtype=sinks_dtype, device=k_cache.device)
    capacity = k_cache.shape[0] * block_size
    budget = max(max_num_batched_tokens, 64)
    seq_counts = sorted({min(n, max_num_seqs) for n in SEARCH_BLOCK_SEQ_COUNTS})
    shapes = set()
    for q_len in QUERY_LENGTHS:
        for num_seqs in seq_counts:
            shapes.add((q_len,) * num_seqs)
            shapes.add((q_len,) + (1,) * (num_seqs - 1))

    def context_for(max_q: int) -> int:
        return min(max(max_q, 4096), capacity)

    # decode batches whose size picks a tile of its own (attention_config.MID_BATCH_SPLITS): one batch per variant
    variants = set()
    for num_seqs in range(1, max_num_seqs + 1):
        config = config_for_batch(num_seqs, num_seqs, num_heads, dtype, k_cache, v_cache, 1, context_for(1))
        key = (config.tile_n, config.num_warps, config.num_stages, config.num_splits > 1, search_block(num_seqs))
        if key not in variants:
            variants.add(key)
            shapes.add((1,) * num_seqs)
    todo = []
    for q_lens in sorted(shapes):
        max_q, num_seqs, num_tokens = max(q_lens), len(q_lens), sum(q_lens)
        context = context_for(max_q)
        if max_q > context or num_tokens > budget:
            continue
        todo.append((q_lens, context))

    def run(q_lens: tuple[int, ...], context: int) -> None:
        max_q, num_seqs, num_tokens = max(q_lens), len(q_lens), sum(q_lens)
        num_blocks = cdiv(context, block_size)
        width = cdiv(num_blocks, column_multiple) * column_multiple
        block_tables = torch.zeros(num_seqs, width, dtype=torch.int32, device=device)
        block_tables[:, :num_blocks] = torch.arange(num_blocks, dtype=torch.int32, device=device)
        seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
        cu = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
        q = torch.ones(num_tokens, num_heads, head_dim, dtype=dtype, device=device)  # no RNG: a graph may be capturing
        kv = torch.zeros(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
        values = torch.zeros(num_tokens, num_kv_heads, v_cache.shape[3], dtype=dtype, device=device)
        slots = torch.full((num_tokens,), -1, dtype=torch.int32, device=device)
        paged_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            cu,
            scale=head_dim**-0.5,
            sliding_window=sliding_window,
            softcap=softcap,
            max_seqlen_q=max_q,
            max_seqlen_k=context,
            launch_pdl=launch_pdl,
            key=kv,  # as the engine passes the step's keys (prompt chunks: the variant reading them by TMA)
            value=values,
            slot_mapping=slots,  # stores nothing; decode batches: the variant that stores in the kernel
            **options,
        )

    run_all(run, todo, device)


def warm_up_layers(layers, kv_caches, kv_scales, **options) -> None:
    """``warm_up`` once per distinct kind of attention layer: ``layers`` carry num_heads, num_kv_heads, head_dim,
    head_dim_v, dtype, sliding_window, softcap and sinks_dtype; ``kv_caches`` their (k, v) caches; ``kv_scales``
    their fp8 scales ([k, v] tensors) or Nones; ``options``: warm_up's max_num_seqs, max_num_batched_tokens,
    column_multiple and launch_pdl."""
    seen = set()
    for layer, (k_cache, v_cache), scales in zip(layers, kv_caches, kv_scales):
        key = (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.head_dim_v, layer.dtype)
        key += (layer.sliding_window, layer.softcap, layer.sinks_dtype)
        if key in seen:
            continue
        seen.add(key)
        warm_up(k_cache, v_cache, num_heads=layer.num_heads, sliding_window=layer.sliding_window,
                softcap=layer.softcap, sinks_dtype=layer.sinks_dtype, dtype=layer.dtype,
                kv_scales=None if scales is None else (scales[0:1], scales[1:2]), **options)  # fmt: skip


def run_all(run, todo: list[tuple], device: torch.device, workers: int | None = None) -> None:
    """``run(*args)`` for every entry of ``todo``; on CUDA the compiles overlap in threads.

    Part of a Triton compile runs without the GIL (``ptxas`` in a subprocess, some of the native passes), so
    threads overlap it: on the H100 eight threads took the Qwen3-0.6B warm-up from 25.9 s to 11-16 s (the
    Python front end of each compile still takes turns). The first entry runs alone (it sets up each kernel's per-device caches, which
    threads must not race to create); the rest run in a pool, each thread on ``device`` in inference
    mode like the caller. Kernels two threads both compile are compiled twice, harmlessly. While a CUDA
    graph is being captured, or with one entry or one core, everything runs in this thread.
    ``workers``: the pool size (default: up to ``WARMUP_THREADS`` on CUDA, none elsewhere).
    """
    if workers is None:
        workers = min(WARMUP_THREADS, os.cpu_count() or 1) if device.type == "cuda" else 1
    workers = min(workers, max(len(todo) - 1, 1))
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if capturing or workers < 2 or recording():  # recording (compile_ahead.py): its hook sees this thread only
        for args in todo:
            run(*args)
        return
    run(*todo[0])
    inference = torch.is_inference_mode_enabled()

    def task(args: tuple) -> None:
        on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with on_device, torch.inference_mode(inference):
            run(*args)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hfpaged-warmup") as pool:
        for future in [pool.submit(task, args) for args in todo[1:]]:
            future.result()  # the first error, if any, as if run here
    if device.type == "cuda":
        torch.cuda.synchronize(device)
