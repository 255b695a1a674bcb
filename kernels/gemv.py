"""Linear projections of one row (decode steps of one sequence) as a Triton GEMV.

At one row a projection is a read of its weight: cuBLAS's kernels reach ~1 TB/s on the 4-12 MB
projections of a small model (a latency floor of ~5-8 us each, notes/engine_perf.md, session 10), and they take no
part in programmatic dependent launch. This kernel gives each program a slice of BLOCK_N output features and loads
the whole ``[BLOCK_N, K]`` slice of the weight into registers *before* its dependent-launch wait: weights are no
kernel's output within a step, so with dependent launch those loads overlap the kernel before it
(``dependent_launch.py``). After the wait it reads the rows, reduces in fp32 and writes them; it signals the next
kernel after its wait, as every hfpaged kernel does. Not bitwise equal to cuBLAS (another summation order); the
engine uses it for 16-bit weights only (``EngineConfig.gemv``).

Two neighbours of a projection can run inside it (``hfpaged/model/gemv_fusion.py`` rewrites the compiled layers so):
an RMSNorm of the input row (``norm_weight``: each program normalizes the whole row it reads anyway, in transformers'
order of roundings) and a residual add of the output (``residual``: ``residual + y`` rounded as torch adds). Each
takes one kernel, and its dependent-launch link, out of a one-row step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_devices, launches_on_first_tensor_gpu, next_power_of_2
from .attention_config import _sm_count
from .dependent_launch import check_launch_pdl, launch_options, wait_for_previous_kernel

GEMV_MAX_ROWS = 1  # rows the GEMV takes (the kernel unrolls ROWS; two measured slower than cuBLAS on larger models)
# Weight elements one program holds (64 per thread at GEMV_NUM_WARPS warps): several programs per SM, one loading while
# another reduces. H100 sweep (session 19, probe C): 8192 / 4 warps beat 32768 / 8 warps by 1.5-5 us per layer.
REGISTER_ELEMENTS = 8192
GEMV_NUM_WARPS = 4
MAX_K_PAD = 16384  # widest (padded) input: one weight row per program there (Llama-3.1-8B's down_proj: 14,336)
GEMV_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit  # N and stride_w specialized (divisible by 16): aligned vector loads of the weight rows
def _gemv_kernel(
    x_ptr,  # [ROWS, K], unit stride along K
    w_ptr,  # [N, K], unit stride along K
    b_ptr,  # [N] (read when HAS_BIAS)
    y_ptr,  # [ROWS, N], unit stride along N
    nw_ptr,  # [K] RMSNorm weight (read when NORM)
    r_ptr,  # [ROWS, N] residual, unit stride along N (read when RESIDUAL)
    N,
    stride_x,
    stride_w,
    stride_y,
    stride_r,
    eps,
    ROWS: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, K_PAD)
    n_ok = offs_n < N
    k_ok = offs_k < K
    # the program's whole weight slice first: no kernel of the step writes weights, so these loads may run before
    # the wait (under dependent launch, while the previous kernel finishes)
    w = tl.load(
        w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :],
        mask=n_ok[:, None] & k_ok[None, :],
        other=0.0,
    )
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if NORM:  # a weight too: loaded before the wait
        norm_w = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    wait_for_previous_kernel(USE_PDL)
    dtype = y_ptr.dtype.element_ty
    for row in tl.static_range(ROWS):
        x = tl.load(x_ptr + row * stride_x + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        if NORM:  # transformers' RMSNorm: (w * (x * rsqrt(mean(x^2) + eps)).to(dtype)), the product in dtype
            inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
            x = (norm_w * (x * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if HAS_BIAS:
            acc += bias
        if RESIDUAL:  # residual + y, y rounded first as the unfused projection's output is
            res = tl.load(r_ptr + row * stride_r + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            acc = acc.to(dtype).to(tl.float32) + res
        tl.store(y_ptr + row * stride_y + offs_n, acc.to(dtype), mask=n_ok)


def gemv_block_n(num_features: int, in_features: int, device: torch.device) -> int:
    """Output features per program: as many as REGISTER_ELEMENTS allows for the padded input width (at least one),
    and no more than gives about one program per SM."""
    per_sm = next_power_of_2(max(1, num_features // _sm_count(device)))
    return max(1, min(REGISTER_ELEMENTS // next_power_of_2(in_features), per_sm))


def gemv_supports(weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``linear_few_rows`` takes this weight (and bias): 2-D, 16-bit, unit stride along the input, an input
    width of at most MAX_K_PAD (padded), a bias (if any) of the weight's dtype, device and features."""
    if weight.dim() != 2 or weight.dtype not in GEMV_DTYPES or weight.stride(1) != 1 or weight.shape[0] == 0:
        return False
    if next_power_of_2(weight.shape[1]) > MAX_K_PAD:
        return False
    return bias is None or (
        bias.shape == (weight.shape[0],) and bias.dtype == weight.dtype and bias.device == weight.device
    )


