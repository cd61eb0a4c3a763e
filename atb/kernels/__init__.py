"""Functional API of the fused kernels: validate, allocate, call the C++ core."""
from atb.kernels.flash_attention import flash_attention
from atb.kernels.linear import linear, linear_auto, linear_multi, linear_residual, linear_swiglu, pack_rows4
from atb.kernels.paged_attention import paged_attention
from atb.kernels.reshape_and_cache import reshape_and_cache
from atb.kernels.rms_norm import add_rms_norm, rms_norm
from atb.kernels.rope import rope
from atb.kernels.swiglu import silu_mul, swiglu

__all__ = ["rms_norm", "add_rms_norm", "rope", "swiglu", "silu_mul", "linear", "linear_multi", "linear_residual",
           "linear_swiglu", "linear_auto", "pack_rows4", "reshape_and_cache", "paged_attention", "flash_attention"]
