import os

import torch

# Triton decides between compiled and interpreted kernels when a kernel is defined (import time):
# without CUDA, the kernel tests need the interpreter, so set it before anything imports the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
