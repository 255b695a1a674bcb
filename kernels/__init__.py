"""Triton kernels for hfpaged (installed as ``hfpaged.kernels``): store_kv and paged_attention."""

from .paged_attention import paged_attention
from .store_kv import store_kv

__all__ = ["paged_attention", "store_kv"]
