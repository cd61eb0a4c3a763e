"""Linear kernels: ``y = x W^T (+ bias)`` and its fused forms (q/k/v, residual, SwiGLU).

One native entry, two kernels chosen by M: below 32 rows the STREAM kernel
reads each weight row once for all rows of x (decode); from 32 rows on a
blocked GEMM packs weight tiles to fp32 in UB and reuses them across rows
(prefill). Every function here is always native; whether torch's GEMM should
run instead is the callers' choice, made by ``native_linear_wins`` (used by
``linear_auto``, the patched HF model and ``TransformerInfer``).
"""
from __future__ import annotations

import torch

from atb import _C
from atb.kernels import quant_linear as _q
from atb.kernels._common import float_code, resolve_soc, same_dtype

# Routing threshold for ``linear_auto``. The native kernel keeps up to 32 rows
# of x in UB per pass (tiling mTile), so up to M = 32 it reads each weight once;
# past that it re-streams the weights per 32-row pass while oneDNN's blocked
# GEMM reuses them from cache, so prefill shapes go to torch. In
# atb.bench.linear.crossover runs on the shared 2-core AVX2 host (576x1536,
# cache-warm weight) the native kernel was faster at every M <= 32 in fp32 and
# bf16 (e.g. M=16: 0.9 ms vs 20-40 ms), but torch's multi-threaded GEMM was
# starved by other load in those runs, so the true crossover on a quiet machine
# may be lower; re-measure with ``python -m atb.bench.linear``.
LINEAR_CROSSOVER_M = 32


def native_linear_wins(rows: int, dtype: torch.dtype) -> bool:
    """The routing policy: native below ``LINEAR_CROSSOVER_M`` rows, and at every size for fp16/bf16.

    For fp32 prefill shapes oneDNN/MKL's GEMM (~110-140 GFLOP/s on 2 AVX2 cores) beats the native GEMM
    (~70-85); for fp16/bf16 it has no fast path on AVX2 (~17 GFLOP/s) while the native GEMM widens the
    weights once per packed tile and runs at fp32 FMA speed (4-6x torch; ``python -m atb.bench.linear``).
    """
    return rows < LINEAR_CROSSOVER_M or dtype != torch.float32

_PLAIN, _RESIDUAL, _SWIGLU = 0, 1, 2


def _check_x(op: str, x) -> int:
    code = float_code(op, "x", x)
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.shape[1] == 0:
        raise ValueError(f"{op}: x has K = 0 columns")
    return code


def _check_weight(op: str, name: str, w, x) -> None:
    float_code(op, name, w)
    same_dtype(op, name, w, "x", x)
    if w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"{op}: {name} has shape {tuple(w.shape)}, expected [N, {x.shape[1]}] (HF layout [out, in])")
    if w.shape[0] == 0:
        raise ValueError(f"{op}: {name} has N = 0 rows")


