"""skinny_linear: ``x @ weight.T (+ bias)`` for a handful of rows (decode at batch 1-4), streaming the weight once.

At batch 1-2 a decode step is a chain of GEMVs over the model's weights. cuBLAS runs them with GEMM tiles
of 64 x 8 and split-K plus a reduce launch for short outputs; on the H100 (Qwen3-0.6B shape, bf16) the
4-12 MB projections reach 0.7-2.1 TB/s of ~3 TB/s. This kernel gives each program ``BLOCK_N`` output
columns and a slice of K (``SPLIT_K`` slices when the outputs alone would leave SMs idle), keeps one fp32
accumulator per row over ``[BLOCK_N, BLOCK_K]`` (one FMA per weight element, no dot-operand layout), and
reduces across K once at the end. Split slices store fp32 partial sums; the last slice of a column block to
arrive (an atomic counter that resets itself, so CUDA graphs can replay it) adds them in slice order (the
same bits every call) and writes the output: one launch, no reduce kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Largest number of rows this kernel takes (beyond it cuBLAS's GEMM tiles do better).
MAX_ROWS = 4


@triton.jit(do_not_specialize=["M"])  # M == 1 would otherwise be compiled in as a constant
def _skinny_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    bias_ptr,  # [N] or a dummy (HAS_BIAS False)
    y_ptr,  # [M, N]
    ws_ptr,  # [SPLIT_K, M_PAD, N] fp32 partial sums (SPLIT_K > 1)
    count_ptr,  # [cdiv(N, BLOCK_N)] int32, zero between calls (SPLIT_K > 1)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    rows_k = tl.zeros([BLOCK_K], dtype=tl.int32) + M  # the row count as a vector: masks stay tensors

    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        x0 = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        acc0 += w * x0[None, :]
        if M_PAD > 1:
            x1 = tl.load(x_ptr + stride_xm + offs_k, mask=k_ok & (rows_k > 1), other=0.0).to(tl.float32)
            acc1 += w * x1[None, :]
        if M_PAD > 2:
            x2 = tl.load(x_ptr + 2 * stride_xm + offs_k, mask=k_ok & (rows_k > 2), other=0.0).to(tl.float32)
            acc2 += w * x2[None, :]
            x3 = tl.load(x_ptr + 3 * stride_xm + offs_k, mask=k_ok & (rows_k > 3), other=0.0).to(tl.float32)
            acc3 += w * x3[None, :]
    y0 = tl.sum(acc0, axis=1)
    y1 = tl.sum(acc1, axis=1)
    y2 = tl.sum(acc2, axis=1)
    y3 = tl.sum(acc3, axis=1)

    if SPLIT_K > 1:
        # this slice's partial sums go to the workspace; the last slice of the column block to arrive adds them
        # up in slice order (deterministic: the same inputs give the same bits) and writes the output
        ws = ws_ptr + pid_k * (M_PAD * N) + offs_n
        tl.store(ws, y0, mask=n_ok)
        if M_PAD > 1:
            tl.store(ws + N, y1, mask=n_ok)
        if M_PAD > 2:
            tl.store(ws + 2 * N, y2, mask=n_ok)
            tl.store(ws + 3 * N, y3, mask=n_ok)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")  # releases the stores above
        if arrived == SPLIT_K - 1:
            y0 = tl.zeros([BLOCK_N], dtype=tl.float32)
            y1 = tl.zeros([BLOCK_N], dtype=tl.float32)
            y2 = tl.zeros([BLOCK_N], dtype=tl.float32)
            y3 = tl.zeros([BLOCK_N], dtype=tl.float32)
            for part in tl.static_range(SPLIT_K):
                at = ws_ptr + part * (M_PAD * N) + offs_n
                y0 += tl.load(at, mask=n_ok, other=0.0, cache_modifier=".cg")  # through L2: the other slices' stores
                if M_PAD > 1:
                    y1 += tl.load(at + N, mask=n_ok, other=0.0, cache_modifier=".cg")
                if M_PAD > 2:
                    y2 += tl.load(at + 2 * N, mask=n_ok, other=0.0, cache_modifier=".cg")
                    y3 += tl.load(at + 3 * N, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed")  # ready for the next call (and graph replay)
            _store_rows(y_ptr, bias_ptr, y0, y1, y2, y3, offs_n, n_ok, M, stride_ym, M_PAD, HAS_BIAS)
    else:
        _store_rows(y_ptr, bias_ptr, y0, y1, y2, y3, offs_n, n_ok, M, stride_ym, M_PAD, HAS_BIAS)


@triton.jit
def _store_rows(y_ptr, bias_ptr, y0, y1, y2, y3, offs_n, n_ok, M, stride_ym, M_PAD: tl.constexpr,
                HAS_BIAS: tl.constexpr):  # fmt: skip
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        y0 += b
        y1 += b
        y2 += b
        y3 += b
    out_ty = y_ptr.dtype.element_ty
    rows = tl.zeros_like(offs_n) + M
    tl.store(y_ptr + offs_n, y0.to(out_ty), mask=n_ok)
    if M_PAD > 1:
        tl.store(y_ptr + stride_ym + offs_n, y1.to(out_ty), mask=n_ok & (rows > 1))
    if M_PAD > 2:
        tl.store(y_ptr + 2 * stride_ym + offs_n, y2.to(out_ty), mask=n_ok & (rows > 2))
        tl.store(y_ptr + 3 * stride_ym + offs_n, y3.to(out_ty), mask=n_ok & (rows > 3))


# Per-device scratch of the split-K path: fp32 partial sums and arrival counters (zero between calls: each
# call's last slice resets its counter). A CUDA graph keeps pointing at the buffers it captured, so a shape that
# needs more than exists gets new buffers and the old ones stay alive with the graphs that use them.
_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch(device: torch.device, split_k: int, m_pad: int, n: int, blocks: int):
    # per stream as well: calls on different streams (other threads, other graphs' captures) may overlap
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream, split_k, m_pad, n)
    found = _SCRATCH.get(key)
    if found is None:
        found = (torch.empty(split_k * m_pad * n, dtype=torch.float32, device=device),
                 torch.zeros(blocks, dtype=torch.int32, device=device))  # fmt: skip
        _SCRATCH[key] = found
    return found


def skinny_config(m: int, n: int, k: int, sm_count: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_warps) for an ``m x k`` by ``k x n`` product."""
    block_n = 8
    block_k = 256 if k >= 256 else max(16, triton.next_power_of_2(k))
    programs = triton.cdiv(n, block_n)
    split_k = 1
    while programs * split_k < 2 * sm_count and k // (split_k * 2) >= 4 * block_k and split_k < 16:
        split_k *= 2
    return block_n, block_k, split_k, 4


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config=None):
    """``x @ weight.T + bias`` for 2-D ``x`` of at most ``MAX_ROWS`` rows (16/32-bit floats, contiguous rows)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"skinny_linear takes 1-{MAX_ROWS} rows, got {m}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("skinny_linear needs rows with unit stride (x and weight)")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"skinny_linear: bias must be a contiguous [{n}] vector, got {tuple(bias.shape)}")
    device = x.device
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    block_n, block_k, split_k, num_warps = config or skinny_config(m, n, k, sm_count)
    m_pad = 1 if m == 1 else (2 if m == 2 else 4)
    y = torch.empty(m, n, dtype=x.dtype, device=device)
    blocks = triton.cdiv(n, block_n)
    if split_k > 1:
        ws, count = _scratch(device, split_k, m_pad, n, blocks)
    else:
        ws, count = y, y  # unused
    _skinny_kernel[(blocks, split_k)](
        x, weight, bias if bias is not None else y, y, ws, count,
        m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        M_PAD=m_pad, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, HAS_BIAS=bias is not None,
        num_warps=num_warps,
    )  # fmt: skip
    return y
