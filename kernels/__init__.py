"""Triton kernels for hfpaged (installed as ``hfpaged.kernels``)."""