@launches_on_first_tensor_gpu
def linear_few_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    launch_pdl: bool = False,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for at most GEMV_MAX_ROWS rows (``x`` is ``[..., K]``) by the GEMV kernel;
    ``gemv_supports(weight, bias)`` must hold and ``x`` must have the weight's dtype. ``launch_pdl``: programmatic
    dependent launch (``dependent_launch.py``). ``norm_weight`` (``[K]``, x's dtype): the input is first normalized
    as transformers' RMSNorm does, with ``norm_eps``; ``residual`` (the output's shape and dtype): returns
    ``residual + F.linear(...)``."""
    given = {"bias": bias, "norm_weight": norm_weight, "residual": residual}
    check_devices(x=x, weight=weight, **{name: t for name, t in given.items() if t is not None})
    check_launch_pdl(launch_pdl, x.device)
    if not gemv_supports(weight, bias):
        raise ValueError(
            f"linear_few_rows takes a 2-D {'/'.join(str(d) for d in GEMV_DTYPES)} weight with unit stride along its "
            f"input of at most {MAX_K_PAD} (padded) and a matching bias; got weight {list(weight.shape)} "
            f"{weight.dtype} strides {weight.stride()}"
            + ("" if bias is None else f", bias {list(bias.shape)} {bias.dtype}")
        )
    num_features, in_features = weight.shape
    if x.shape[-1] != in_features or x.dtype != weight.dtype:
        raise ValueError(
            f"x must be [..., {in_features}] {weight.dtype} (the weight's input width and dtype), got "
            f"{list(x.shape)} {x.dtype}"
        )
    rows = x.reshape(-1, in_features)
    if rows.shape[0] > GEMV_MAX_ROWS:
        raise ValueError(f"linear_few_rows takes at most {GEMV_MAX_ROWS} rows, got {rows.shape[0]}")
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], num_features, dtype=x.dtype, device=x.device)
    if norm_weight is not None and (norm_weight.shape != (in_features,) or norm_weight.dtype != x.dtype):
        raise ValueError(
            f"norm_weight must be [{in_features}] {x.dtype}, got {list(norm_weight.shape)} {norm_weight.dtype}"
        )
    if residual is not None:
        if residual.shape != out.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual must be {list(out.shape)} {x.dtype} (the output's shape and dtype), got "
                f"{list(residual.shape)} {residual.dtype}"
            )
        residual = residual.reshape(-1, num_features)
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
    if rows.shape[0] == 0:
        return out
    block_n = gemv_block_n(num_features, in_features, x.device)
    _gemv_kernel[(triton.cdiv(num_features, block_n),)](
        rows,
        weight,
        weight if bias is None else bias,
        out,
        weight if norm_weight is None else norm_weight,
        out if residual is None else residual,
        num_features,
        rows.stride(0),
        weight.stride(0),
        num_features,
        0 if residual is None else residual.stride(0),
        float(norm_eps),
        ROWS=rows.shape[0],
        K=in_features,
        K_PAD=next_power_of_2(in_features),
        BLOCK_N=block_n,
        HAS_BIAS=bias is not None,
        NORM=norm_weight is not None,
        RESIDUAL=residual is not None,
        USE_PDL=launch_pdl,
        num_warps=GEMV_NUM_WARPS,
        **launch_options(launch_pdl),
    )
    return out
