"""Fuzz test of every kernel in atb.kernels: bad input never kills the process, never gives a silently wrong answer.

Each case draws (from its own seed) an op, shapes, a dtype, strides (non-contiguous views), metadata (block
tables, slots, context lens, cu_seqlens, q_lens, windows) and a SoC. A valid case must match the float64
reference in tests/reference.py within the tolerance table; an invalid case (one mutation of a valid one) must
raise ValueError/TypeError whose message starts with the op's name, and leave every tensor the op may write
(KV caches, in-place q/k) bit-identical. Cases run in batches in a forked child, so a crash or a hang is a
failure naming the case (``ATB_FUZZ_SEED=<seed> ATB_FUZZ_ONLY=<case>`` reruns it in-process), not a dead run.

A few hundred cases by default; ``--fuzz-cases N`` or ``ATB_FUZZ_CASES=N`` for long runs.
"""
from __future__ import annotations

import collections
import math
import multiprocessing as mp
import os
import random
import signal
import traceback

import pytest
import torch

import atb
from atb import _C
from atb import kernels as K
from atb.kernels._common import DTYPE_CODES
from atb.kernels.linear import native_linear_wins, pack_rows4
from atb.quant import quantize_weight
from conftest import fp32_batch_copy, fp32_decode_copy
from reference import (TOLERANCES, assert_close, flash_attention_ref, linear_ref, linear_residual_ref,
                       linear_swiglu_ref, paged_attention_ref, quant_weight_ref, reshape_and_cache_ref, rms_norm_ref,
                       add_rms_norm_ref, rope_ref, silu_mul_ref, swiglu_ref)

SEED = int(os.environ.get("ATB_FUZZ_SEED", "20261130"))
BATCH = 40             # cases per forked child
HANG_SECONDS = 120     # no result from a child for this long = the case hangs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
QUANT_FORMATS = [("w8a16", 0), ("w8a16", 16), ("w8a16", 32), ("w8a16", 128), ("w4a16", 32), ("w4a16", 64),
                 ("w4a16", 128)]
SOCS = atb.soc_names()
BF16_SOCS = [s for s in SOCS if atb.get_soc(s).supports_bf16]
NO_BF16_SOCS = [s for s in SOCS if not atb.get_soc(s).supports_bf16]


class Rejected(Exception):
    """What a mutated case expects: a ValueError/TypeError naming the op."""


# ---- inputs -------------------------------------------------------------------------------------------------------


def _randn(g, shape, dtype, scale=1.0):
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _view(rng, g, shape, dtype, *, scale=1.0, last_contiguous=False):
    """A tensor of `shape` with random strides: contiguous, padded rows, every other column, or transposed."""
    shape = tuple(shape)
    kinds = ["contiguous", "contiguous", "padded"]
    if len(shape) >= 2:
        kinds.append("transposed")
    if not last_contiguous:
        kinds.append("strided")
    kind = rng.choice(kinds) if shape and 0 not in shape else "contiguous"
    if kind == "padded":
        return _randn(g, (*shape[:-1], shape[-1] + rng.randint(1, 9)), dtype, scale)[..., :shape[-1]]
    if kind == "strided":
        return _randn(g, (*shape[:-1], 2 * shape[-1]), dtype, scale)[..., ::2]
    if kind == "transposed":
        return _randn(g, (shape[1], shape[0], *shape[2:]), dtype, scale).transpose(0, 1)
    return _randn(g, shape, dtype, scale)


def _dim(rng, choices=(1, 2, 3, 7, 16, 64, 123)):
    return rng.choice(choices)


