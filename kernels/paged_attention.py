"""paged_attention: causal attention over a packed batch of sequences whose K/V live in the paged cache.

One launch serves decodes, whole prompts and chunks after a cached prefix alike. Program
(q_block, kv_head, split) owns BLOCK_Q consecutive query positions of one sequence times the GROUP
query heads of one KV head (GQA packing: those rows form the M dimension of the tile, so every
K/V tile is loaded once per KV group). It walks TILE_N keys at a time through the block table with
an online softmax in fp32 (log2 domain). KV tiles wholly outside the causal range or the sliding
window are never visited; tiles wholly inside skip the masking. With num_splits > 1 (decode-like
batches that would not fill the GPU) each program covers 1/num_splits of its key range and writes
an unnormalised partial (acc, max, sum) that ``_merge_splits_kernel`` combines (flash-decoding).

Prompt chunks may also be given the step's own keys/values (``key=``, ``value=``: what ``store_kv`` just wrote):
the unmasked tiles of keys computed in this step then load whole boxes of those rows by TMA instead of gathering
per key through the block table (1.2-1.4x prefill attention on the H100; notes/kernels.md, session 15). In steps
of at least CONTEXT_MIN_TOKENS tokens (16-bit caches: with a run of at least CONTEXT_MIN_RUN), the cached context of
chunks of at least CONTEXT_MIN_Q tokens is first copied into contiguous rows (context_rows.py) and read the same way
(session 16); with fp8 caches, whose step rows are not the stored (quantized) values, all the keys of such chunks are
copied instead.

Given ``slot_mapping=`` as well, it stores the step's keys/values first: in a step of one query token per sequence
(decode), the program of each sequence and KV head whose keys include the last position writes that row into the
cache, synchronises its threads and reads it back in its tile loop (no other program reads that key), which saves
the ``store_kv`` launch; other steps run ``store_kv`` first.

Steps of one query token per sequence over fp8 caches run the CUDA kernel of ``fp8_decode.py`` instead where it
applies (``fp8_decode_usable``), with the same split partials and merge: 1.1-1.4x the Triton kernel's speed there.

Grid and workspace depend only on host integers (shapes and the max_seqlen hints), so the launch
can be captured in a CUDA graph. Query blocks map to sequences on the device by counting over
cu_seqlens_q: sequence b owns program ids [cu[b] // BLOCK_Q + b, ...), an upper bound of
T // BLOCK_Q + B programs in all (exactly T when BLOCK_Q == 1).
"""

from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ._checks import (
    FP8_DTYPES,
    check_attention_args,
    check_devices,
    check_dim,
    check_tensor,
    launches_on_first_tensor_gpu,
    next_power_of_2,
    unit_stride,
)
from .attention_config import SHORT_PROMPT_MAX_Q, AttentionConfig, choose_config, decode_like
from .attention_launch import attend_leading_rows, launch_attention_kernel, merge_splits, search_block, split_workspace
from .context_rows import (
    context_capacity,
    context_rows_dtype,
    context_rows_usable,
    copy_context_rows,
    step_kv_usable,
)
from .dependent_launch import check_launch_pdl
from .fp8_decode import fp8_decode, fp8_decode_usable
from .prompt_gluon import attend_fresh_prompts, fresh_prompts_usable
from .store_kv import store_kv

# Context rows (context_rows.py): only in steps of at least this many tokens (a smaller step's copy launch would cost
# more than it saves), for chunks of at least CONTEXT_MIN_Q query tokens (each context tile is then read by several
# query blocks), in a scratch of at most CONTEXT_MAX_BYTES (context_capacity); with 16-bit caches only in steps whose
# longest query run (the hint) is at least CONTEXT_MIN_RUN: the copy was measured on long chunks (session 16), steps
# of short runs (chat prompts beside decode rows: the short-prompt tiles) seldom hold cached context, their copy
# launch cost ~10 us per layer there for little, and their CUDA graphs then need no copy kernel and attention
# variant of their own (two Triton compiles less at a cold start; session 23). fp8 caches copy (and convert each
# key once) whatever the runs.
CONTEXT_MIN_TOKENS = 2048
CONTEXT_MIN_Q = 256
CONTEXT_MIN_RUN = SHORT_PROMPT_MAX_Q + 1
CONTEXT_MAX_BYTES = 64 << 20
# Steps of one query token per sequence given slot_mapping store their K/V inside the attention kernel (False: store_kv
# first, as other steps do; a switch for A/B measurements, read at each call)
STORE_IN_KERNEL = True
# The leading one-token rows of a mixed step (decode rows ahead of prompt chunks) as a decode launch of their own
# (attention_launch.attend_leading_rows) instead of whole prompt tiles of the one launch: "cuda_fp8" = where the CUDA
# fp8 decode kernel runs them (fp8 caches, measured on the H100: notes/fp8_kv.md, session 33), "always" (tests, A/B
# runs: also the Triton decode tiles), "never". Read at each call.
DECODE_ROWS_APART = "cuda_fp8"


