"""GGUF block helpers for the tests: Q4_K blocks (gguf's package dequantizes them but has no quantizer), and a
copy of a GGUF file with some tensors replaced."""
from __future__ import annotations

import numpy as np

QK_K = 256


def _fp16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)[..., None].view(np.uint8)


def _pack_q4_k(d16: np.ndarray, dmin16: np.ndarray, sc: np.ndarray, mins: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Super-blocks [..., 144] from fp16 d / dmin [...], 6-bit scales / mins [..., 8] and values [..., 8, 32]."""
    sc, mins, q = sc.astype(np.uint8), mins.astype(np.uint8), q.astype(np.uint8)
    scales = np.concatenate([(sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6),
                             (mins[..., :4] & 0x3F) | ((mins[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 0x0F) | ((mins[..., 4:] & 0x0F) << 4)], axis=-1)
    qs = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(*q.shape[:-2], 128)
    return np.concatenate([_fp16_bytes(d16), _fp16_bytes(dmin16), scales, qs], axis=-1)


def random_q4_k(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K blocks uint8 [n, k / 256 * 144]: every scale, min and value bit pattern, finite d and dmin."""
    sb = (n, k // QK_K)
    d = (np.abs(rng.standard_normal(sb)) * 1e-3).astype(np.float16)
    dmin = (np.abs(rng.standard_normal(sb)) * 1e-3).astype(np.float16)
    blocks = _pack_q4_k(d, dmin, rng.integers(0, 64, (*sb, 8)), rng.integers(0, 64, (*sb, 8)),
                        rng.integers(0, 16, (*sb, 8, 32)))
    return blocks.reshape(n, -1)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """A float32 [n, k] weight (k a multiple of 256) as Q4_K blocks uint8 [n, k / 256 * 144]: each sub-block's
    range over 16 levels, its scale and min on the super-block's 6-bit grids (a plain quantizer, not llama.cpp's
    search)."""
    n, k = w.shape
    x = w.reshape(n, k // QK_K, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(-1), 0.0)
    step, offset = (x.max(-1) - lo) / 15, -lo
    d = (step.max(-1) / 63).astype(np.float16)
    dmin = (offset.max(-1) / 63).astype(np.float16)

    def grid(v, unit):  # v / unit rounded onto 0..63, 0 where the unit is 0
        unit = unit.astype(np.float32)[..., None]
        return np.clip(np.rint(v / np.where(unit > 0, unit, 1)), 0, 63) * (unit > 0)

    sc, mins = grid(step, d), grid(offset, dmin)
    s = (d.astype(np.float32)[..., None] * sc)[..., None]
    m = (dmin.astype(np.float32)[..., None] * mins)[..., None]
    q = np.clip(np.rint((x + m) / np.where(s > 0, s, 1)), 0, 15) * (s > 0)
    return _pack_q4_k(d, dmin, sc, mins, q).reshape(n, -1)


def _pack_q6_k(d16: np.ndarray, sc: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Super-blocks [..., 210] from fp16 d [...], int8 scales [..., 16] and 6-bit values [..., 256] (q + 32).

    ggml's layout: per half of 128 values, value 32 i + l (i = 0..3, l = 0..31) keeps its low 4 bits in ql[l]
    (i = 0, 2) or ql[32 + l] (i = 1, 3), low nibble for i < 2, high for i >= 2, its top 2 bits at bits 2 i
    of qh[l]; the fields are ql[128], qh[64], scales[16], d."""
    v = q.astype(np.uint8).reshape(*q.shape[:-1], 2, 4, 32)
    lo, hi = v & 0x0F, v >> 4
    ql = np.concatenate([lo[..., 0, :] | (lo[..., 2, :] << 4), lo[..., 1, :] | (lo[..., 3, :] << 4)], axis=-1)
    qh = hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)
    lead = q.shape[:-1]
    return np.concatenate([ql.reshape(*lead, 128), qh.reshape(*lead, 64), sc.astype(np.int8).view(np.uint8),
                           _fp16_bytes(d16)], axis=-1)


def random_q6_k(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q6_K blocks uint8 [n, k / 256 * 210]: every int8 scale and 6-bit value pattern, finite d."""
    sb = (n, k // QK_K)
    d = (rng.standard_normal(sb) * 1e-3).astype(np.float16)
    return _pack_q6_k(d, rng.integers(-128, 128, (*sb, 16)), rng.integers(0, 64, (*sb, QK_K))).reshape(n, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """A float32 [n, k] weight (k a multiple of 256) as Q6_K blocks uint8 [n, k / 256 * 210]: each 16-value
    sub-block symmetric over [-32, 31], its scale on the super-block's int8 grid (a plain quantizer, not
    llama.cpp's search)."""
    n, k = w.shape
    x = w.reshape(n, k // QK_K, 16, 16).astype(np.float32)
    step = np.abs(x).max(-1) / 31                                     # [n, blocks, 16]
    d = (step.max(-1) / 127).astype(np.float16)
    unit = d.astype(np.float32)[..., None]
    sc = np.clip(np.rint(step / np.where(unit > 0, unit, 1)), 0, 127) * (unit > 0)
    s = (unit * sc)[..., None]
    q = np.clip(np.rint(x / np.where(s > 0, s, 1)), -32, 31) * (s > 0)
    return _pack_q6_k(d, sc, (q + 32).reshape(n, k // QK_K, QK_K)).reshape(n, -1)


def copy_gguf(src: str, dst: str, replace: dict) -> None:
    """Writes ``dst``: the GGUF file ``src`` with its metadata, each tensor named in ``replace`` as the
    ``(uint8 blocks [rows, bytes], GGMLQuantizationType)`` given there, every other tensor as it is."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    tensors = []
    for t in reader.tensors:
        data, kind = replace.get(t.name, (t.data, t.tensor_type))
        tensors.append((t.name, np.ascontiguousarray(data), kind))
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data)
    writer.close()
