"""Quantized weight formats: :class:`QuantizedWeight` and float -> quantized conversion.

Two formats, ATB's weight-only "anti-quant" linear (W8A16 / W4A16), and the GGUF
blocks that map onto them (:mod:`atb.quant.gguf`):

* ``w8a16``: int8, symmetric, ``w = scale[g] * q`` with q in [-127, 127]; one scale per
  output channel (``group_size=0``) or per group of 16/32/64/128 values along K (GGUF Q8_0 is
  group 32; Q6_K is group 16 with fp32 scales).
* ``w4a16``: 4-bit, asymmetric, ``w = scale[g] * q + min[g]`` with q in [0, 15], one scale
  and one min per group of G = 32, 64 or 128 values along K (GGUF Q4_1 is G = 32; Q4_0 is
  G = 32 with ``min = -8 * scale``).

Storage, row-major over the N output rows, each row padded to ``k_pad`` = K rounded up to 32
values (padding q = 0, and the kernels zero-pad x, so padding adds nothing):

* ``data``: int8 ``[N, k_pad]`` (w8), or uint8 ``[N, k_pad / 2]`` (w4) where each 32-value
  chunk is 16 bytes, byte j holding value j in its low nibble and value j + 16 in its high
  nibble. That is GGUF's own Q4 block layout, and it is what the SIMD unpack wants: 16 bytes
  widened to 16 int32 lanes give values 0..15 (``& 0xF``) and 16..31 (``>> 4``) in x's order.
* ``scale`` (and ``min``): ``[N, groups]`` with ``groups = ceil(K / G)`` (the last group may
  be short: K = 576 with G = 128 has 4 full groups and one of 64), or ``[N, 1]`` per channel;
  dtype float32, float16 or bfloat16 (widened to fp32 per tile inside the kernels).
"""
from __future__ import annotations

import torch

from atb import _C
from atb.kernels._common import DTYPE_CODES, float_code, resolve_soc

CHUNK = 32
GROUP_SIZES = (32, 64, 128)
# 8-bit weights also take groups of 16 values (GGUF's Q6_K: a scale per 16), two to a 32-value chunk.
W8_GROUP_SIZES = (16,) + GROUP_SIZES
FORMATS = ("w8a16", "w4a16")
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def k_pad_of(k: int) -> int:
    return (k + CHUNK - 1) // CHUNK * CHUNK


