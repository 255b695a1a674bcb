"""Programmatic dependent launch (Hopper on): a kernel starts while the kernel before it in the stream finishes.

A kernel launched with ``launch_pdl`` may begin as soon as every program of the previous kernel has started and
signalled (or exited), so its launch and its first instructions overlap the previous kernel's tail. The rules
that keep this exact, for every hfpaged kernel that takes ``USE_PDL``:
- before ``wait_for_previous_kernel`` a program reads only step inputs that no kernel of the step writes (the
  packed metadata: ``cu_seqlens_q``, ``seq_lens``, ``slot_mapping``, block tables; the GEMV's weights) and writes
  nothing;
- every program calls it, early-exiting ones too, and it signals the next kernel only after its own wait, so
  when any kernel starts, every kernel before its predecessor has finished (Inductor's kernels rely on it: they
  wait only before reading what the previous node wrote, and may read older buffers before their wait).
CUDA graphs capture the launch attribute as a programmatic edge; elsewhere (CPU interpreter, older GPUs) the
kernels are compiled without it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import interpreting

_SUPPORTED: dict[int, bool] = {}


def dependent_launch_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can use programmatic dependent launch: a CUDA GPU of compute capability 9.0+
    and a Triton with grid dependency control (``tl.extra.cuda.gdc_wait`` and the ``launch_pdl`` option)."""
    if device.type != "cuda" or interpreting():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SUPPORTED:
        try:
            from triton.backends.nvidia.compiler import CUDAOptions
            from triton.language.extra import cuda as triton_cuda

            has_gdc = (
                hasattr(triton_cuda, "gdc_wait")
                and hasattr(triton_cuda, "gdc_launch_dependents")
                and "launch_pdl" in CUDAOptions.__dataclass_fields__
            )
        except ImportError:
            has_gdc = False
        _SUPPORTED[index] = has_gdc and torch.cuda.get_device_capability(index)[0] >= 9
    return _SUPPORTED[index]


def check_launch_pdl(launch_pdl: bool, device: torch.device, setting: str = "launch_pdl") -> None:
    """Raise ValueError for ``launch_pdl=True`` where ``dependent_launch_supported`` says no (``setting``: the
    argument's name in the message)."""
    if not launch_pdl or dependent_launch_supported(device):
        return
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        what = f"{torch.cuda.get_device_name(device)}, compute capability {major}.{minor}"
    else:
        what = "Triton interpreter" if interpreting() else "not a CUDA device"
    raise ValueError(
        f"{setting}=True needs a CUDA GPU of compute capability 9.0 or newer (Hopper on) and a Triton with grid "
        f"dependency control; got {device} ({what}): leave {setting} off there"
    )


def launch_options(launch_pdl: bool) -> dict:
    """Triton launch options of a kernel compiled with ``USE_PDL=launch_pdl``."""
    return {"launch_pdl": True} if launch_pdl else {}


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    # Wait until the previous kernel has finished and its writes are visible, then let the next kernel start its
    # launch (it waits in turn before reading what this one writes). No-op without USE_PDL.
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
