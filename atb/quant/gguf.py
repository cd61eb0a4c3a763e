"""GGUF checkpoints at their own precision: Q8_0, Q5_0, Q4_0, Q4_1, Q4_K and Q6_K tensors loaded straight into
:class:`QuantizedWeight` (no float round trip), through the ``gguf`` package's reader.

Block layouts (32 values along K per block, ``d`` and ``m`` fp16; Q4_K's below):

* Q8_0: ``d, q[32] (int8)``, w = d * q             -> w8a16, group 32, fp16 scale d;
* Q5_0: ``d, qh[4], qs[16]``, w = d * (q - 16)      -> w8a16, group 32, fp16 scale d (q - 16 is in
  [-16, 15]: 5 of int8's bits; the type llama.cpp's Q4_K_M files fall back to for rows whose width is not a
  multiple of Q4_K's 256, as SmolLM2's 576-wide ones);
* Q4_0: ``d, qs[16]``,        w = d * (q - 8)       -> w4a16, group 32, scale d, min -8 d
  (exact in fp16 and fp32: a power-of-two multiple; ``d * q - 8 d`` equals ``d * (q - 8)`` in
  fp32 because ``d * q`` is exact);
* Q4_1: ``d, m, qs[16]``,     w = d * q + m         -> w4a16, group 32, scale d, min m.

``qs`` byte j holds value j (low nibble) and value j + 16 (high nibble): the W4 layout of
:mod:`atb.quant.formats` itself, so the nibbles are copied as they are.

* Q4_K (the 4-bit type of llama.cpp's ``Q4_K_S`` / ``Q4_K_M`` files): super-blocks of 256 values,
  ``d, dmin`` (fp16), 12 bytes holding eight 6-bit scales ``sc[j]`` and mins ``m[j]`` (one per
  sub-block of 32), ``qs[128]``; w = d * sc[j] * q - dmin * m[j] -> w4a16, group 32, fp32 scale
  ``d * sc[j]`` and min ``-dmin * m[j]``. Both products are exact in fp32 (an fp16 times a 6-bit
  integer), and so is ``d * sc[j] * q``, so the kernels' ``scale * q + min`` rounds once, where gguf's
  dequantization does: the same floats. fp16 scales would round ``d * sc[j]``, so the scales take
  0.25 byte per weight (Q4_K's own 0.0625) and a Q4_K weight streams 0.75 bytes per value. Its
  nibbles are stored a 32-byte chunk per two sub-blocks (sub-block 2c in the low nibbles of chunk c,
  2c + 1 in the high ones) and are repacked to the W4 layout once, at load.

* Q6_K (the 6-bit type of llama.cpp's ``Q6_K`` files, and of the LM head and half of ``attn_v`` /
  ``ffn_down`` in ``Q4_K_M`` ones): super-blocks of 256 values, ``ql[128]`` (low 4 bits), ``qh[64]`` (high
  2 bits), sixteen int8 scales ``sc[j]`` (one per 16 values) and ``d`` (fp16); w = d * sc[j] * (q - 32)
  -> w8a16, **group 16**, int8 ``q - 32`` in [-32, 31] and fp32 scale ``d * sc[j]``. Every product is
  exact in fp32 (11 + 7 + 5 significant bits), so the weights are gguf's own bit for bit. 1.25 bytes
  per weight (Q6_K's own 0.82; bf16's 2).

Tensors of any other GGUF type (F32, F16, Q5_1, Q5_K, ...) are dequantized to float by ``gguf`` and
reported per tensor: none of them maps exactly onto W8A16 / W4A16 (Q5_1 and Q5_K have a min, which W8A16
has not; 5 bits with a min need more than W4A16's 4).

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` (its rope layout); HF's GGUF
loader undoes that, and so does :func:`load_native`, on whole quantized rows.
"""
from __future__ import annotations

import numpy as np
import torch

from atb.quant.formats import QuantizedWeight, quantize_weight