def _soc(rng, dtype):
    if rng.random() < 0.7:
        return None  # the default SoC (host)
    return rng.choice(BF16_SOCS if dtype == torch.bfloat16 else SOCS)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, for a bit-identical (NaN-safe) comparison."""
    return t.detach().contiguous().view(torch.uint8).clone()


def _expect_rejected(op, what, call, written):
    before = [_bits(t) for t in written]
    try:
        call()
    except (ValueError, TypeError) as e:
        msg = str(e)
        if not msg.startswith(op):
            raise AssertionError(f"{what}: {type(e).__name__} does not start with '{op}': {msg}") from None
    except Exception as e:  # noqa: BLE001 - any other exception type is the failure being looked for
        raise AssertionError(f"{what}: raised {type(e).__name__} instead of ValueError/TypeError: {e}") from None
    else:
        raise AssertionError(f"{what}: the invalid call was accepted")
    for i, (b, t) in enumerate(zip(before, written)):
        if not torch.equal(b, _bits(t)):
            raise AssertionError(f"{what}: rejected call wrote into shared tensor {i}")


def _close(actual, expected, dtype, what, scale=1.0):
    try:
        assert_close(actual, expected, dtype, scale=scale)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None


# ---- one generator per op: returns (op, "valid" | mutation name) after checking the case ---------------------------
# Each builds a valid call first; `bad` (or None) picks one mutation, which must be rejected.


def _fuzz_rms_norm(rng, g, bad, op):
    dtype = rng.choice(DTYPES)
    cols = _dim(rng, (1, 7, 64, 123, 576, 4097))
    lead = [rng.choice([0, 1, 2, 5, 17]) for _ in range(rng.randint(0, 2))]
    if rng.random() < 0.3:
        lead = [rng.randint(1, 3)]
    x = _view(rng, g, (*lead, cols), dtype)
    weight = _view(rng, g, (cols,), dtype)  # strided weights: the temporary that was freed too early
    eps = rng.choice([1e-6, 1e-5, 1e-2, 0.0])
    soc = _soc(rng, dtype)
    fused = op == "add_rms_norm"
    residual = _view(rng, g, x.shape, dtype) if fused else None

    def call(x=x, residual=residual, weight=weight, eps=eps, soc=soc):
        if fused:
            return K.add_rms_norm(x, residual, weight, eps, soc_type=soc)
        return K.rms_norm(x, weight, eps, soc_type=soc)

    if bad is None:
        if fused:
            y, h = call()
            ref_y, ref_h = add_rms_norm_ref(x, residual, weight, eps)
            _close(h, ref_h, dtype, f"{op} h")
            _close(y, ref_y, dtype, f"{op} y")
        else:
            _close(call(), rms_norm_ref(x, weight, eps), dtype, op)
        return op, "valid"
    muts = {
        "weight_len": lambda: call(weight=_randn(g, (cols + 1,), dtype)),
        "weight_dtype": lambda: call(weight=weight.to(torch.float32 if dtype != torch.float32 else torch.float16)),
        "weight_2d": lambda: call(weight=weight[None]),
        "x_int": lambda: call(x=torch.zeros(x.shape, dtype=torch.int32)),
        "x_scalar": lambda: call(x=torch.tensor(1.0, dtype=dtype), weight=weight[:1]),
        "x_list": lambda: call(x=[[1.0] * cols]),
        "eps_nan": lambda: call(eps=float("nan")),
        "eps_str": lambda: call(eps="1e-6"),
        "eps_negative": lambda: call(eps=-1.0),
        "soc_unknown": lambda: call(soc="Ascend999"),
        "bf16_unsupported": lambda: call(x=x.bfloat16(), residual=None if residual is None else residual.bfloat16(),
                                         weight=weight.bfloat16(), soc=rng.choice(NO_BF16_SOCS)),
    }
    if fused:
        muts["residual_shape"] = lambda: call(residual=_randn(g, (*lead, cols + 1), dtype))
        muts["residual_dtype"] = lambda: call(residual=residual.to(torch.float64))
    if x.numel() == 0:  # an empty x is an empty result before the SoC is consulted
        del muts["bf16_unsupported"], muts["soc_unknown"]
    name = rng.choice(sorted(muts))
    _expect_rejected(op, f"{op}/{name}", muts[name], [])
    return op, name


def _fuzz_rope(rng, g, bad, op):
    dtype = rng.choice(DTYPES)
    tokens = rng.choice([0, 1, 2, 7, 33])
    heads = rng.randint(1, 9)
    kv = rng.randint(1, heads)
    head_dim = rng.choice([2, 8, 16, 64, 70, 128])
    rotary = rng.choice([r for r in (2, 8, 16, 32, 64, 70, 128) if r <= head_dim])
    style = rng.choice(["neox", "interleave"])
    inplace = rng.random() < 0.4
    cos_dtype = rng.choice([dtype, torch.float32])
    pos = torch.randint(0, 4096, (tokens, 1), generator=g).double()
    freqs = pos * (10000.0 ** (-torch.arange(0, rotary, 2, dtype=torch.float64) / rotary))
    emb = torch.cat([freqs, freqs], -1) if style == "neox" else freqs.repeat_interleave(2, -1)
    cos, sin = emb.cos().to(cos_dtype), emb.sin().to(cos_dtype)
    if rng.random() < 0.5 and tokens:  # q and k sliced from one fused QKV output
        qkv = _randn(g, (tokens, (heads + 2 * kv) * head_dim), dtype)
        q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
        k = qkv[:, heads * head_dim:(heads + kv) * head_dim].view(tokens, kv, head_dim)
    else:
        q = _view(rng, g, (tokens, heads, head_dim), dtype, last_contiguous=inplace)
        k = _view(rng, g, (tokens, kv, head_dim), dtype, last_contiguous=inplace)
    soc = _soc(rng, dtype)

    def call(q=q, k=k, cos=cos, sin=sin, style=style, inplace=inplace, soc=soc):
        return K.rope(q, k, cos, sin, style=style, inplace=inplace, soc_type=soc)

    if bad is None:
        ref_q, ref_k = rope_ref(q, cos, sin, style), rope_ref(k, cos, sin, style)
        q_out, k_out = call()
        if inplace and not (q_out is q and k_out is k):
            raise AssertionError("rope: inplace=True did not return q and k")
        _close(q_out, ref_q, dtype, "rope q")
        _close(k_out, ref_k, dtype, "rope k")
        return "rope", "valid"
    other = torch.float16 if dtype != torch.float16 else torch.bfloat16
    muts = {
        "style": lambda: call(style="gptj"),
        "rotary_odd": lambda: call(cos=cos[:, :rotary - 1], sin=sin[:, :rotary - 1]),
        "rotary_too_wide": lambda: call(cos=torch.zeros(tokens, head_dim + 2, dtype=cos_dtype),
                                        sin=torch.zeros(tokens, head_dim + 2, dtype=cos_dtype)),
        "cos_tokens": lambda: call(cos=torch.zeros(tokens + 1, rotary, dtype=cos_dtype),
                                   sin=torch.zeros(tokens + 1, rotary, dtype=cos_dtype)),
        "k_head_dim": lambda: call(k=_randn(g, (tokens, kv, head_dim + 2), dtype)),
        "k_dtype": lambda: call(k=k.to(other)),
        "cos_dtype": lambda: call(cos=cos.to(other), sin=sin.to(other)),
        "q_2d": lambda: call(q=q.flatten(1)),
        "no_heads": lambda: call(q=torch.zeros(tokens, 0, head_dim, dtype=dtype)),
        "soc_unknown": lambda: call(soc=3),
    }
    written = []
    if tokens:
        muts["inplace_overlap"] = lambda: call(k=q[:, :min(kv, heads)], inplace=True)
        muts["inplace_strided"] = lambda: call(q=_randn(g, (tokens, heads, 2 * head_dim), dtype)[..., ::2],
                                               inplace=True)
        muts["inplace_expanded"] = lambda: call(
            q=_randn(g, (1, heads, head_dim), dtype).expand(tokens + 1, heads, head_dim),
            k=_randn(g, (tokens + 1, kv, head_dim), dtype), cos=torch.zeros(tokens + 1, rotary, dtype=cos_dtype),
            sin=torch.zeros(tokens + 1, rotary, dtype=cos_dtype), inplace=True)
        written = [q, k]
    else:  # no tokens: an empty result before the SoC is consulted
        del muts["soc_unknown"]
    name = rng.choice(sorted(muts))
    _expect_rejected("rope", f"rope/{name}", muts[name], written)
    return "rope", name


def _fuzz_silu_mul(rng, g, bad, op):
    dtype = rng.choice(DTYPES)
    cols = _dim(rng, (1, 7, 64, 123, 1536, 5000))
    lead = [rng.choice([0, 1, 3, 9]) for _ in range(rng.randint(0, 2))]
    soc = _soc(rng, dtype)
    if op == "silu_mul":
        gate, up = _view(rng, g, (*lead, cols), dtype, scale=3), _view(rng, g, (*lead, cols), dtype)
        if rng.random() < 0.3 and lead:  # the halves of one fused gate/up output
            both = _randn(g, (*lead, 2 * cols), dtype, 3)
            gate, up = both[..., :cols], both[..., cols:]

        def call(gate=gate, up=up, soc=soc):
            return K.silu_mul(gate, up, soc_type=soc)

        if bad is None:
            _close(call(), silu_mul_ref(gate, up), dtype, op)
            return op, "valid"
        muts = {
            "shape": lambda: call(up=_randn(g, (*lead, cols + 1), dtype)),
            "dtype": lambda: call(up=up.to(torch.float64)),
            "int": lambda: call(gate=torch.zeros(gate.shape, dtype=torch.int64)),
            "scalar": lambda: call(gate=torch.tensor(1.0, dtype=dtype), up=torch.tensor(1.0, dtype=dtype)),
            "not_tensor": lambda: call(up=3.0),
            "bf16_unsupported": lambda: call(gate=torch.ones(2, cols).bfloat16(), up=torch.ones(2, cols).bfloat16(),
                                             soc=rng.choice(NO_BF16_SOCS)),
            "soc_unknown": lambda: call(gate=torch.ones(2, cols, dtype=dtype), up=torch.ones(2, cols, dtype=dtype),
                                        soc="Ascend_nope"),
        }
    else:
        x = _view(rng, g, (*lead, 2 * cols), dtype, scale=3)

        def call(x=x, soc=soc):
            return K.swiglu(x, soc_type=soc)

        if bad is None:
            _close(call(), swiglu_ref(x), dtype, op)
            return op, "valid"
        muts = {
            "odd": lambda: call(x=_randn(g, (*lead, 2 * cols + 1), dtype)),
            "int": lambda: call(x=torch.zeros(x.shape, dtype=torch.int32)),
            "scalar": lambda: call(x=torch.tensor(1.0, dtype=dtype)),
            "bf16_unsupported": lambda: call(x=torch.ones(2, 2 * cols).bfloat16(), soc=rng.choice(NO_BF16_SOCS)),
            "soc_unknown": lambda: call(x=torch.ones(2, 2 * cols, dtype=dtype), soc=""),
        }
    name = rng.choice(sorted(muts))
    _expect_rejected(op, f"{op}/{name}", muts[name], [])
    return op, name


def _fuzz_linear(rng, g, bad, op):
    dtype = rng.choice(DTYPES)
    m = rng.choice([0, 1, 2, 5, 17, 32, 33, 70])
    k = _dim(rng, (1, 7, 8, 64, 123, 576))
    n = _dim(rng, (1, 5, 64, 130))
    soc = _soc(rng, dtype)
    x = _view(rng, g, (m, k), dtype)
    w = _view(rng, g, (n, k), dtype, scale=k ** -0.5)
    bias = _view(rng, g, (n,), dtype) if rng.random() < 0.4 else None
    # fp32 accumulation: error ~ sqrt(K) ulps of the inputs' magnitude (as tests/test_linear.py scales it)
    tol = max(1.0, k ** 0.5 / 4)
    # A valid call may take quantized weights (every format and group, W8's 16 included), one draw per call:
    # the same entries, their float64 reference over the dequantized values.
    quant = None
    if bad is None and op != "linear_auto" and m > 0 and rng.random() < 0.35:
        quant = (rng.choice(QUANT_FORMATS), rng.choice([None, torch.float32, torch.bfloat16]))
    qw = (lambda t: quantize_weight(t.float(), *quant[0], scale_dtype=quant[1])) if quant else (lambda t: t)
    # The weight each call multiplies by (launch: the call's weights; epilogue: 0, 1 residual, 2 SwiGLU).
    wr = ((lambda t, launch=None, ep=0: quant_weight_ref(t, x, launch, ep, soc or "host")) if quant
          else (lambda t, launch=None, ep=0: t))
    w = qw(w)
    if op in ("linear", "linear_auto"):
        call = lambda x=x, w=w, bias=bias, soc=soc: getattr(K, op)(x, w, bias, soc_type=soc)  # noqa: E731
        ref = lambda: linear_ref(x, wr(w), bias)  # noqa: E731
    elif op == "linear_multi":
        ws = [w] + [qw(_view(rng, g, (_dim(rng, (1, 5, 64)), k), dtype, scale=k ** -0.5))
                    for _ in range(rng.randint(0, 2))]
        bs = [None if rng.random() < 0.5 else _randn(g, (t.shape[0],), dtype) for t in ws]
        call = lambda x=x, ws=ws, bs=bs, soc=soc: K.linear_multi(x, ws, bs, soc_type=soc)  # noqa: E731
        ref = lambda: [linear_ref(x, wr(t, ws), b) for t, b in zip(ws, bs)]  # noqa: E731
    elif op == "linear_residual":
        res = _view(rng, g, (m, n), dtype)
        call = lambda x=x, w=w, res=res, bias=bias, soc=soc: K.linear_residual(x, w, res, bias, soc_type=soc)  # noqa: E731
        ref = lambda: linear_residual_ref(x, wr(w, ep=1), res, bias)  # noqa: E731
    else:
        up = qw(_view(rng, g, (n, k), dtype, scale=k ** -0.5))
        call = lambda x=x, w=w, up=up, soc=soc: K.linear_swiglu(x, w, up, soc_type=soc)  # noqa: E731
        ref = lambda: linear_swiglu_ref(x, wr(w, [w, up], 2), wr(up, [w, up], 2))  # noqa: E731
    if bad and op == "linear_auto" and not native_linear_wins(m, dtype):
        bad = None  # torch's GEMM runs these shapes: its errors are torch's, so only valid calls are fuzzed
    if bad is None:
        out, expected = call(), ref()
        for i, (a, b) in enumerate(zip(out, expected) if op == "linear_multi" else [(out, expected)]):
            _close(a, b, dtype, f"{op} output {i}", scale=tol)
        return op, "valid" if quant is None else "valid quantized"
    muts = {
        "x_3d": lambda: call(x=x[None]),
        "x_int": lambda: call(x=torch.zeros(m, k, dtype=torch.int32)),
        "k_zero": lambda: call(x=torch.zeros(m, 0, dtype=dtype), w=torch.zeros(n, 0, dtype=dtype)),
        "soc_unknown": lambda: call(soc="Ascend910C9"),
        "bf16_unsupported": lambda: call(x=x.bfloat16(), w=w.bfloat16(), soc=rng.choice(NO_BF16_SOCS)),
    }
    if op != "linear_auto":  # linear_auto hands prefill shapes to torch, which has its own errors
        muts["w_k"] = lambda: call(w=_randn(g, (n, k + 1), dtype))
        muts["w_dtype"] = lambda: call(w=w.to(torch.float64))
        muts["w_empty"] = lambda: call(w=torch.zeros(0, k, dtype=dtype))
    if op in ("linear", "linear_residual"):
        muts["bias_shape"] = lambda: call(bias=_randn(g, (n + 1,), dtype))
    if op == "linear_multi":
        muts["no_weights"] = lambda: call(ws=[], bs=None)
        muts["four_weights"] = lambda: call(ws=[w] * 4, bs=None)
        muts["bias_count"] = lambda: call(bs=[None] * (len(ws) + 1))
        muts.pop("bf16_unsupported")
        muts["bf16_unsupported"] = lambda: call(x=x.bfloat16(), ws=[t.bfloat16() for t in ws], bs=None,
                                                soc=rng.choice(NO_BF16_SOCS))
        muts["w_k"] = lambda: call(ws=[_randn(g, (n, k + 1), dtype)], bs=None)
        muts["w_dtype"] = lambda: call(ws=[w.to(torch.float64)], bs=None)
        muts["w_empty"] = lambda: call(ws=[torch.zeros(0, k, dtype=dtype)], bs=None)
        muts["k_zero"] = lambda: call(x=torch.zeros(m, 0, dtype=dtype), ws=[torch.zeros(n, 0, dtype=dtype)], bs=None)
    if op == "linear_residual":
        muts["residual_shape"] = lambda: call(res=_randn(g, (m, n + 1), dtype))
        muts.pop("bf16_unsupported")
    if op == "linear_swiglu":
        muts["up_shape"] = lambda: call(up=_randn(g, (n + 1, k), dtype))
        muts["bf16_unsupported"] = lambda: call(x=x.bfloat16(), w=w.bfloat16(), up=up.bfloat16(),
                                                soc=rng.choice(NO_BF16_SOCS))
    if m == 0:  # an empty M is an empty result before the SoC is consulted
        muts.pop("bf16_unsupported", None)
        muts.pop("soc_unknown", None)
    if op == "linear_auto":  # flattens leading dims; its errors are linear's
        muts.pop("x_3d")
    name = rng.choice(sorted(muts))
    _expect_rejected("linear" if op == "linear_auto" else op, f"{op}/{name}", muts[name], [])
    return op, name


def _cache(rng, g, dtype, num_blocks, block_size, kv_heads, head_dim):
    return (_randn(g, (num_blocks, block_size, kv_heads, head_dim), dtype),
            _randn(g, (num_blocks, block_size, kv_heads, head_dim), dtype))


def _fuzz_reshape_and_cache(rng, g, bad, op):
    dtype = rng.choice(DTYPES)
    block_size = rng.choice([1, 4, 16, 128])
    num_blocks = rng.randint(1, 6)
    kv, d = rng.randint(1, 4), rng.choice([1, 8, 64, 80, 128])
    kc, vc = _cache(rng, g, dtype, num_blocks, block_size, kv, d)
    slots_total = num_blocks * block_size
    tokens = rng.randint(0, min(slots_total, 40))
    slots = torch.randperm(slots_total, generator=g)[:tokens].int()
    slots[torch.rand(tokens, generator=g) < 0.2] = -1  # padding tokens
    if rng.random() < 0.3:
        slots = slots.long()
    if rng.random() < 0.5 and tokens:  # views into a fused QKV output
        qkv = _randn(g, (tokens, rng.randint(1, 4) * kv * d + 2 * kv * d), dtype)
        key = qkv[:, -2 * kv * d:-kv * d].view(tokens, kv, d)
        value = qkv[:, -kv * d:].view(tokens, kv, d)
    else:
        key, value = _view(rng, g, (tokens, kv, d), dtype), _view(rng, g, (tokens, kv, d), dtype)
    soc = _soc(rng, dtype)

    def call(key=key, value=value, kc=kc, vc=vc, slots=slots, soc=soc):
        K.reshape_and_cache(key, value, kc, vc, slots, soc_type=soc)

    if bad is None:
        ref_k, ref_v = reshape_and_cache_ref(key, value, kc, vc, slots)
        call()
        if not (torch.equal(_bits(kc), _bits(ref_k)) and torch.equal(_bits(vc), _bits(ref_v))):
            raise AssertionError(f"{op}: cache differs from the reference")
        return op, "valid"
    muts = {
        "key_heads": lambda: call(key=_randn(g, (tokens, kv + 1, d), dtype)),
        "key_dtype": lambda: call(key=key.to(torch.float64)),
        "value_tokens": lambda: call(value=_randn(g, (tokens + 1, kv, d), dtype)),
        "slots_len": lambda: call(slots=torch.full((tokens + 1,), -1, dtype=torch.int32)),
        "slots_float": lambda: call(slots=slots.float()),
        "slots_2d": lambda: call(slots=slots[None]),
        "cache_3d": lambda: call(kc=kc[0], vc=vc[0]),
        "cache_shapes": lambda: call(vc=_randn(g, (num_blocks + 1, block_size, kv, d), dtype)),
        "cache_strided": lambda: call(kc=kc.transpose(0, 1), vc=vc.transpose(0, 1)) if num_blocks > 1 and block_size > 1
        else call(kc=kc[..., :-1], vc=vc[..., :-1]) if d > 1 else call(kc=kc.expand(num_blocks, block_size, kv, 2)),
        "soc_unknown": lambda: call(soc="nope"),
    }
    if tokens:
        slot_out = slots.clone()
        slot_out[rng.randrange(tokens)] = slots_total + rng.randint(0, 5)
        muts["slot_out_of_range"] = lambda: call(slots=slot_out)
        dup = torch.arange(tokens, dtype=torch.int32) % slots_total
        if tokens > 1:
            dup[rng.randrange(1, tokens)] = int(dup[0])
            muts["slot_duplicate"] = lambda: call(slots=dup)
        muts["bf16_unsupported"] = lambda: call(key=key.bfloat16(), value=value.bfloat16(), kc=kc.bfloat16(),
                                                vc=vc.bfloat16(), slots=torch.arange(tokens) % slots_total,
                                                soc=rng.choice(NO_BF16_SOCS))
    else:
        muts.pop("soc_unknown")  # nothing to write: returns before consulting the SoC
    name = rng.choice(sorted(muts))
    _expect_rejected(op, f"{op}/{name}", muts[name], [kc, vc])
    return op, name


def _fuzz_paged_attention(rng, g, bad, op):
    dtype = rng.choice(DTYPES)
    block_size = rng.choice([1, 3, 16, 16, 128])
    kv = rng.randint(1, 3)
    group = rng.randint(1, 4)
    heads = kv * group
    d = rng.choice([8, 16, 64, 80, 128])
    batch = rng.randint(1, 4)
    ctx = [rng.choice([1, 2, rng.randint(1, 40), rng.randint(1, 300), rng.randint(250, 600)]) for _ in range(batch)]
    multi = rng.random() < 0.5
    q_lens = [rng.randint(0, min(c, 5)) for c in ctx] if multi else [1] * batch
    used = [math.ceil(c / block_size) for c in ctx]
    max_blocks = max(used) + rng.randint(0, 2)
    num_blocks = sum(used) + rng.randint(0, 3)
    kc, vc = _cache(rng, g, dtype, num_blocks, block_size, kv, d)
    ids = torch.randperm(num_blocks, generator=g).int()
    bt = torch.full((batch, max_blocks), -7, dtype=torch.int32)  # entries past a sequence's blocks are never read
    at = 0
    for b, u in enumerate(used):
        bt[b, :u] = ids[at:at + u]
        at += u
    ctx_t = torch.tensor(ctx, dtype=torch.int32 if rng.random() < 0.7 else torch.int64)
    ql_t = torch.tensor(q_lens, dtype=torch.int32) if multi else None
    rows = sum(q_lens)
    q = _view(rng, g, (rows, heads, d), dtype)
    window = rng.choice([None, None, 1, 5, 64, 300])
    scale = rng.choice([None, None, 0.3 * d ** -0.5, 2.0 * d ** -0.5])  # scores of randn inputs stay O(1)
    soc = _soc(rng, dtype)

    def call(q=q, kc=kc, vc=vc, bt=bt, ctx=ctx_t, scale=scale, q_lens=ql_t, window=window, soc=soc):
        return K.paged_attention(q, kc, vc, bt, ctx, scale=scale, q_lens=q_lens, window=window, soc_type=soc)

    if bad is None:
        expected = paged_attention_ref(q, kc, vc, bt, ctx_t, scale, ql_t, window)
        _close(call(), expected, dtype, op)
        return op, "valid"
    b = rng.randrange(batch)
    bad_bt = bt.clone()
    bad_bt[b, rng.randrange(used[b])] = rng.choice([-1, num_blocks, num_blocks + 100])
    bad_ctx = ctx_t.clone()
    bad_ctx[b] = rng.choice([0, -3, max_blocks * block_size + 1])
    muts = {
        "block_id": lambda: call(bt=bad_bt),
        "context_len": lambda: call(ctx=bad_ctx),
        "window_zero": lambda: call(window=0),
        "window_float": lambda: call(window=2.0),
        "scale_nan": lambda: call(scale=float("nan")),
        "scale_inf": lambda: call(scale=-float("inf")),
        "scale_str": lambda: call(scale="0.1"),
        "head_dim": lambda: call(q=_randn(g, (rows, heads, d + 1), dtype)),
        "heads": lambda: call(q=_randn(g, (rows, heads + 1, d), dtype)) if kv > 1 else call(q=q[None]),
        "cache_strided": lambda: call(kc=kc.transpose(1, 2), vc=vc.transpose(1, 2)) if kv > 1 and block_size > 1
        else call(kc=kc[..., :d - 1], vc=vc[..., :d - 1]),
        "cache_dtype": lambda: call(kc=kc.double(), vc=vc.double()),
        "bt_1d": lambda: call(bt=bt[0]),
        "bt_rows": lambda: call(bt=torch.cat([bt, bt])),
        "ctx_float": lambda: call(ctx=ctx_t.float()),
        "empty_batch": lambda: call(bt=bt[:0], ctx=ctx_t[:0], q_lens=None if ql_t is None else ql_t[:0]),
        "soc_unknown": lambda: call(soc="Ascend910X"),
        "bf16_unsupported": lambda: call(q=q.bfloat16(), kc=kc.bfloat16(), vc=vc.bfloat16(),
                                         soc=rng.choice(NO_BF16_SOCS)),
    }
    if multi:
        bad_ql = ql_t.clone()
        bad_ql[b] = ctx[b] + 1
        muts["q_len_past_context"] = lambda: call(q=_randn(g, (rows + ctx[b] + 1 - q_lens[b], heads, d), dtype),
                                                  q_lens=bad_ql)
        muts["q_lens_sum"] = lambda: call(q=_randn(g, (rows + 1, heads, d), dtype))
        muts["q_lens_negative"] = lambda: call(q_lens=-ql_t - 1)
    else:
        muts["rows_not_batch"] = lambda: call(q=_randn(g, (batch + 1, heads, d), dtype))
    name = rng.choice(sorted(muts))
    _expect_rejected(op, f"{op}/{name}", muts[name], [kc, vc])
    return op, name


def _fuzz_flash_attention(rng, g, bad, op):
    dtype = rng.choice(DTYPES)
    kv = rng.randint(1, 3)
    heads = kv * rng.randint(1, 4)
    d = rng.choice([1, 8, 16, 64, 80, 128, 256])
    lens = [rng.choice([0, 1, rng.randint(1, 20), rng.randint(1, 150)]) for _ in range(rng.randint(0, 4))]
    tokens = sum(lens)
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))],
                      dtype=torch.int32 if rng.random() < 0.7 else torch.int64)
    if rng.random() < 0.4 and tokens:  # q, k, v sliced from one fused projection output
        qkv = _randn(g, (tokens, (heads + 2 * kv) * d), dtype)
        q = qkv[:, :heads * d].view(tokens, heads, d)
        k = qkv[:, heads * d:(heads + kv) * d].view(tokens, kv, d)
        v = qkv[:, (heads + kv) * d:].view(tokens, kv, d)
    else:
        q = _view(rng, g, (tokens, heads, d), dtype)
        k, v = _view(rng, g, (tokens, kv, d), dtype), _view(rng, g, (tokens, kv, d), dtype)
    causal = rng.random() < 0.7
    window = rng.choice([None, None, 1, 7, 64])
    scale = rng.choice([None, None, 0.3 * d ** -0.5, 2.0 * d ** -0.5])  # scores of randn inputs stay O(1)
    soc = _soc(rng, dtype)

    def call(q=q, k=k, v=v, cu=cu, scale=scale, causal=causal, window=window, soc=soc):
        return K.flash_attention(q, k, v, cu, scale=scale, causal=causal, window=window, soc_type=soc)

    if bad is None:
        _close(call(), flash_attention_ref(q, k, v, cu, scale, causal, window), dtype, op)
        return op, "valid"
    muts = {
        "cu_first": lambda: call(cu=cu + 1),
        "cu_last": lambda: call(cu=torch.cat([cu, cu[-1:] + 1])),
        "cu_empty": lambda: call(cu=cu[:0]),
        "cu_float": lambda: call(cu=cu.float()),
        "cu_2d": lambda: call(cu=cu[None]),
        "heads": lambda: call(q=_randn(g, (tokens, heads + 1, d), dtype)) if kv > 1 else call(q=q[None]),
        "head_dim_big": lambda: call(q=torch.zeros(tokens, heads, 264, dtype=dtype),
                                     k=torch.zeros(tokens, kv, 264, dtype=dtype),
                                     v=torch.zeros(tokens, kv, 264, dtype=dtype)),
        "kv_shapes": lambda: call(v=_randn(g, (tokens, kv, d + 1), dtype)),
        "k_tokens": lambda: call(k=_randn(g, (tokens + 1, kv, d), dtype), v=_randn(g, (tokens + 1, kv, d), dtype)),
        "v_dtype": lambda: call(v=v.double()),
        "window_zero": lambda: call(window=0),
        "window_bool": lambda: call(window=True),
        "scale_nan": lambda: call(scale=float("nan")),
        "scale_str": lambda: call(scale="x"),
        "causal_int": lambda: call(causal=1),
        "soc_unknown": lambda: call(soc="Ascend"),
        "bf16_unsupported": lambda: call(q=q.bfloat16(), k=k.bfloat16(), v=v.bfloat16(),
                                         soc=rng.choice(NO_BF16_SOCS)),
    }
    if len(lens) >= 2:
        dec = cu.clone()
        dec[1] = dec[2] + 1
        muts["cu_decreasing"] = lambda: call(cu=dec)
    name = rng.choice(sorted(muts))
    _expect_rejected(op, f"{op}/{name}", muts[name], [])
    return op, name


def _fuzz_pack_rows4(rng, g, bad, op):
    # The decode graph's repacked weights: valid copies must give the linear the same bits as the weight itself at
    # 1, 2 or 16 rows of x (where the table has the kernel and the row count reads it; elsewhere the copy is
    # ignored), with fp32 set to read copies or the weights as they lie (atb.set_fp32_decode_copy, and batch
    # decode's fp32_batch_copy) at random.
    dtype = rng.choice([torch.float32, torch.bfloat16])
    with fp32_decode_copy(rng.random() < 0.5), fp32_batch_copy(rng.random() < 0.5):
        return _fuzz_pack_rows4_with(rng, g, bad, op, dtype)


def _fuzz_pack_rows4_with(rng, g, bad, op, dtype):
    n, k = _dim(rng, (1, 3, 5, 64, 130, 1030)), _dim(rng, (1, 7, 8, 64, 123, 576))
    w = _view(rng, g, (n, k), dtype, scale=k ** -0.5)
    out = torch.full((_C.rows4_numel(n, k),), 5.0, dtype=dtype)
    if bad is None:
        packed = pack_rows4(w, out=out if rng.random() < 0.5 else None)
        m = rng.choice([1, 2, 16])
        x, wc = _randn(g, (m, k), dtype), w.contiguous()
        outs = [torch.empty(m, n, dtype=dtype) for _ in range(2)]
        for y, r4 in zip(outs, (0, packed.data_ptr())):
            _C.linear(x.data_ptr(), m, k, [(wc.data_ptr(), 0, y.data_ptr(), n, r4)], 0, 0, DTYPE_CODES[dtype],
                      atb.get_soc("host"))
        if not torch.equal(outs[0], outs[1]):
            raise AssertionError(f"{op}: the linear over the rows4 copy differs from the weight's bits")
        _close(outs[1], linear_ref(x, w), dtype, op, scale=max(1.0, k ** 0.5 / 4))
        return op, "valid"
    muts = {
        "fp16": lambda: pack_rows4(w.half(), out=out),
        "int": lambda: pack_rows4(torch.zeros(n, k, dtype=torch.int32), out=out),
        "one_dim": lambda: pack_rows4(w.reshape(-1), out=out),
        "three_dim": lambda: pack_rows4(w[None], out=out),
        "empty": lambda: pack_rows4(torch.zeros(0, k, dtype=dtype), out=out),
        "not_tensor": lambda: pack_rows4(w.tolist(), out=out),
        "out_size": lambda: pack_rows4(w, out=torch.zeros(out.numel() + 1, dtype=dtype)),
        "out_dtype": lambda: pack_rows4(w, out=out.to(torch.float64)),
        "out_strided": lambda: pack_rows4(w, out=torch.zeros(2 * out.numel(), dtype=dtype)[::2]),
    }
    name = rng.choice(sorted(muts))
    _expect_rejected(op, f"{op}/{name}", muts[name], [out])
    return op, name


# Every public op, drawn uniformly; the fuzzer builds that op's case.
FUZZERS = {"rms_norm": _fuzz_rms_norm, "add_rms_norm": _fuzz_rms_norm, "rope": _fuzz_rope,
           "silu_mul": _fuzz_silu_mul, "swiglu": _fuzz_silu_mul, "linear": _fuzz_linear, "linear_multi": _fuzz_linear,
           "linear_residual": _fuzz_linear, "linear_swiglu": _fuzz_linear, "linear_auto": _fuzz_linear,
           "reshape_and_cache": _fuzz_reshape_and_cache, "paged_attention": _fuzz_paged_attention,
           "flash_attention": _fuzz_flash_attention, "pack_rows4": _fuzz_pack_rows4}
OPS = sorted(FUZZERS)
INVALID_FRACTION = 0.35


def _draw(i: int, seed: int):
    rng = random.Random(seed * 1_000_003 + i)
    return rng, OPS[rng.randrange(len(OPS))]


def run_case(i: int, seed: int = SEED):
    """Runs case i; returns (op, "valid" or the mutation); raises AssertionError on a wrong result or error."""
    rng, op = _draw(i, seed)
    bad = rng.random() < INVALID_FRACTION or None
    g = torch.Generator().manual_seed(rng.getrandbits(62))
    return FUZZERS[op](rng, g, bad, op)


def case_name(i: int, seed: int = SEED) -> str:
    return f"case {i} ({_draw(i, seed)[1]}, seed {seed})"


# ---- forked batches ------------------------------------------------------------------------------------------------


def _child(start, stop, conn, runner):
    # One thread per child, for torch and the kernels alike: the parent's OpenMP team does not survive fork(),
    # and a parallel region on it would wait forever for threads the child does not have.
    torch.set_num_threads(1)
    atb.set_num_threads(1)
    for i in range(start, stop):
        conn.send(("start", i))
        try:
            op, tag = runner(i)
            conn.send(("done", i, op, tag, None))
        except BaseException:  # noqa: BLE001 - reported to the parent with the case
            conn.send(("done", i, None, None, traceback.format_exc(limit=4)))
    conn.close()


def run_cases(cases, runner=run_case, batch=BATCH, hang_seconds=HANG_SECONDS):
    """Runs cases [0, cases) in forked children, `batch` per child. Returns (counts, failures):
    counts[(op, tag)] = n; failures = [(case, message)], a crash or hang included."""
    ctx = mp.get_context("fork")
    counts, failures = collections.Counter(), []
    i = 0
    while i < cases:
        stop = min(cases, i + batch)
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(i, stop, send, runner), daemon=True)
        p.start()
        send.close()
        current = i
        while True:
            if not recv.poll(hang_seconds):
                p.kill()
                failures.append((current, f"hung for more than {hang_seconds} s"))
                break
            try:
                msg = recv.recv()
            except EOFError:  # the child exited: normally after its last case, or it crashed
                break
            if msg[0] == "start":
                current = msg[1]
                continue
            _, idx, op, tag, err = msg
            if err is None:
                counts[(op, tag)] += 1
            else:
                failures.append((idx, err))
            current = idx + 1
        p.join()
        if p.exitcode not in (0, None) and current < stop:
            sig = -p.exitcode if p.exitcode < 0 else None
            what = f"killed by {signal.Signals(sig).name}" if sig else f"exited with code {p.exitcode}"
            failures.append((current, f"the process was {what}"))
            current += 1
        i = current if current > i else stop
    return counts, failures


def _summary(counts):
    by_op = collections.defaultdict(lambda: [0, 0, 0])  # valid, invalid, valid with quantized weights
    for (op, tag), n in counts.items():
        by_op[op][not tag.startswith("valid")] += n
        by_op[op][2] += n if tag == "valid quantized" else 0
    valid = sum(v[0] for v in by_op.values())
    invalid = sum(v[1] for v in by_op.values())
    lines = [f"fuzz: {valid + invalid} cases, {valid} valid, {invalid} invalid (seed {SEED})"]
    lines += [f"  {op:16s} valid {v:5d}  invalid {x:5d}" + (f"  (valid, quantized weights: {q})" if q else "")
              for op, (v, x, q) in sorted(by_op.items())]
    return "\n".join(lines)


def test_fuzz_every_kernel(request, fuzz_cases):
    only = os.environ.get("ATB_FUZZ_ONLY")
    if only is not None:  # rerun one case in this process (a debugger sees the failure directly)
        print(run_case(int(only)))
        return
    counts, failures = run_cases(fuzz_cases)
    print("\n" + _summary(counts))
    assert not failures, "\n\n".join(f"{case_name(i)}: {msg}" for i, msg in failures[:20]) + (
        f"\n... {len(failures)} failures in all" if len(failures) > 20 else "")
    assert sum(counts.values()) == fuzz_cases


def test_every_kernel_is_fuzzed_and_cases_are_reproducible():
    assert set(OPS) == set(atb.kernels.__all__)
    assert [case_name(i) for i in range(50)] == [case_name(i) for i in range(50)]
    assert run_case(7) == run_case(7) and run_case(8, seed=1) == run_case(8, seed=1)


def _crashing_runner(i):
    if i == 3:  # SIGKILL: a sanitizer runtime would turn a SIGSEGV into its own report and exit code
        os.kill(os.getpid(), signal.SIGKILL)
    if i == 5:
        raise AssertionError("wrong answer")
    return "op", "valid"


def test_a_crash_is_a_failure_naming_the_case_and_the_run_goes_on():
    counts, failures = run_cases(8, runner=_crashing_runner, batch=4)
    assert [i for i, _ in failures] == [3, 5]
    assert "killed by SIGKILL" in failures[0][1] and "wrong answer" in failures[1][1]
    assert counts[("op", "valid")] == 6
