"""A CUDA decode-attention kernel for fp8 KV caches, compiled at run time by NVRTC (no toolkit needed).

Sessions 7-26 (notes/fp8_kv.md) measured the Triton decode tile for fp8 caches out at 2.1-2.6 TB/s of fp8 K/V
bytes against bf16's ~2.9: ``tl.dot`` over a converted tile loads both whole tiles into registers (253 per
thread, 2 CTAs per SM). ``fp8_decode_source.cu`` is a kernel of another structure for the steps the engine
graphs most (one query token per sequence, no split): per-warp cp.async rings, ldmatrix of the fp8 rows and
one ``cvt.f16x2`` per two values in registers, mma.sync in fp16 with fp32 accumulation, as
``paged_attention`` computes it (q scaled into fp16 by a power of two, P in fp16; results differ from the
Triton kernel's by summation order only).

``fp8_decode_usable`` says whether a call can take it; ``paged_attention`` routes there when it can and
``USE_CUDA_FP8_DECODE`` is on. It needs a GPU of compute capability 8.9+ (fp8 conversions), NVRTC (which
torch's CUDA wheels ship) and the driver library; anything missing makes ``fp8_decode_usable`` False, once, and
the Triton kernel serves.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
import threading
import warnings

import torch

from ._checks import FP8_DTYPES, FP8_MAX, unit_stride

# Switch for A/B measurements (read at each call; HFPAGED_CUDA_FP8_DECODE=0 starts it off).
USE_CUDA_FP8_DECODE = os.environ.get("HFPAGED_CUDA_FP8_DECODE", "1") != "0"
# Warps per CTA and ring stages per warp (H100 sweep: notes/fp8_kv.md, session 32).
NUM_WARPS = 4
NUM_STAGES = 2
HEAD_DIMS = (64, 128)
MAX_GROUP = 8

_PACK = struct.Struct("<15Q18qf")  # the kernel's parameters (see fp8_decode)
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fp8_decode_source.cu")
_LOCK = threading.Lock()
_KERNELS: dict[tuple, _Kernel] = {}
_UNAVAILABLE: dict[int, str] = {}  # device index -> why the kernel cannot be built there
_FAILED: set[tuple] = set()  # variants whose build failed (they stay on Triton)


class _Kernel:
    """One compiled variant on one device: a CUfunction and its launch shape."""

    def __init__(self, function: ctypes.c_void_p, module: ctypes.c_void_p, threads: int, smem: int) -> None:
        self.function, self.module, self.threads, self.smem = function, module, threads, smem

    def attribute(self, attr: int) -> int:
        value = ctypes.c_int()
        _check(_cuda().cuFuncGetAttribute(ctypes.byref(value), attr, self.function), "cuFuncGetAttribute")
        return value.value

    @property
    def registers(self) -> int:
        return self.attribute(4)  # CU_FUNC_ATTRIBUTE_NUM_REGS


_LIBS: dict[str, ctypes.CDLL] = {}


def _cuda() -> ctypes.CDLL:
    if "cuda" not in _LIBS:
        _LIBS["cuda"] = ctypes.CDLL("libcuda.so.1" if os.name != "nt" else "nvcuda.dll")
    return _LIBS["cuda"]


def _nvrtc() -> ctypes.CDLL:
    if "nvrtc" not in _LIBS:
        try:
            from torch.cuda._utils import _get_gpu_rtc_library  # torch loads the NVRTC it ships with

            lib = _get_gpu_rtc_library()
        except Exception:  # an older torch: the system's
            name = ctypes.util.find_library("nvrtc")
            if name is None:
                raise OSError("NVRTC (libnvrtc) not found") from None
            lib = ctypes.CDLL(name)
        _LIBS["nvrtc"] = lib
    return _LIBS["nvrtc"]


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {result}")


def _compile(defines: dict[str, int | str], arch: int) -> bytes:
    """NVRTC: the source with ``defines`` -> a cubin for sm_<arch> (raises RuntimeError with the log)."""
    nvrtc = _nvrtc()
    with open(_SOURCE, encoding="utf-8") as f:
        source = "".join(f"#define {k} {v}\n" for k, v in defines.items()) + f.read()
    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"fp8_decode.cu", 0, None, None) != 0:
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        options = [f"--gpu-architecture=sm_{arch}".encode(), b"--std=c++17", b"-default-device"]
        array = (ctypes.c_char_p * len(options))(*options)
        result = nvrtc.nvrtcCompileProgram(prog, len(options), array)
        if result != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile the fp8 decode kernel:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _check(nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


def _defines(head_dim: int, group: int, block_size: int, kv_dtype, q_dtype, store: bool) -> dict:
    return {
        "HEAD_DIM": head_dim,
        "GROUP": group,
        "NWARPS": NUM_WARPS,
        "NSTAGES": NUM_STAGES,
        "BLOCK_SIZE": block_size,
        "KV_E5M2": int(kv_dtype == torch.float8_e5m2),
        "Q_BF16": int(q_dtype == torch.bfloat16),
        "STORE_KV": int(store),
        "FP8_MAX": f"{FP8_MAX[kv_dtype]:.1f}f",
    }


def smem_bytes(head_dim: int, group: int) -> int:
    ring = NUM_WARPS * NUM_STAGES * 2 * 16 * head_dim
    merge = NUM_WARPS * group * (head_dim + 2) * 4
    return max(ring, merge)


def get_kernel(device: torch.device, **key) -> _Kernel:
    """The compiled variant for ``key`` (``_defines``' arguments) on ``device``, built on first use."""
    full_key = _key(device, key)
    index = full_key[0]
    kernel = _KERNELS.get(full_key)
    if kernel is not None:
        return kernel
    with _LOCK:
        if full_key in _KERNELS:
            return _KERNELS[full_key]
        major, minor = torch.cuda.get_device_capability(index)
        cubin = _compile(_defines(**key), major * 10 + minor)
        cuda = _cuda()
        with torch.cuda.device(index):
            torch.cuda.current_stream(index)  # makes the device's primary context current on this thread
            module, function = ctypes.c_void_p(), ctypes.c_void_p()
            _check(cuda.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
            _check(
                cuda.cuModuleGetFunction(ctypes.byref(function), module, b"hfpaged_fp8_decode"), "cuModuleGetFunction"
            )
            smem = smem_bytes(key["head_dim"], key["group"])
            _check(cuda.cuFuncSetAttribute(function, 8, smem), "cuFuncSetAttribute")  # max dynamic shared memory
        kernel = _Kernel(function, module, NUM_WARPS * 32, smem)
        _KERNELS[full_key] = kernel
        return kernel


def available(device: torch.device) -> bool:
    """Whether the kernel can be built on ``device`` (CUDA, compute capability 8.9+, NVRTC and the driver)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _UNAVAILABLE:
        return False
    reason = None
    if torch.version.cuda is None:
        reason = "not an NVIDIA build of torch"
    elif torch.cuda.get_device_capability(index) < (8, 9):
        reason = "fp8 conversions need compute capability 8.9+"
    else:
        try:
            _cuda()
            _nvrtc()
        except OSError as e:
            reason = str(e)
    if reason is not None:
        _UNAVAILABLE[index] = reason
        return False
    return True


def _variant(q, k_cache, store: bool) -> dict:
    """The compile-time settings (``_defines``' arguments) of a call."""
    return dict(
        head_dim=q.shape[2], group=q.shape[1] // k_cache.shape[2], block_size=k_cache.shape[1],
        kv_dtype=k_cache.dtype, q_dtype=q.dtype, store=store,
    )  # fmt: skip


def _key(device: torch.device, variant: dict) -> tuple:
    """A variant's entry in the compile cache: the device index, the launch shape and the compile-time settings."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (index, NUM_WARPS, NUM_STAGES, *sorted(variant.items()))


def _compiled(device: torch.device, variant: dict) -> bool:
    return _key(device, variant) in _KERNELS


def fp8_decode_usable(
    q,
    k_cache,
    v_cache,
    *,
    sliding_window,
    softcap,
    sinks,
    split_target_programs: int = 0,
    store: bool = False,
    out: torch.Tensor | None = None,
) -> bool:
    """Whether a one-query-per-sequence step can run on the CUDA kernel instead of the Triton one (splits sized by
    a batch-wide target, which no fp8 tile config asks for today, stay on Triton). While a CUDA graph is being
    captured only an already compiled variant is used (the engine's warm-up compiles its variants first; a module
    load is not a stream operation to put in a graph)."""
    if not USE_CUDA_FP8_DECODE or k_cache.dtype not in FP8_DTYPES or split_target_programs > 0:
        return False
    if (
        (sliding_window is not None and sliding_window > 0)
        or (softcap is not None and softcap > 0)
        or sinks is not None
    ):
        return False
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if q.dtype not in (torch.bfloat16, torch.float16) or head_dim not in HEAD_DIMS or v_cache.shape[3] != head_dim:
        return False
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP or k_cache.shape[1] % 16:
        return False
    # 16-byte rows for cp.async, 8-byte query loads, 4-byte output stores
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        return False
    for t, align in ((k_cache, 16), (v_cache, 16)):
        if t.data_ptr() % align or any(s % 16 for s in t.stride()[:3]):
            return False
    if q.data_ptr() % 8 or q.stride(0) % 4 or q.stride(1) % 4:
        return False
    if out is not None and (out.data_ptr() % 4 or out.stride(2) != 1 or out.stride(0) % 2 or out.stride(1) % 2):
        return False
    if not available(q.device):
        return False
    variant = _variant(q, k_cache, store)
    if torch.cuda.is_current_stream_capturing():
        return _compiled(q.device, variant)
    return _built(q.device, variant)


def _built(device: torch.device, variant: dict) -> bool:
    """Build the variant if needed; a failure (an NVRTC too old for the GPU, a cubin the driver refuses) warns once
    and leaves that variant to the Triton kernel from then on."""
    key = _key(device, variant)
    if key in _FAILED:
        return False
    try:
        get_kernel(device, **variant)
    except Exception as error:
        _FAILED.add(key)
        warnings.warn(
            f"hfpaged: the CUDA fp8 decode kernel could not be built for {device} ({error}); fp8 decode steps run the "
            "Triton kernel instead",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True


def fp8_decode(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    *,
    scale,
    k_scale,
    v_scale,
    out,
    store=None,
    split=None,
    leading_rows=None,
) -> None:
    """Write attention of each sequence's one query token into ``out`` (``[B, H, D]``, 4-byte aligned rows).

    ``store``: ``(key, value, slot_mapping)``: each sequence's K/V row is first written at its slot (-1 = none),
    quantized as ``store_kv`` would. ``split``: ``(acc, max, sum, num_splits, min_split_keys)``: each sequence's
    keys are split over ``num_splits`` CTAs (shares of at least ``min_split_keys``) that write unnormalised
    partials there in the Triton kernel's layout, for ``_merge_splits_kernel``; ``out`` is then not written.
    ``leading_rows``: a mixed step's ``cu_seqlens_q`` (int32): only its leading one-token rows are computed (sequence
    b with ``cu_seqlens_q[b] = b`` and ``cu_seqlens_q[b + 1] = b + 1``, whose query and output row is b); the other
    sequences' rows and partials are not written (no store then).
    The caller checked ``fp8_decode_usable`` and the shapes.
    """
    num_seqs = seq_lens.shape[0]  # one query row per sequence (leading_rows: the first rows of a longer q)
    num_kv_heads = k_cache.shape[2]
    if num_seqs == 0:
        return
    key, value, slots = store if store is not None else (q, q, seq_lens)
    split_acc, split_max, split_sum, num_splits, min_split_keys = split if split is not None else (q, q, q, 1, 0)
    if key.stride(-1) != 1 or value.stride(-1) != 1:  # the store reads each row's elements in order
        key, value = key.contiguous(), value.contiguous()
    # the kernel reads block-table rows, lengths, slots and cu_seqlens_q with unit strides (a graph's corner view of
    # its tables has them: no copy then)
    block_tables, seq_lens, slots = unit_stride(block_tables), unit_stride(seq_lens), unit_stride(slots)
    leading_rows = None if leading_rows is None else unit_stride(leading_rows)
    kernel = get_kernel(q.device, **_variant(q, k_cache, store is not None))
    pointers = (q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, out, key, value, slots) + (
        split_acc, split_max, split_sum,
    )  # fmt: skip
    leading = 0 if leading_rows is None else leading_rows.data_ptr()
    integers = (
        num_splits, min_split_keys, int(slots.dtype == torch.int64), q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1), key.stride(0), key.stride(1) if key.dim() > 2 else 0,
        value.stride(0), value.stride(1) if value.dim() > 2 else 0,
    )  # fmt: skip
    # the kernel's parameters as one buffer (cuLaunchKernel's ``extra``): 15 pointers and 18 8-byte integers, then
    # one float, with no padding (cheaper than a ctypes object per argument)
    args = _PACK.pack(*(t.data_ptr() for t in pointers), leading, *integers, float(scale) * 1.4426950408889634)
    size = ctypes.c_size_t(len(args))
    buffer = ctypes.create_string_buffer(args, len(args))
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buffer), 2, ctypes.addressof(size), 0)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    _check(
        _cuda().cuLaunchKernel(
            kernel.function,
            num_seqs,
            num_kv_heads,
            num_splits,
            kernel.threads,
            1,
            1,
            kernel.smem,
            ctypes.c_void_p(stream),
            None,
            extra,
        ),
        "cuLaunchKernel",
    )
