"""Correct rounding to fp8 in Triton's interpreter (TRITON_INTERPRET=1), for the CPU test suite (conftest.py
installs it before any kernel runs).

Triton 3.9's interpreter converts to fp8 by cutting the mantissa and adding the rounding bit without carrying it into
the exponent: a value that rounds up across a power of two comes out halved (7.9 -> 4.0 in e4m3, 127.9 -> 64.0),
~1.2% of uniformly spread values, and ties round away from zero. A GPU rounds to nearest-even and saturates to the
format's finite range (``cvt.rn.satfinite``). This routes float32/float16/bfloat16 -> e4m3/e5m2 conversions through
torch's casts with the same clamp, so kernel tests on the CPU check the kernels, not the interpreter's rounding.
Other conversions keep Triton's code; nothing in the library depends on this."""

import os


def install():
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    import torch

    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_fp_to_fp", None) if builder is not None else None
    convert = getattr(interpreter, "_convert_float", None)
    if original is None or convert is None or getattr(original, "_hfpaged_fp8", False):
        return
    tl = interpreter.tl
    targets = {tl.float8e4nv: (torch.float8_e4m3fn, 448.0), tl.float8e5: (torch.float8_e5m2, 57344.0)}

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        target = targets.get(dst_type.scalar)
        src_type = src.dtype.scalar
        if target is None or src_type not in (tl.float32, tl.float16, tl.bfloat16):
            return original(self, src, dst_type, rounding_mode)
        if src_type == tl.bfloat16:  # held as 16-bit words: widen exactly first
            data = convert(src.data, tl.bfloat16, tl.float32, None).view(np.float32)
        else:
            data = src.data
        values = torch.from_numpy(np.ascontiguousarray(data).astype(np.float32))
        dtype, limit = target
        out = values.clamp(-limit, limit).to(dtype).view(torch.uint8).numpy()
        return interpreter.TensorHandle(out.reshape(np.shape(src.data)), dst_type.scalar)

    create_fp_to_fp._hfpaged_fp8 = True
    builder.create_fp_to_fp = create_fp_to_fp
