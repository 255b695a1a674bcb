"""Long prefill chunks through torch's ``scaled_dot_product_attention`` instead of the paged kernel.

Why: the attention of a long prompt is compute-bound, and on Hopper cuDNN's fused attention (what SDPA picks for
16-bit inputs) runs it at ~1.7x the FLOP rate of our Triton prefill tiles, which gather keys through the block
table (notes/kernels.md: 57-60% of cuDNN at 4-8k tokens). vLLM does the same: FlashAttention for prefill, its
paged kernels for the rest. Decode rows and short chunks keep the paged kernel (SDPA has no paged keys, and one
call per sequence costs host time that short chunks do not pay back).

Only steps that run without a CUDA graph anyway take this path (``enforce_eager``, layers on several devices,
steps too wide for the graphs): a step taken out of the graphs for it runs its layers eagerly, ~1-2 ms of host
time per layer, more than cuDNN saves on a small model (measured: notes/kernels.md, session 15).

A step's *plan* names, on the host, the sequences whose query chunk is at least ``min_tokens`` long: entries
``(b, q_start, context, length)`` (sequence index, first token row, keys before the chunk, chunk length). For each
layer the keys of such a sequence are its whole context plus the chunk: the chunk's own keys as the layer computed
them (16-bit caches: the cache holds the same values) or, for fp8 caches and for the context, read back from the
cache (dequantized: the same values the paged kernel would read). SDPA's ``is_causal`` aligns the mask top-left,
so a chunk with context runs with ``context`` zero query rows in front (their outputs are dropped); a plan takes
such a chunk only while that padding costs at most ``MAX_PADDED_COST`` times the chunk's own attention. Lengths are
rounded up to a coarse ladder (``padded_length``): cuDNN builds an execution plan per shape.

The paged kernel then runs over the step with the planned sequences' ``seq_lens`` set to 0, which it skips (their
rows are left to the caller, see ``kernels/paged_attention.py``), and the SDPA outputs fill those rows.
"""

from __future__ import annotations

import torch

from ..core.block_pool import cdiv
from ..kernels.reference import dequantize

DEFAULT_MIN_TOKENS = 2048  # CUDA, 16-bit models: chunks long enough that cuDNN saves far more than the step's
# host time outside the CUDA graphs costs (H100: ~1.8x our prefill tiles)
MAX_SEQS = 8  # planned sequences per step (one SDPA launch per layer each); the rest stay paged
MAX_PADDED_COST = 1.5  # (context + chunk)^2 / (2 context chunk + chunk^2): padding rows in front of a chunk
_LAYOUT = "bhsd"  # SDPA buffers: "bhsd" contiguous [1, heads, N, D]; "bshd" [1, N, heads, D] viewed transposed

Entry = tuple[int, int, int, int]


def resolve_min_tokens(setting: int | None, device: torch.device, dtypes: list[torch.dtype]) -> int:
    """The engine's threshold: ``setting`` if given (0: off); None: ``DEFAULT_MIN_TOKENS`` on CUDA when every
    layer computes in 16 bits (cuDNN/FlashAttention need them), otherwise off."""
    if setting is not None:
        return setting
    if device.type == "cuda" and dtypes and all(d in (torch.float16, torch.bfloat16) for d in dtypes):
        return DEFAULT_MIN_TOKENS
    return 0


def plan(scheduled, min_tokens: int) -> list[Entry]:
    """The sequences of a step (``ScheduledRequest``s in batch order) whose chunk attends through SDPA."""
    entries: list[Entry] = []
    if min_tokens <= 0:
        return entries
    q_start = 0
    for b, request in enumerate(scheduled):
        length, context = request.num_tokens, request.start
        padded_cost_ok = (context + length) ** 2 <= MAX_PADDED_COST * (2 * context * length + length * length)
        if length >= min_tokens and len(entries) < MAX_SEQS and padded_cost_ok:
            entries.append((b, q_start, context, length))
        q_start += length
    return entries


def applies(entries: list[Entry], sliding_window, softcap, head_dim: int, head_dim_v: int) -> bool:
    """Whether this layer can take the plan (SDPA has no softcap; windows and unequal K/V widths stay paged)."""
    return bool(entries) and not sliding_window and not softcap and head_dim == head_dim_v