def _check_bias(op: str, name: str, b, w, x) -> None:
    if b is None:
        return
    float_code(op, name, b)
    same_dtype(op, name, b, "x", x)
    if b.dim() != 1 or b.shape[0] != w.shape[0]:
        raise ValueError(f"{op}: {name} has shape {tuple(b.shape)}, expected ({w.shape[0]},)")


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           soc_type: str | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``: x ``[M, K]``, weight ``[N, K]``, bias ``[N]``; fp32 accumulation, x's dtype out.

    ``weight`` may be an ``atb.quant.QuantizedWeight`` (W8A16 / W4A16); so may every weight of the entries below.
    """
    if _q.is_quantized(weight):
        return _q.linear(x, weight, bias, soc_type=soc_type)
    code = _check_x("linear", x)
    _check_weight("linear", "weight", weight, x)
    _check_bias("linear", "bias", bias, weight, x)
    x, weight = x.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    if x.shape[0]:
        _C.linear(x.data_ptr(), x.shape[0], x.shape[1], [(weight.data_ptr(), _ptr(bias), out.data_ptr(), weight.shape[0])],
                  0, _PLAIN, code, resolve_soc(soc_type))
    return out


def linear_multi(x: torch.Tensor, weights, biases=None, *, soc_type: str | None = None) -> tuple[torch.Tensor, ...]:
    """Fused q/k/v projection: one launch over 1..3 weights sharing x, one output each.

    Equivalent to ``tuple(linear(x, w, b) for w, b in zip(weights, biases))``; the
    cores split the concatenated rows, so small k/v projections do not each pay a launch.
    """
    weights = list(weights)
    if any(_q.is_quantized(w) for w in weights):
        return _q.linear_multi(x, weights, biases, soc_type=soc_type)
    code = _check_x("linear_multi", x)
    if not 1 <= len(weights) <= 3:
        raise ValueError(f"linear_multi: weights must hold 1 to 3 tensors, got {len(weights)}")
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(f"linear_multi: {len(biases)} biases for {len(weights)} weights")
    x = x.contiguous()
    segs, outs, keep = [], [], []
    for i, (w, b) in enumerate(zip(weights, biases)):
        _check_weight("linear_multi", f"weights[{i}]", w, x)
        _check_bias("linear_multi", f"biases[{i}]", b, w, x)
        w = w.contiguous()
        b = None if b is None else b.contiguous()
        out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
        keep += [w, b]
        outs.append(out)
        segs.append((w.data_ptr(), _ptr(b), out.data_ptr(), w.shape[0]))
    if x.shape[0]:
        _C.linear(x.data_ptr(), x.shape[0], x.shape[1], segs, 0, _PLAIN, code, resolve_soc(soc_type))
    return tuple(outs)


def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, bias: torch.Tensor | None = None, *,
                    soc_type: str | None = None) -> torch.Tensor:
    """``residual + linear(x, weight, bias)`` (o_proj / down_proj), each rounded to x's dtype as HF does."""
    if _q.is_quantized(weight):
        return _q.linear_residual(x, weight, residual, bias, soc_type=soc_type)
    code = _check_x("linear_residual", x)
    _check_weight("linear_residual", "weight", weight, x)
    _check_bias("linear_residual", "bias", bias, weight, x)
    float_code("linear_residual", "residual", residual)
    same_dtype("linear_residual", "residual", residual, "x", x)
    if tuple(residual.shape) != (x.shape[0], weight.shape[0]):
        raise ValueError(f"linear_residual: residual has shape {tuple(residual.shape)}, "
                         f"expected [{x.shape[0]}, {weight.shape[0]}]")
    x, weight, residual = x.contiguous(), weight.contiguous(), residual.contiguous()
    bias = None if bias is None else bias.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    if x.shape[0]:
        _C.linear(x.data_ptr(), x.shape[0], x.shape[1], [(weight.data_ptr(), _ptr(bias), out.data_ptr(), weight.shape[0])],
                  residual.data_ptr(), _RESIDUAL, code, resolve_soc(soc_type))
    return out


def linear_swiglu(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, *,
                  soc_type: str | None = None) -> torch.Tensor:
    """``silu(x @ gate_weight.T) * (x @ up_weight.T)`` in one weight pass (LLaMA MLP's first half)."""
    if _q.is_quantized(gate_weight) or _q.is_quantized(up_weight):
        return _q.linear_swiglu(x, gate_weight, up_weight, soc_type=soc_type)
    code = _check_x("linear_swiglu", x)
    _check_weight("linear_swiglu", "gate_weight", gate_weight, x)
    _check_weight("linear_swiglu", "up_weight", up_weight, x)
    if gate_weight.shape != up_weight.shape:
        raise ValueError(f"linear_swiglu: gate_weight has shape {tuple(gate_weight.shape)}, up_weight has "
                         f"{tuple(up_weight.shape)}; they must match")
    x, gate_weight, up_weight = x.contiguous(), gate_weight.contiguous(), up_weight.contiguous()
    n = gate_weight.shape[0]
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    if x.shape[0]:
        _C.linear(x.data_ptr(), x.shape[0], x.shape[1],
                  [(gate_weight.data_ptr(), 0, out.data_ptr(), n), (up_weight.data_ptr(), 0, 0, n)],
                  0, _SWIGLU, code, resolve_soc(soc_type))
    return out


def linear_auto(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                soc_type: str | None = None) -> torch.Tensor:
    """Native ``linear`` where ``native_linear_wins``, else ``torch.nn.functional.linear``. Leading dims are
    flattened."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not _q.is_quantized(weight) and not native_linear_wins(x2.shape[0], x.dtype):
        return torch.nn.functional.linear(x, weight, bias)
    return linear(x2, weight, bias, soc_type=soc_type).reshape(*lead, weight.shape[0])