# Sequence counts that pick each width of the kernel's sequence search (a compile-time constant): a
# warm-up that wants every variant compiled runs one batch of each.
SEARCH_BLOCK_SEQ_COUNTS = (1, 64, 256)


def config_for_batch(
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    q_dtype: torch.dtype,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    cuda_fp8_decode: bool = False,
) -> AttentionConfig:
    """The tile config ``paged_attention`` launches for a batch of this shape (the warm-up compiles by it too);
    ``cuda_fp8_decode``: a one-query-per-sequence batch will run on the CUDA fp8 decode kernel."""
    num_kv_heads = k_cache.shape[2]
    return choose_config(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        num_kv_heads=num_kv_heads,
        group=num_heads // num_kv_heads,
        head_dim_pad=next_power_of_2(max(k_cache.shape[3], v_cache.shape[3])),
        elem_size=q_dtype.itemsize,
        kv_elem_size=k_cache.element_size(),
        max_seqlen_q=max(1, max_seqlen_q),
        max_seqlen_k=max_seqlen_k,
        device=k_cache.device,
        cuda_fp8_decode=cuda_fp8_decode,
    )


def _step_descriptor(t: torch.Tensor, tile_n: int) -> TensorDescriptor:
    return TensorDescriptor(t, shape=list(t.shape), strides=list(t.stride()), block_shape=[tile_n, 1, t.shape[2]])


