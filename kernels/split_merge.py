"""Merge of split-context partials (flash-decoding): one program per (token, query head)."""

import triton
import triton.language as tl

from .attention_kernel import _sink_weight
from .dependent_launch import wait_for_previous_kernel


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    out_ptr,  # [T, NUM_HEADS, HEAD_DIM_V]
    split_acc_ptr,  # [T, NUM_HEADS, num_splits, HEAD_DIM_V_PAD] fp32
    split_max_ptr,  # [T, NUM_HEADS, num_splits] fp32
    split_sum_ptr,  # [T, NUM_HEADS, num_splits] fp32
    sinks_ptr,  # [NUM_HEADS] float, read when USE_SINKS (attention sinks: added once, here)
    num_splits,
    stride_out_t,
    stride_out_h,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
    USE_SINKS: tl.constexpr = False,
    LEADING_ROWS: tl.constexpr = False,  # only the leading one-token rows (token b: cu_seqlens_q[b : b + 2] = b, b + 1)
    cu_seqlens_q_ptr=None,  # [B + 1] int32, read when LEADING_ROWS
):
    wait_for_previous_kernel(USE_PDL)  # every program, skipped ones too (dependent_launch.py)
    if LEADING_ROWS:
        program = tl.program_id(0)
        if (tl.load(cu_seqlens_q_ptr + program) != program) | (tl.load(cu_seqlens_q_ptr + program + 1) != program + 1):
            return
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    split_ok = offs_s < num_splits
    row = (token * NUM_HEADS + head) * num_splits + offs_s
    m = tl.load(split_max_ptr + row, mask=split_ok, other=float("-inf"))
    sums = tl.load(split_sum_ptr + row, mask=split_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_ref)  # empty splits: exp2(-inf) = 0
    denom = tl.sum(sums * weight, 0)
    if USE_SINKS:
        denom += _sink_weight(sinks_ptr, head, True, m_ref)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    # splits that saw no key (m = -inf: empty splits write no accumulator) are not read
    acc_ok = split_ok & (m > float("-inf"))
    acc = tl.load(split_acc_ptr + row[:, None] * HEAD_DIM_V_PAD + offs_dv[None, :], mask=acc_ok[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        out_ptr + token * stride_out_t + head * stride_out_h + offs_dv,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_dv < HEAD_DIM_V,
    )