def padded_length(num_keys: int) -> int:
    """The SDPA length a sequence of ``num_keys`` keys runs at: cuDNN builds an execution plan per shape (tens of
    ms each), so lengths are rounded up to a coarse ladder (multiples of 256 up to 4k, of 512 up to 8k, 1k up to
    16k, 2k beyond) and the plans of a process stay few; the padding costs at most 1/16 of the attention."""
    step = 256 if num_keys <= 4096 else 512 if num_keys <= 8192 else 1024 if num_keys <= 16384 else 2048
    return cdiv(num_keys, step) * step


def _cache_rows(cache: torch.Tensor, block_tables: torch.Tensor, b: int, num_keys: int) -> torch.Tensor:
    """The first ``num_keys`` cached rows ``[num_keys, kv_heads, D]`` of sequence ``b`` (raw cache dtype)."""
    block_size = cache.shape[1]
    blocks = block_tables[b, : cdiv(num_keys, block_size)].long()
    raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache  # fp8 gathers as bytes (CPU has no fp8)
    rows = raw.index_select(0, blocks).reshape(-1, *cache.shape[2:])[:num_keys]
    return rows.view(cache.dtype)


def _fill_keys(buffer, cache, chunk, block_tables, b, context, scale) -> None:
    """Write sequence ``b``'s ``context + length`` keys (or values) into ``buffer[:context + length]``
    (``[keys, kv_heads, D]`` view of a ``[1, kv_heads, N, D]`` buffer)."""
    length = chunk.shape[0]
    if cache.element_size() == 1:  # fp8: every key as the cache holds it (the chunk was stored before)
        rows = _cache_rows(cache, block_tables, b, context + length)
        buffer[: context + length] = dequantize(rows, scale).to(buffer.dtype)
        return
    if context:
        buffer[:context] = _cache_rows(cache, block_tables, b, context)
    buffer[context : context + length] = chunk


def attend(
    entries: list[Entry],
    paged_fn,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    **paged_kwargs,
) -> torch.Tensor:
    """Attention of a step whose planned sequences go through SDPA (after ``store_kv`` stored the step's keys);
    q ``[T, heads, D]``, key/value ``[T, kv_heads, D]`` -> ``[T, heads, D]``. Nothing here waits for the device."""
    num_heads, num_kv_heads, head_dim = q.shape[1], key.shape[1], q.shape[2]
    if len(entries) == seq_lens.shape[0]:  # every sequence planned: nothing for the paged kernel
        out = q.new_empty(q.shape[0], num_heads, v_cache.shape[-1])
    else:
        paged_lens = seq_lens.clone()
        for entry in entries:
            paged_lens[entry[0]] = 0  # a fill on the device (no host -> device copy): the kernel skips it
        out = paged_fn(
            q, k_cache, v_cache, block_tables, paged_lens, cu_seqlens_q, scale=scale, k_scale=k_scale,
            v_scale=v_scale, **paged_kwargs,
        )  # fmt: skip
    for b, q_start, context, length in entries:
        rows = slice(q_start, q_start + length)
        end = context + length
        padded = padded_length(end)
        # [1, N, heads, D] rows (seen by SDPA as [1, heads, N, D]): the chunk's queries after `context` zero rows
        # (SDPA's causal mask is top-left), keys and values followed by zeros (seen only by the padding rows past
        # `end`, whose outputs are dropped)
        queries = _buffer(q, padded, num_heads, head_dim)
        keys = _buffer(q, padded, num_kv_heads, head_dim)
        values = _buffer(q, padded, num_kv_heads, v_cache.shape[-1])
        queries[:context] = 0
        queries[end:] = 0
        queries[context:end] = q[rows]
        for buffer, cache, chunk, cache_scale in ((keys, k_cache, key, k_scale), (values, v_cache, value, v_scale)):
            buffer[end:] = 0
            _fill_keys(buffer, cache, chunk[rows], block_tables, b, context, cache_scale)
        attended = torch.nn.functional.scaled_dot_product_attention(
            _sdpa_view(queries), _sdpa_view(keys), _sdpa_view(values), is_causal=True, scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )  # fmt: skip
        out[rows] = attended[0, :, context:end].transpose(0, 1)
    return out


def _buffer(like: torch.Tensor, length: int, heads: int, dim: int) -> torch.Tensor:
    """A ``[length, heads, D]`` view of a new SDPA input buffer in ``_LAYOUT``."""
    if _LAYOUT == "bhsd":
        return like.new_empty(1, heads, length, dim)[0].transpose(0, 1)
    return like.new_empty(1, length, heads, dim)[0]


def _sdpa_view(rows: torch.Tensor) -> torch.Tensor:
    """``[1, heads, N, D]`` of a ``_buffer`` view."""
    return rows.transpose(0, 1).unsqueeze(0)
