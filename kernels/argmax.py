"""row_argmax: ``x.argmax(dim=-1)`` of a few long rows (greedy sampling's logits) in two short launches.

torch reduces one long row in a single block or through several small kernels; its time depends on the row
length (H100: 8.8 us for 151,936 logits, 26 us for 128,256). Here program (row, chunk) reduces CHUNK values to
(max, first index of the max) and a second launch reduces each row's chunk results. torch's rules are kept:
the first index wins a tie, a NaN counts as larger than everything (the first NaN's index is returned), and a
row of -inf returns 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_devices, check_tensor, launches_on_first_tensor_gpu, next_power_of_2

CHUNK = 2048
_NO_INDEX = 2**31 - 1  # larger than any index


@triton.jit
def _reduce(values, index, NO_INDEX: tl.constexpr):
    # (value, first index) of the maximum; a NaN beats every number (its first index wins among NaNs)
    is_nan = values != values
    nan_index = tl.min(tl.where(is_nan, index, NO_INDEX), 0)
    top = tl.max(tl.where(is_nan, float("-inf"), values), 0)
    first = tl.min(tl.where(values == top, index, NO_INDEX), 0)
    has_nan = nan_index < NO_INDEX
    return tl.where(has_nan, float("nan"), top), tl.where(has_nan, nan_index, first)


@triton.jit(do_not_specialize=["vocab", "num_chunks"])
def _chunk_argmax_kernel(
    x_ptr, top_ptr, index_ptr, vocab, num_chunks, stride_row, CHUNK: tl.constexpr, NO_INDEX: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    # positions past the row read -inf: never above a value of the row, and after all of its indices
    values = tl.load(x_ptr + row * stride_row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    top, first = _reduce(values, offs, NO_INDEX)
    tl.store(top_ptr + row * num_chunks + chunk, top)
    tl.store(index_ptr + row * num_chunks + chunk, first)


@triton.jit(do_not_specialize=["num_chunks"])
def _row_argmax_kernel(top_ptr, index_ptr, out_ptr, num_chunks, CHUNKS_PAD: tl.constexpr, NO_INDEX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNKS_PAD)
    ok = offs < num_chunks
    tops = tl.load(top_ptr + row * num_chunks + offs, mask=ok, other=float("-inf"))
    index = tl.load(index_ptr + row * num_chunks + offs, mask=ok, other=NO_INDEX)
    # chunks are in index order, so the smallest index among equal maxima (or among NaNs) is the first one
    _, first = _reduce(tops, index, NO_INDEX)
    tl.store(out_ptr + row, first.to(tl.int64))


@launches_on_first_tensor_gpu
def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (int64) of a 2-D float tensor whose rows are contiguous; ties go to the first
    index and a NaN wins, as in torch."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_devices(x=x)
    if x.stride(1) != 1:
        raise ValueError(f"x must have contiguous rows (stride(1) == 1), got strides {tuple(x.stride())}")
    num_rows, vocab = x.shape
    if vocab == 0:
        raise ValueError("argmax of an empty row: x.shape[1] is 0")
    if vocab >= _NO_INDEX:
        raise ValueError(f"rows of at most {_NO_INDEX - 1} values, got {vocab}")
    out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    if num_rows == 0:
        return out
    num_chunks = triton.cdiv(vocab, CHUNK)
    top = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=x.device)
    index = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=x.device)
    _chunk_argmax_kernel[(num_rows, num_chunks)](
        x, top, index, vocab, num_chunks, x.stride(0), CHUNK=CHUNK, NO_INDEX=_NO_INDEX, num_warps=4
    )
    chunks_pad = next_power_of_2(max(num_chunks, 16))
    _row_argmax_kernel[(num_rows,)](
        top, index, out, num_chunks, CHUNKS_PAD=chunks_pad, NO_INDEX=_NO_INDEX, num_warps=4 if chunks_pad <= 1024 else 8
    )
    return out
