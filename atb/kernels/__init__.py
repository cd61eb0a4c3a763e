"""Functional API of the fused kernels: validate, allocate, call the C++ core."""
from atb.kernels.rms_norm import add_rms_norm, rms_norm
from atb.kernels.rope import rope

__all__ = ["rms_norm", "add_rms_norm", "rope"]
