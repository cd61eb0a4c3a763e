"""Boundary checks shared by the kernel wrappers.

Wrappers validate here, then hand raw pointers to atb._C. Messages name the
operation, the argument, what was expected and what was given. These checks
sit on the decode hot path, so each is a handful of attribute reads.
"""
from __future__ import annotations

import torch

from atb import soc as _soc

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_FLOAT_NAMES = "float32, float16 or bfloat16"


def float_code(op: str, name: str, t) -> int:
    """dtype code of a floating tensor on the CPU, or a clear error."""
    # Fast path first: it runs for every tensor of every kernel call (t.device builds an object; is_cpu does not).
    if isinstance(t, torch.Tensor):
        code = DTYPE_CODES.get(t.dtype)
        if code is not None and t.is_cpu:
            if t.requires_grad and torch.is_grad_enabled():
                raise ValueError(f"{op}: {name} requires grad, but atb kernels have no backward (autograd would "
                                 f"silently lose this op's gradient); call it under torch.no_grad() or "
                                 f"torch.inference_mode(), or pass a detached tensor")
            return code
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPE_CODES:
        raise TypeError(f"{op}: {name} must be {_FLOAT_NAMES}, got {t.dtype}")
    raise ValueError(f"{op}: {name} must be on the CPU, got device {t.device}")


def int_tensor(op: str, name: str, t, *, ndim: int | None = None) -> torch.Tensor:
    """An int32 contiguous CPU tensor (int64 is converted: HF and vLLM hand out both)."""
    # Fast path (block tables, lengths and slot mappings on every decode step): attribute reads only.
    if (isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.is_cpu and (ndim is None or t.dim() == ndim)
            and t.is_contiguous()):
        return t
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: {name} must be int32 (or int64), got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"{op}: {name} must be on the CPU, got device {t.device}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype != torch.int32:
        if t.numel() and (int(t.max()) > 2**31 - 1 or int(t.min()) < -(2**31)):
            raise ValueError(f"{op}: {name} has values outside int32")
        t = t.to(torch.int32)
    return t.contiguous()


def same_dtype(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{op}: {name} is {t.dtype} but {ref_name} is {ref.dtype}; they must match")


def resolve_soc(soc_type):
    return _soc.get_soc(soc_type)
