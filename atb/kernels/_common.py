"""Boundary checks shared by the kernel wrappers.

Wrappers validate here, then hand raw pointers to atb._C. Messages name the
operation, the argument, what was expected and what was given. These checks
sit on the decode hot path, so each is a handful of attribute reads.
"""
from __future__ import annotations

import math
import numbers

import torch

from atb import _C
from atb import soc as _soc

# The native core's codes (its exported enums), keyed as Python holds them.
DTYPE_CODES = {torch.float32: int(_C.DataType.FLOAT32), torch.float16: int(_C.DataType.FLOAT16),
               torch.bfloat16: int(_C.DataType.BFLOAT16)}
EPILOGUE_PLAIN, EPILOGUE_RESIDUAL, EPILOGUE_SWIGLU = (
    int(e) for e in (_C.LinearEpilogue.PLAIN, _C.LinearEpilogue.RESIDUAL, _C.LinearEpilogue.SWIGLU))
ROPE_STYLES = {"neox": int(_C.RopeStyle.NEOX), "interleave": int(_C.RopeStyle.INTERLEAVE)}
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


def same_shape(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.shape != ref.shape:
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, {ref_name} has {tuple(ref.shape)}; they must match")


def kv_cache_pair(op: str, key_cache: torch.Tensor, value_cache: torch.Tensor, heads: str, why: str = "") -> None:
    """key_cache and value_cache: one 4-D ``[num_blocks, block_size, <heads>, head_dim]`` contiguous shape."""
    if key_cache.dim() != 4:
        raise ValueError(f"{op}: key_cache must be 4-D [num_blocks, block_size, {heads}, head_dim], "
                         f"got shape {tuple(key_cache.shape)}")
    same_shape(op, "value_cache", value_cache, "key_cache", key_cache)
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError(f"{op}: key_cache and value_cache must be contiguous{why}")


def real_arg(op: str, name: str, value, *, min_value: float | None = None) -> float:
    """A finite real scalar argument (scale, eps) as a float; numpy scalars are accepted.

    Non-numbers raise TypeError, nan/inf (and values below ``min_value``) ValueError, naming op and argument.
    """
    if type(value) is not float:  # the common case skips the ABC check
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise TypeError(f"{op}: {name} must be a real number, got {type(value).__name__} {value!r}")
        value = float(value)
    if not math.isfinite(value) or (min_value is not None and value < min_value):
        bound = "" if min_value is None else f" >= {min_value}"
        raise ValueError(f"{op}: {name} must be a finite real number{bound}, got {value!r}")
    return value


# Positions are int32, so a window this wide already covers every context.
_WINDOW_CAP = 2**31 - 1


def window_arg(op: str, window) -> int:
    """Sliding window as the kernels take it: 0 for None, else an int >= 1 (numpy integers accepted)."""
    if window is None:
        return 0
    if not isinstance(window, numbers.Integral) or isinstance(window, bool) or window < 1:
        raise ValueError(f"{op}: window must be None or an int >= 1, got {window!r}")
    return min(int(window), _WINDOW_CAP)


def resolve_soc(soc_type, op: str | None = None, code: int = 0):
    """The SocInfo for ``soc_type``. With ``op``, errors name it, and a bf16 ``code`` checks the SoC has bf16."""
    try:
        soc = _soc.get_soc(soc_type)
    except (TypeError, ValueError) as e:
        if op is None:
            raise
        raise type(e)(f"{op}: {e}") from None
    if code == 2 and op is not None and not soc.supports_bf16:
        raise ValueError(f"{op}: bfloat16 is not supported on {soc.name} (no bf16 vector unit); use float16 or float32")
    return soc


# Checks every linear entry (float and quantized weights) makes; the weight checks differ and stay with each.
def linear_x(op: str, x) -> int:
    """dtype code of x, a 2-D ``[M, K]`` float tensor with K >= 1."""
    code = float_code(op, "x", x)
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.shape[1] == 0:
        raise ValueError(f"{op}: x has K = 0 columns")
    return code


def linear_bias(op: str, name: str, b, w, x) -> None:
    """``b`` is None or an ``[N]`` tensor of x's dtype, N = ``w.shape[0]``."""
    if b is None:
        return
    float_code(op, name, b)
    same_dtype(op, name, b, "x", x)
    if b.dim() != 1 or b.shape[0] != w.shape[0]:
        raise ValueError(f"{op}: {name} has shape {tuple(b.shape)}, expected ({w.shape[0]},)")


def linear_lists(op: str, weights, biases, x, check_weight) -> tuple[list, list]:
    """linear_multi's 1..3 weights and as many biases (None: no bias anywhere), as lists, each pair checked
    (``check_weight(op, name, w, x)`` for the weight kind at hand)."""
    weights = list(weights)
    if not 1 <= len(weights) <= 3:
        raise ValueError(f"{op}: weights must hold 1 to 3 tensors, got {len(weights)}")
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(f"{op}: {len(biases)} biases for {len(weights)} weights")
    for i, (w, b) in enumerate(zip(weights, biases)):
        check_weight(op, f"weights[{i}]", w, x)
        linear_bias(op, f"biases[{i}]", b, w, x)
    return weights, [None if b is None else b.contiguous() for b in biases]


def linear_residual_arg(op: str, residual, x, w) -> None:
    """``residual`` is ``[M, N]`` in x's dtype."""
    float_code(op, "residual", residual)
    same_dtype(op, "residual", residual, "x", x)
    if tuple(residual.shape) != (x.shape[0], w.shape[0]):
        raise ValueError(f"{op}: residual has shape {tuple(residual.shape)}, expected [{x.shape[0]}, {w.shape[0]}]")


