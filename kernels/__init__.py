"""Attention kernels for hfpaged (installed as ``hfpaged.kernels``): the Triton ``store_kv`` and
``paged_attention``, and their torch references (``store_kv_reference``, ``paged_attention_reference``).

Triton is a dependency on Linux only: elsewhere just the torch references are here.
"""

import importlib.util

from .reference import paged_attention_reference, store_kv_reference

__all__ = ["paged_attention_reference", "store_kv_reference"]

if importlib.util.find_spec("triton") is not None:
    from .paged_attention import paged_attention
    from .store_kv import store_kv

    __all__ += ["paged_attention", "store_kv"]