NATIVE_TYPES = ("Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
# Values per block, and bytes per block, of each.
_BLOCK = {"Q8_0": (32, 34), "Q5_0": (32, 22), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144),
          "Q6_K": (256, 210)}

# GGUF tensor name (after "blk.{i}.") -> LayerWeights field.
LAYER_NAMES = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate", "ffn_up": "up",
               "ffn_down": "down"}


def _blocks(t) -> tuple[np.ndarray, int, int]:
    """The tensor's blocks as uint8 ``[N, blocks per row, block bytes]``, N and K."""
    values, block_bytes = _BLOCK[t.tensor_type.name]
    n = int(t.shape[1]) if len(t.shape) > 1 else 1
    k = int(t.shape[0])
    raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(n, k // values, block_bytes)
    return raw, n, k


def _f16(raw: np.ndarray, off: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw[..., off:off + 2]).view(np.float16)[..., 0].copy())


def tensor_to_quantized(t, name: str = "") -> QuantizedWeight:
    """One ``gguf.ReaderTensor`` of a native type (:data:`NATIVE_TYPES`) as a :class:`QuantizedWeight` ``[N, K]``."""
    kind = t.tensor_type.name
    if kind not in NATIVE_TYPES:
        raise ValueError(f"gguf: tensor {name or t.name} is {kind}; natively loadable types are {NATIVE_TYPES}")
    if len(t.shape) != 2:
        raise ValueError(f"gguf: tensor {name or t.name} has shape {list(t.shape)}, expected 2-D")
    src = f"gguf:{kind}"
    if kind == "Q8_0":
        raw, n, k = _blocks(t)
        scale = _f16(raw, 0)
        q = torch.from_numpy(np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(n, k).copy())
        return QuantizedWeight(q, scale.contiguous(), None, (n, k), 8, 32, source=src)
    if kind == "Q5_0":
        raw, n, k = _blocks(t)
        # Value j's low 4 bits: byte j of qs (j < 16, low nibble) or j - 16 (high nibble); its 5th: bit j of qh.
        qs = raw[..., 6:]
        low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        high = (np.ascontiguousarray(raw[..., 2:6]).view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
        q = (low | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(16)
        return QuantizedWeight(torch.from_numpy(q.reshape(n, k)), _f16(raw, 0).contiguous(), None, (n, k), 8, 32,
                               source=src)
    if kind == "Q4_K":
        return _q4_k(*_blocks(t), src)
    if kind == "Q6_K":
        return _q6_k(*_blocks(t), src)
    if kind == "Q4_0":
        raw, n, k = _blocks(t)
        scale = _f16(raw, 0)
        mn = -8 * scale.float()
        if not torch.isfinite(mn.half()).all():  # -8 d overflows fp16: keep both in fp32 (still exact)
            scale = scale.float()
        else:
            mn = mn.half()
        qs = raw[..., 2:]
    else:
        raw, n, k = _blocks(t)
        scale, mn = _f16(raw, 0), _f16(raw, 2)
        qs = raw[..., 4:]
    data = torch.from_numpy(np.ascontiguousarray(qs).reshape(n, k // 2).copy())
    return QuantizedWeight(data, scale.contiguous(), mn.contiguous(), (n, k), 4, 32, source=src)


def _q4_k(raw: np.ndarray, n: int, k: int, source: str) -> QuantizedWeight:
    """Q4_K super-blocks ``[N, K / 256, 144]`` as w4a16 group 32 with fp32 scales and mins (module docstring)."""
    d, dmin = _f16(raw, 0).float(), _f16(raw, 2).float()          # [N, K / 256]
    # The 12 scale bytes: bytes 0-3 hold sub-blocks 0-3's 6-bit scales (and the top 2 bits of 4-7's), 4-7 their
    # 6-bit mins (and the top 2 bits of 4-7's), 8-11 the low 4 bits of 4-7's scale (low nibble) and min (high).
    packed = raw[..., 4:16].astype(np.uint8)
    lo, mid, hi = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)    # [N, K / 256, 8]
    mins = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    scale = (d[..., None] * torch.from_numpy(sc.astype(np.float32))).reshape(n, k // 32)
    mn = (-(dmin[..., None] * torch.from_numpy(mins.astype(np.float32)))).reshape(n, k // 32)
    # Nibbles: chunk c's 32 bytes hold sub-block 2c (low nibbles) and 2c + 1 (high) -> values [N, K / 32, 32],
    # then byte j of each sub-block's 16 takes value j (low nibble) and value j + 16 (high): the W4 layout.
    qs = raw[..., 16:].reshape(n, k // 256, 4, 1, 32)
    values = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    values = values.reshape(n, k // 32, 32)
    data = (values[..., :16] | (values[..., 16:] << 4)).astype(np.uint8).reshape(n, k // 2)
    return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(data)), scale.contiguous(), mn.contiguous(), (n, k),
                           4, 32, source=source)


def _q6_k(raw: np.ndarray, n: int, k: int, source: str) -> QuantizedWeight:
    """Q6_K super-blocks ``[N, K / 256, 210]`` as w8a16 group 16 with fp32 scales (module docstring)."""
    ql, qh = raw[..., 0:128].reshape(n, k // 256, 2, 64), raw[..., 128:192].reshape(n, k // 256, 2, 1, 32)
    sc = torch.from_numpy(np.ascontiguousarray(raw[..., 192:208]).view(np.int8).astype(np.float32))
    d = _f16(raw, 208).float()
    # Each half of 128 values: value 32 i + l (i = 0..3, l = 0..31) has its low 4 bits in ql[l] (i = 0, 2) or
    # ql[32 + l] (i = 1, 3), low nibble for i < 2 and high for i >= 2, and its top 2 bits at bits 2 i of qh[l].
    low = np.stack([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-2)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 0x03
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)                  # [N, K / 256, 2, 4, 32]
    scale = (d[..., None] * sc).reshape(n, k // 16)
    return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(q.reshape(n, k))), scale.contiguous(), None, (n, k),
                           8, 16, source=source)


def native_bits(kind: str) -> int:
    """The W8/W4 format a native tensor of GGUF type ``kind`` loads as: 8 for Q8_0, Q5_0 and Q6_K, else 4."""
    return 8 if kind in ("Q8_0", "Q5_0", "Q6_K") else 4


def native_group(kind: str) -> int:
    """The group size a native tensor of GGUF type ``kind`` loads with: 16 for Q6_K, else 32."""
    return 16 if kind == "Q6_K" else 32


def scale_dtype(kind: str) -> torch.dtype:
    """The scale (and min) dtype a native tensor of GGUF type ``kind`` loads with: the blocks' own fp16, or fp32
    for Q4_K and Q6_K (exact products). Q4_0 may also load in fp32 (-8 d overflowing fp16): read its blocks to
    know."""
    return torch.float32 if kind in ("Q4_K", "Q6_K") else torch.float16


def type_summary(path: str) -> str:
    """What ``quantize="native"`` makes of a GGUF file's weight matrices, per tensor type, e.g. ``Q5_0 166
    (native: w8a16), Q6_K 14 (native: w8a16), Q5_1 30 (float; native+w8a16-g32 quantizes them), 1-D 61 (float)``."""
    import collections

    import gguf

    counts = collections.Counter()
    for t in gguf.GGUFReader(path).tensors:
        counts["1-D" if len(t.shape) < 2 else t.tensor_type.name] += 1
    parts = []
    for kind, n in counts.most_common():
        how = ("float" if kind == "1-D" else f"native: w{native_bits(kind)}a16" if kind in NATIVE_TYPES else
               "float; native+w8a16-g32 quantizes them" if kind not in ("F32", "F16", "BF16") else
               "float; native+w8a16 quantizes them")
        parts.append(f"{kind} {n} ({how})")
    return ", ".join(parts)


def permute_rows(w: QuantizedWeight, n_head: int) -> QuantizedWeight:
    """HF's ``reverse_permute_weights`` for attn_q / attn_k, applied to whole quantized rows."""
    n = w.shape[0]
    idx = torch.arange(n).reshape(n_head, n // n_head // 2, 2).transpose(1, 2).reshape(n)
    mn = None if w.min is None else w.min[idx].contiguous()
    return QuantizedWeight(w.data[idx].contiguous(), w.scale[idx].contiguous(), mn, tuple(w.shape), w.bits,
                           w.group_size, source=w.source)


def load_native(model, path: str | None = None, *, rest: tuple[str, int | None] | None = None):
    """The weights of ``model`` (an HF model loaded from the GGUF file ``path``, default the embedded
    SmolLM2) for the engine at the file's own precision: every Q8_0/Q5_0/Q4_0/Q4_1/Q4_K/Q6_K projection, embedding and
    LM head as a :class:`QuantizedWeight` read from the file; other types stay as the float tensors HF
    loaded, unless ``rest`` = ``(format, group_size)`` (``atb.quantize``'s) quantizes them: projections to that
    format, the embedding / LM head to 8 bits as ``atb.quantize`` puts them. Norms and biases are the model's own
    tensors. Returns a ``QuantizedModelWeights`` whose ``report`` says, per tensor, what it became.
    """
    import dataclasses

    import gguf

    from atb.checkpoints import default_model_path
    from atb.quant.api import QuantizedModelWeights
    from atb.registry import get_adapter

    path = default_model_path() if path is None else path
    adapter = get_adapter(model)
    spec = adapter.spec
    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    report = {}

    def native(gname: str, fallback: torch.Tensor, label: str, n_head: int | None = None):
        t = by_name.get(gname)
        if t is None:
            report[label] = f"not in file: float {fallback.dtype} from the model"
            return fallback
        if t.tensor_type.name not in NATIVE_TYPES:
            if rest is None:
                report[label] = f"{t.tensor_type.name}: float {fallback.dtype} (dequantized by gguf)"
                return fallback
            table = label in ("embed", "lm_head")
            fmt, group = ("w8a16", None) if table and rest[0] != "w8a16" else rest
            w = quantize_weight(fallback.detach(), fmt, group)
            report[label] = f"{t.tensor_type.name}: quantized from float, {w!r}"
            return w
        w = tensor_to_quantized(t, gname)
        if tuple(w.shape) != tuple(fallback.shape):
            raise ValueError(f"gguf: {gname} has shape {tuple(w.shape)} but the model's {label} is "
                             f"{tuple(fallback.shape)}; is the model loaded from {path}?")
        if n_head is not None:
            w = permute_rows(w, n_head)
        report[label] = repr(w)
        return w

    layers = []
    for i in range(spec.num_layers):
        lw = adapter.layer_weights(model, i)
        heads = {"q": spec.num_heads, "k": spec.num_kv_heads}
        changes = {field: native(f"blk.{i}.{g}.weight", getattr(lw, field), f"layers.{i}.{field}", heads.get(field))
                   for g, field in LAYER_NAMES.items()}
        layers.append(dataclasses.replace(lw, **changes))
    embed_w, head_w = adapter.embed_tokens(model), adapter.lm_head(model)
    tied = head_w is embed_w or head_w.data_ptr() == embed_w.data_ptr()
    embed = native("token_embd.weight", embed_w, "embed")
    if tied or "output.weight" not in by_name:
        head = embed if tied else native("output.weight", head_w, "lm_head")
        report["lm_head"] = "tied to embed" if tied else report["lm_head"]
    else:
        head = native("output.weight", head_w, "lm_head")
    return QuantizedModelWeights(layers, embed, head, adapter.final_norm(model), tied, report)