@launches_on_first_tensor_gpu
def paged_attention_with_config(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float,
    config: AttentionConfig,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    launch_pdl: bool = False,
    step_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    context_rows: int = 0,
    context_min_q: int = CONTEXT_MIN_Q,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None,
    decode_rows: AttentionConfig | None = None,
) -> torch.Tensor:
    """paged_attention with an explicit tile config (tests, tuning); arguments are not re-checked.

    ``out`` (contiguous ``[T, num_heads, head_dim_v]`` in q's dtype) is written in place when given. ``step_kv``:
    the step's own keys and values ``[T, num_kv_heads, D]`` (already stored), which unmasked tiles of keys computed
    in this step then read by TMA (``step_kv_usable`` says when that applies; otherwise they are ignored).
    ``context_rows`` > 0 (a multiple of the tile; with ``step_kv`` given, no sliding window and
    ``context_rows_usable``, else ignored): first copy the whole-tile cached context (fp8 caches: all the keys) of
    chunks of at least ``context_min_q`` tokens into that many contiguous rows, which those tiles then read by TMA.
    ``store``: ``(key, value, slot_mapping)`` of a step with exactly one query token per sequence (the caller
    guarantees it): the kernel first writes each token's K/V row at its slot (-1 = none), as ``store_kv`` would.
    ``decode_rows``: a one-query config (``one_query``) for the leading one-token rows of a mixed step (sequences b with
    ``cu_seqlens_q[b : b + 2] = b, b + 1``), which then run as a decode batch of their own before the launch of
    ``config`` (a prompt config without splits or store; else ignored) over the other rows.
    """
    num_tokens, num_heads = q.shape[0], q.shape[1]
    num_kv_heads = k_cache.shape[2]
    head_dim_v = v_cache.shape[3]
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim_v, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m = max(config.block_m, next_power_of_2(group))
    block_q = max(1, block_m // group)
    if config.one_query:  # one query token per sequence: one program each
        num_programs = num_seqs
    else:
        num_programs = num_tokens if block_q == 1 else num_tokens // block_q + num_seqs
    use_window = sliding_window is not None and sliding_window > 0
    split = config.num_splits > 1
    fp8 = k_cache.dtype in FP8_DTYPES
    head_dim_v_pad = next_power_of_2(max(16, head_dim_v))
    split_bufs = (
        split_workspace(num_tokens * num_heads * config.num_splits, head_dim_v_pad, q.device) if split else None
    )
    k_desc = v_desc = k_ctx_desc = v_ctx_desc = ctx_offsets = None
    if step_kv is not None and not split:  # else ignored
        if step_kv_usable(q, k_cache, v_cache, *step_kv):
            k_desc, v_desc = (_step_descriptor(t, config.tile_n) for t in step_kv)
        if context_rows > 0 and not use_window and context_rows_usable(q, k_cache, v_cache):
            *rows, ctx_offsets = copy_context_rows(
                k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, capacity=context_rows, tile_n=config.tile_n,
                min_q=context_min_q, search_block=search_block(num_seqs), whole_sequence=fp8,
                rows_dtype=context_rows_dtype(q.dtype, k_cache.dtype), launch_pdl=launch_pdl,
            )  # fmt: skip
            k_ctx_desc, v_ctx_desc = (_step_descriptor(t, config.tile_n) for t in rows)
    options = dict(scale=scale, softcap=softcap, sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale,
                   sinks=sinks, launch_pdl=launch_pdl)  # fmt: skip
    leading = 0
    if decode_rows is not None and decode_rows.one_query and not config.one_query and not split and store is None:
        # the leading one-token rows first, as a decode batch; the launch below leaves them alone
        attend_leading_rows(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, config=decode_rows,
                            **options)  # fmt: skip
        leading = 2
    if config.one_query and fp8_decode_usable(
        q, k_cache, v_cache, sliding_window=sliding_window, softcap=softcap, sinks=sinks,
        split_target_programs=config.split_target_programs, store=store is not None, out=out,
    ):  # fmt: skip
        # decode steps over fp8 caches: the CUDA kernel (fp8_decode.py), then the same merge
        min_split_keys = config.min_split_tiles * config.tile_n
        fp8_decode(
            q, k_cache, v_cache, block_tables, seq_lens, scale=scale, k_scale=k_scale, v_scale=v_scale, out=out,
            store=store, split=(*split_bufs, config.num_splits, min_split_keys) if split else None,
        )  # fmt: skip
    else:
        # fresh prompts (no cached context) on Hopper: the Gluon kernel, and the Triton launch skips them
        fresh = k_desc is not None and store is None and fresh_prompts_usable(
            q, k_cache, v_cache, *step_kv, out, sliding_window=sliding_window, softcap=softcap, sinks=sinks,
            block_m=block_m, tile_n=config.tile_n, one_query=config.one_query, num_splits=config.num_splits,
        )  # fmt: skip
        if fresh:
            fresh = attend_fresh_prompts(q, *step_kv, seq_lens, cu_seqlens_q, out, scale=scale)
        launch_attention_kernel(
            q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, split_bufs, config=config,
            num_programs=num_programs, descriptors=(k_desc, v_desc, k_ctx_desc, v_ctx_desc, ctx_offsets),
            store=store, leading_rows=leading, skip_fresh=fresh, **options,
        )  # fmt: skip
    if split:
        merge_splits(out, split_bufs, num_tokens, config.num_splits, sinks, launch_pdl)
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    launch_pdl: bool = False,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention over a packed batch (GQA, sliding window, softcap) -> ``[T, num_heads, head_dim_v]``.

    fp8 caches (float8_e4m3fn / float8_e5m2) need ``k_scale``/``v_scale`` (one-element float32 tensors):
    K/V tiles are dequantized as they are loaded. ``launch_pdl``: programmatic dependent launch (see
    ``dependent_launch.py``; needs ``dependent_launch_supported``). ``key``/``value``: this step's own keys and
    values ``[T, num_kv_heads, D]``, as just stored into the cache (optional): prompt chunks then read the tiles of
    keys computed in this step from them by TMA instead of gathering through the block table (same values).
    ``slot_mapping`` (``[T]`` int32/int64, -1 = none; needs ``key``/``value``): store the step's keys and values into
    the caches first, as ``store_kv`` would; in a step of one query token per sequence (``max_seqlen_q`` 1 and as
    many tokens as sequences) the attention kernel writes them itself, one launch less. ``sinks`` (``[num_heads]``,
    16-64-bit floats, any stride): attention sinks, one logit per head that joins each row's softmax with no value
    (GPT-OSS's ``s_aux``).
    """
    check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, k_scale, v_scale, sinks)
    block_tables, seq_lens, cu_seqlens_q = unit_stride(block_tables), unit_stride(seq_lens), unit_stride(cu_seqlens_q)
    if sinks is not None and (sinks.dtype == torch.float64 or sinks.stride(0) != 1):
        sinks = sinks.to(torch.float32).contiguous()  # the kernels read 16/32-bit sinks of stride 1 (a copy per call)
    check_launch_pdl(launch_pdl, q.device)
    if not scale > 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")
    num_tokens, num_heads = q.shape[0], q.shape[1]
    num_seqs = seq_lens.shape[0]
    if max_seqlen_q is None or max_seqlen_k is None:
        # No hints: read them off the device (one sync), and check the packing while at it.
        cu = cu_seqlens_q.tolist()
        if cu[-1] != num_tokens:
            raise ValueError(f"cu_seqlens_q[-1] = {cu[-1]} must equal q.shape[0] = {num_tokens}")
        if max_seqlen_q is None:
            max_seqlen_q = max((cu[b + 1] - cu[b] for b in range(num_seqs)), default=0)
        if max_seqlen_k is None:
            max_seqlen_k = int(seq_lens.max()) if num_seqs else 0
    for name, hint in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(hint, int) or isinstance(hint, bool) or hint < 0:
            raise TypeError(f"{name} must be a non-negative host int, got {hint!r}")
    one_query = max_seqlen_q == 1 and num_tokens == num_seqs
    cuda_decode = one_query and fp8_decode_usable(
        q, k_cache, v_cache, sliding_window=sliding_window, softcap=softcap, sinks=sinks,
        store=slot_mapping is not None and key is not None and STORE_IN_KERNEL,
    )  # fmt: skip
    config = config_for_batch(
        num_tokens, num_seqs, num_heads, q.dtype, k_cache, v_cache, max_seqlen_q, max_seqlen_k, cuda_decode
    )
    if (key is None) != (value is None):
        raise ValueError("key and value go together: give both or neither")
    if key is not None:
        step_kv_usable(q, k_cache, v_cache, key, value)  # checks their shapes (whether the kernel reads them or not)
    store = None
    if slot_mapping is not None:
        if key is None:
            raise ValueError("slot_mapping stores the step's keys and values: give key and value too")
        if STORE_IN_KERNEL and max_seqlen_q == 1 and num_tokens == num_seqs:  # one query per sequence
            check_tensor("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64))
            check_devices(q=q, slot_mapping=slot_mapping)
            check_dim("slot_mapping", slot_mapping, 0, num_tokens, "q.shape[0], the number of tokens")
            store = (key, value, unit_stride(slot_mapping))
        else:
            store_kv(
                key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale, launch_pdl=launch_pdl
            )
    decode_rows = None  # mixed steps: the leading one-token rows as a decode launch of their own (DECODE_ROWS_APART)
    if DECODE_ROWS_APART not in ("cuda_fp8", "always", "never"):
        raise ValueError(f"DECODE_ROWS_APART must be 'cuda_fp8', 'always' or 'never', got {DECODE_ROWS_APART!r}")
    mixed = not one_query and num_seqs > 1 and not decode_like(max_seqlen_q, num_heads // k_cache.shape[2])
    if mixed and (
        DECODE_ROWS_APART == "always"
        or (DECODE_ROWS_APART == "cuda_fp8" and fp8_decode_usable(
            q, k_cache, v_cache, sliding_window=sliding_window, softcap=softcap, sinks=sinks
        ))
    ):  # fmt: skip
        decode_rows = config_for_batch(
            num_seqs, num_seqs, num_heads, q.dtype, k_cache, v_cache, 1, max_seqlen_k, DECODE_ROWS_APART != "always"
        )
    # prompt tiles only (decode tiles hold no whole tile of keys from the step); checked once, below
    use_step_kv = key is not None and config.num_splits == 1 and max_seqlen_q >= config.tile_n
    context_rows = 0
    long_runs = max_seqlen_q >= CONTEXT_MIN_RUN or k_cache.dtype in FP8_DTYPES
    if use_step_kv and num_tokens >= CONTEXT_MIN_TOKENS and long_runs:
        rows_dtype = context_rows_dtype(q.dtype, k_cache.dtype)
        context_rows = context_capacity(
            num_tokens, max_seqlen_k, k_cache, v_cache, config.tile_n, CONTEXT_MAX_BYTES, rows_dtype
        )
    return paged_attention_with_config(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scale=scale,
        config=config,
        sliding_window=sliding_window,
        softcap=softcap,
        k_scale=k_scale,
        v_scale=v_scale,
        launch_pdl=launch_pdl,
        step_kv=(key, value) if use_step_kv else None,
        context_rows=context_rows,
        context_min_q=CONTEXT_MIN_Q,
        store=store,
        sinks=sinks,
        decode_rows=decode_rows,
    )
