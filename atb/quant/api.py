"""``atb.quantize`` / ``atb.dequantize``: float weights, a layer or a whole model to W8A16 / W4A16.

``quantize`` never modifies its argument: it returns new objects holding the quantized
weights (norms and biases are shared with the source, not copied).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from atb.quant.formats import FORMATS, QuantizedWeight, quantize_weight

# The projections of a LayerWeights that are quantized (norms and biases stay float).
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(eq=False)
class QuantizedModelWeights:
    """A model's weights for the engine, quantized: per-layer ``LayerWeights`` whose projections are
    :class:`QuantizedWeight`, the embedding table and the LM head (the same object when tied), the
    final norm, and a per-tensor report of what each became and why."""

    layers: list
    embed: object
    lm_head: object
    final_norm: torch.Tensor
    tied: bool
    report: dict = field(default_factory=dict)

    def nbytes(self) -> int:
        seen, total = set(), 0
        for t in self._all():
            if id(t) not in seen:
                seen.add(id(t))
                total += t.nbytes if isinstance(t, QuantizedWeight) else t.numel() * t.element_size()
        return total

    def _all(self):
        for lw in self.layers:
            yield from lw.tensors().values()
        yield self.embed
        yield self.lm_head
        yield self.final_norm


def quantize_layer(lw, fmt: str, group_size: int | None = None, scale_dtype: torch.dtype | None = None):
    """A copy of a ``LayerWeights`` whose seven projections are quantized (norms and biases shared)."""
    changes = {name: _quantize_one(getattr(lw, name), fmt, group_size, scale_dtype) for name in PROJECTIONS}
    return dataclasses.replace(lw, **changes)


def _quantize_one(w, fmt, group_size, scale_dtype):
    if isinstance(w, QuantizedWeight):
        return w  # already quantized (e.g. loaded from GGUF): kept at its own precision
    return quantize_weight(w, fmt, group_size, scale_dtype)


def quantize(obj, fmt: str = "w8a16", group_size: int | None = None, *, scale_dtype: torch.dtype | None = None,
             embed_format: str | None = "w8a16"):
    """Quantizes ``obj`` to ``fmt`` ("w8a16" or "w4a16"):

    * a float ``[N, K]`` tensor -> :class:`QuantizedWeight`;
    * a ``LayerWeights`` -> a ``LayerWeights`` with quantized projections;
    * an HF causal LM (any family ``atb`` supports) -> :class:`QuantizedModelWeights`: every layer's
      projections in ``fmt``, the embedding table and LM head in ``embed_format`` (default "w8a16" for
      both formats: with a 4-bit tied LM head SmolLM2 no longer answers the capital-of-France prompt;
      ``embed_format="w4a16"`` quantizes them to 4 bits with ``group_size``, None keeps them float).

    ``group_size``: w8a16 0 (per channel, default) or 32/64/128; w4a16 32 (default), 64 or 128.
    ``scale_dtype``: float16 for grouped formats, float32 per channel by default (see README).
    """
    if fmt not in FORMATS:
        raise ValueError(f"quantize: format must be one of {FORMATS}, got {fmt!r}")
    if embed_format not in FORMATS + (None,):
        raise ValueError(f"quantize: embed_format must be one of {FORMATS} or None, got {embed_format!r}")
    if isinstance(obj, torch.Tensor):
        return quantize_weight(obj, fmt, group_size, scale_dtype)
    if all(hasattr(obj, n) for n in PROJECTIONS) and hasattr(obj, "tensors"):
        return quantize_layer(obj, fmt, group_size, scale_dtype)
    if isinstance(obj, torch.nn.Module) and hasattr(obj, "config"):
        return quantize_model(obj, fmt, group_size, scale_dtype=scale_dtype, embed_format=embed_format)
    raise TypeError(f"quantize: expected a float weight tensor, a LayerWeights or an HF causal LM, got "
                    f"{type(obj).__name__}")


def quantize_model(model, fmt: str, group_size: int | None = None, *, scale_dtype=None,
                   embed_format: str | None = "w8a16") -> QuantizedModelWeights:
    from atb.registry import get_adapter

    adapter = get_adapter(model)
    spec = adapter.spec
    report = {}
    layers = []
    for i in range(spec.num_layers):
        lw = quantize_layer(adapter.layer_weights(model, i), fmt, group_size, scale_dtype)
        for name in PROJECTIONS:
            report[f"layers.{i}.{name}"] = repr(getattr(lw, name))
        layers.append(lw)
    embed_w = adapter.embed_tokens(model)
    head_w = adapter.lm_head(model)
    tied = head_w is embed_w or head_w.data_ptr() == embed_w.data_ptr()
    eg = group_size if embed_format == fmt else None

    def table(w):
        return w.detach() if embed_format is None else quantize_weight(w, embed_format, eg, scale_dtype)

    embed = table(embed_w)
    head = embed if tied else table(head_w)
    report["embed"] = repr(embed) if embed_format else f"float {embed_w.dtype} (embed_format=None)"
    report["lm_head"] = "tied to embed" if tied else (repr(head) if embed_format else f"float {head_w.dtype}")
    return QuantizedModelWeights(layers, embed, head, adapter.final_norm(model), tied, report)


def dequantize(obj, dtype: torch.dtype = torch.float32):
    """The float form of a :class:`QuantizedWeight` (or of every quantized projection of a LayerWeights)."""
    if isinstance(obj, QuantizedWeight):
        return obj.dequantize(dtype)
    if all(hasattr(obj, n) for n in PROJECTIONS) and hasattr(obj, "tensors"):
        return dataclasses.replace(obj, **{n: dequantize(getattr(obj, n), dtype) if isinstance(getattr(obj, n),
                                                                                                   QuantizedWeight)
                                           else getattr(obj, n) for n in PROJECTIONS})
    raise TypeError(f"dequantize: expected a QuantizedWeight or a LayerWeights, got {type(obj).__name__}")