class QuantizedWeight:
    """A quantized ``[N, K]`` weight (HF layout ``[out, in]``): packed data, scales (and mins), format.

    Accepted by every ``atb.kernels.linear*`` entry in place of a float weight. ``dequantize()``
    gives the float weight back (exactly ``scale * q (+ min)`` in fp32, one rounding).
    """

    __slots__ = ("data", "scale", "min", "shape", "bits", "group_size", "source")

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, min: torch.Tensor | None, shape, bits: int,
                 group_size: int, source: str = ""):
        n, k = (int(v) for v in shape)
        self.shape = torch.Size((n, k))
        self.bits, self.group_size, self.source = int(bits), int(group_size), source
        _validate("QuantizedWeight", data, scale, min, n, k, self.bits, self.group_size)
        self.data, self.scale, self.min = data, scale, min

    # --- description -------------------------------------------------------------------------------
    @property
    def format(self) -> str:
        return "w8a16" if self.bits == 8 else "w4a16"

    @property
    def k_pad(self) -> int:
        return k_pad_of(self.shape[1])

    @property
    def groups(self) -> int:
        return 1 if self.group_size == 0 else -(-self.k_pad // self.group_size)

    @property
    def nbytes(self) -> int:
        """Bytes the weight occupies (and a GEMV streams): data + scales (+ mins)."""
        t = self.data.nbytes + self.scale.nbytes
        return t + (self.min.nbytes if self.min is not None else 0)

    def dim(self) -> int:
        return 2

    def contiguous(self) -> "QuantizedWeight":
        """Itself: the packed storage is contiguous by construction (the linear entries call it on any weight)."""
        return self

    def __repr__(self) -> str:
        g = "per-channel" if self.group_size == 0 else f"group {self.group_size}"
        src = f", from {self.source}" if self.source else ""
        return (f"QuantizedWeight({self.format}, shape={tuple(self.shape)}, {g}, scale {self.scale.dtype}, "
                f"{self.nbytes} bytes{src})")

    # --- native plumbing ---------------------------------------------------------------------------
    def segment(self, bias_ptr: int = 0, out_ptr: int = 0) -> tuple:
        """The tuple ``atb._C.quant_linear`` takes for this weight."""
        return (self.data.data_ptr(), self.scale.data_ptr(), 0 if self.min is None else self.min.data_ptr(), bias_ptr,
                out_ptr, self.shape[0], self.bits, self.group_size, DTYPE_CODES[self.scale.dtype])

    def storage(self) -> tuple:
        """``(data, scale, min or 0, bits, group, scale dtype code)``: how the native decode graph holds it."""
        return (self.data.data_ptr(), self.scale.data_ptr(), 0 if self.min is None else self.min.data_ptr(), self.bits,
                self.group_size, DTYPE_CODES[self.scale.dtype])

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32, *, soc_type: str | None = None) -> torch.Tensor:
        """Rows ``ids`` (any shape of int indices) dequantized to ``dtype``: the embedding lookup."""
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"QuantizedWeight.rows: ids must be an int32/int64 tensor, got "
                            f"{type(ids).__name__ if not isinstance(ids, torch.Tensor) else ids.dtype}")
        if dtype not in DTYPE_CODES:
            raise TypeError(f"QuantizedWeight.rows: dtype must be float32, float16 or bfloat16, got {dtype}")
        flat = ids.reshape(-1).to(torch.int32).contiguous()
        n = self.shape[0]
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
            raise ValueError(f"QuantizedWeight.rows: ids must be in [0, {n}), got values in "
                             f"[{int(flat.min())}, {int(flat.max())}]")
        out = torch.empty(flat.numel(), self.shape[1], dtype=dtype)
        if flat.numel():
            _C.quant_dequant_rows(self.segment(), self.shape[1], flat.data_ptr(), flat.numel(), out.data_ptr(),
                                  DTYPE_CODES[dtype], resolve_soc(soc_type))
        return out.reshape(*ids.shape, self.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float ``[N, K]`` weight (native kernel)."""
        return self.rows(torch.arange(self.shape[0], dtype=torch.int32), dtype)


def _validate(op: str, data, scale, min, n: int, k: int, bits: int, group: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"{op}: bits must be 4 or 8, got {bits}")
    if group not in (0,) + W8_GROUP_SIZES:
        raise ValueError(f"{op}: group_size must be 0 (per channel), 16 (8 bits only), 32, 64 or 128, got {group}")
    if bits == 4 and group not in GROUP_SIZES:
        raise ValueError(f"{op}: 4-bit weights need a group size of 32, 64 or 128, got {group}")
    if n < 1 or k < 1:
        raise ValueError(f"{op}: shape must be positive, got ({n}, {k})")
    kp = k_pad_of(k)
    want = (torch.int8, (n, kp)) if bits == 8 else (torch.uint8, (n, kp // 2))
    for name, t in (("data", data), ("scale", scale)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
            raise TypeError(f"{op}: {name} must be a contiguous CPU torch.Tensor")
    if data.dtype != want[0] or tuple(data.shape) != want[1]:
        raise ValueError(f"{op}: data must be {want[0]} {list(want[1])}, got {data.dtype} {list(data.shape)}")
    groups = 1 if group == 0 else -(-kp // group)
    if scale.dtype not in SCALE_DTYPES or tuple(scale.shape) != (n, groups):
        raise ValueError(f"{op}: scale must be float32/float16/bfloat16 [{n}, {groups}], got {scale.dtype} "
                         f"{list(scale.shape)}")
    if bits == 4:
        if not isinstance(min, torch.Tensor) or min.dtype != scale.dtype or tuple(min.shape) != (n, groups) \
                or not min.is_contiguous():
            raise ValueError(f"{op}: 4-bit weights need min, a contiguous {scale.dtype} [{n}, {groups}] tensor")
    elif min is not None:
        raise ValueError(f"{op}: 8-bit weights are symmetric and take no min")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, k_pad]`` of values in [0, 15] -> ``[N, k_pad / 2]`` in the chunk layout above."""
    n, kp = q.shape
    c = q.reshape(n, kp // CHUNK, 2, CHUNK // 2)
    return (c[:, :, 0, :] | (c[:, :, 1, :] << 4)).reshape(n, kp // 2).contiguous()


def unpack_int4(data: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`."""
    n, half = data.shape
    c = data.reshape(n, half // (CHUNK // 2), 1, CHUNK // 2)
    return torch.cat((c & 0xF, c >> 4), dim=2).reshape(n, half * 2)


def _round_toward(x: torch.Tensor, dtype: torch.dtype, direction: float) -> torch.Tensor:
    """``x`` in ``dtype``, rounded to nearest unless that lands on the wrong side of ``x``; then one step
    toward ``direction``. A scale rounded down would push the group's extreme codes past the grid's last
    point, where the clamp costs more than half a step; fp16 scales of tiny groups (subnormal) lose most of
    their bits that way. Exactly representable scales (SmolLM2's own Q4_1 grid) stay exact."""
    r = x.to(dtype)
    wrong = r.float() < x if direction > 0 else r.float() > x
    return torch.where(wrong, torch.nextafter(r, torch.full_like(r, direction)), r)


def quantize_weight(w: torch.Tensor, fmt: str = "w8a16", group_size: int | None = None,
                    scale_dtype: torch.dtype | None = None) -> QuantizedWeight:
    """Quantizes a float ``[N, K]`` weight.

    ``w8a16``: symmetric int8, per output channel by default (``group_size=0``), or per group.
    ``w4a16``: asymmetric 4-bit, ``group_size`` 32, 64 or 128 (default 32), scale = (max - min) / 15
    and min per group, computed over the group's real values only (a short last group included).
    ``scale_dtype``: float16 by default for grouped formats (half the scale bytes; W4 G32 streams
    0.625 bytes per weight instead of 0.75), float32 per channel (negligible bytes). Values are
    rounded with the *stored* scale and min, so ``dequantize`` is the nearest grid point.
    """
    op = "quantize"
    if isinstance(w, torch.Tensor):
        w = w.detach()  # a parameter is read, never differentiated: the quantized copy is a new constant
    float_code(op, "weight", w)
    if w.dim() != 2 or w.shape[0] == 0 or w.shape[1] == 0:
        raise ValueError(f"{op}: weight must be 2-D [N, K] with N, K >= 1, got shape {tuple(w.shape)}")
    if fmt not in FORMATS:
        raise ValueError(f"{op}: format must be one of {FORMATS}, got {fmt!r}")
    bits = 8 if fmt == "w8a16" else 4
    group = (0 if bits == 8 else 32) if group_size is None else int(group_size)
    if group not in ((0,) + W8_GROUP_SIZES if bits == 8 else GROUP_SIZES):
        allowed = "0 (per channel), 16, 32, 64 or 128" if bits == 8 else "32, 64 or 128"
        raise ValueError(f"{op}: group_size for {fmt} must be {allowed}, got {group_size}")
    if scale_dtype is None:
        scale_dtype = torch.float32 if group == 0 else torch.float16
    if scale_dtype not in SCALE_DTYPES:
        raise TypeError(f"{op}: scale_dtype must be float32, float16 or bfloat16, got {scale_dtype}")
    n, k = w.shape
    kp = k_pad_of(k)
    g = kp if group == 0 else group
    groups = -(-kp // g)
    # fp32 math: the weights are fp32 or narrower, min/max are exact and the scale is rounded to its dtype anyway.
    wf = w.detach().to(torch.float32)
    padded = torch.zeros(n, groups * g, dtype=torch.float32)
    padded[:, :k] = wf
    valid = torch.zeros(groups * g, dtype=torch.bool)
    valid[:k] = True
    wg, vg = padded.reshape(n, groups, g), valid.reshape(1, groups, g)
    hi = torch.where(vg, wg, torch.tensor(-torch.inf)).amax(-1)
    lo = torch.where(vg, wg, torch.tensor(torch.inf)).amin(-1)
    # A group of padding alone (groups of 16 past K = 32j + 1 .. 32j + 16) gets scale 0 (and min 0).
    empty = ~vg.any(-1)
    hi, lo = torch.where(empty, 0.0, hi), torch.where(empty, 0.0, lo)
    if bits == 8:
        scale = _round_toward((torch.maximum(hi.abs(), lo.abs()) / 127), scale_dtype, torch.inf)
        s = scale.float()
        q = torch.round(wg / torch.where(s > 0, s, 1.0)[..., None]).clamp(-127, 127)
        q = torch.where(vg, q, 0.0).reshape(n, -1)[:, :kp].to(torch.int8).contiguous()
        return QuantizedWeight(q, scale.contiguous(), None, (n, k), 8, group, source="quantize")
    scale = _round_toward((hi - lo) / 15, scale_dtype, torch.inf)
    mn = lo.to(scale_dtype)  # rounded either way, the min moves the codes by at most its own rounding
    s, m = scale.float(), mn.float()
    q = torch.round((wg - m[..., None]) / torch.where(s > 0, s, 1.0)[..., None]).clamp(0, 15)
    q = torch.where(vg, q, 0.0).reshape(n, -1)[:, :kp].to(torch.uint8)
    return QuantizedWeight(pack_int4(q), scale.contiguous(), mn.contiguous(), (n, k), 4, group, source="quantize")


def dequantize_reference(qw: QuantizedWeight) -> torch.Tensor:
    """``scale * q (+ min)`` in float64 from the stored data: the reference the kernels are tested against."""
    n, k = qw.shape
    kp = qw.k_pad
    q = qw.data.to(torch.float64) if qw.bits == 8 else unpack_int4(qw.data).to(torch.float64)
    g = kp if qw.group_size == 0 else qw.group_size
    idx = torch.arange(kp) // g
    w = q * qw.scale.double()[:, idx]
    if qw.min is not None:
        w = w + qw.min.double()[:, idx]
    return w[:, :k]
