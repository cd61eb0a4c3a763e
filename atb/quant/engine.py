"""What ``TransformerInfer(model, quantize=...)`` and ``patch_hf_model(model, quantize=...)`` accept, resolved
to a model's quantized weights (:class:`atb.quant.api.QuantizedModelWeights`).

* ``"w8a16"``, ``"w4a16"``, with an optional group suffix ``"-g32"`` / ``"-g64"`` / ``"-g128"``
  (w4a16 defaults to 32, w8a16 to per channel): :func:`atb.quantize` of the model's float weights,
  embedding / LM head at 8 bits;
* ``"native"`` (alias ``"gguf"``), or ``"gguf:<path>"``: the GGUF file the model was loaded from, at its
  own precision (:func:`atb.quant.gguf.load_native`); tensors of types with no native form stay float, or
  with a ``"+<format>"`` suffix (``"native+w8a16-g32"``, ``"gguf:<path>+w8a16"``) are quantized to it;
* a ``QuantizedModelWeights`` built by the caller (any other option of :func:`atb.quantize`).
"""
from __future__ import annotations

import os

from atb.quant.api import QuantizedModelWeights, quantize_model

_GROUPS = {"": None, "-g16": 16, "-g32": 32, "-g64": 64, "-g128": 128}


def parse_spec(spec: str) -> tuple[str, int | None]:
    """``"w4a16-g128"`` -> ``("w4a16", 128)``; ValueError naming the valid forms."""
    for fmt in ("w8a16", "w4a16"):
        if spec.startswith(fmt) and spec[len(fmt):] in _GROUPS and (fmt, spec[len(fmt):]) != ("w4a16", "-g16"):
            return fmt, _GROUPS[spec[len(fmt):]]
    raise ValueError(f"quantize: unknown spec {spec!r}; valid: 'w8a16', 'w4a16' (optionally with -g32, -g64, -g128; "
                     f"w8a16 also -g16), 'native', 'gguf', 'gguf:<path>', or an atb.quantize(model, ...) result")


def split_native(spec: str) -> tuple[str | None, tuple[str, int | None] | None]:
    """``"native+w8a16-g32"`` -> ``("native", ("w8a16", 32))``, ``"gguf:<path>"`` -> ``("gguf:<path>", None)``;
    ``(None, None)`` for a spec that does not load a GGUF file's own tensors. A ``+`` suffix that is not a format
    belongs to the path (ValueError for ``native+<not a format>``)."""
    head, plus, tail = spec.rpartition("+")
    if plus and (head in ("native", "gguf") or head.startswith("gguf:")):
        try:
            return head, parse_spec(tail)
        except ValueError:
            if not head.startswith("gguf:"):
                raise ValueError(f"quantize: {spec!r}: after '{head}+' comes the format of the tensors the file has no "
                                 f"native form for: 'w8a16' or 'w4a16', optionally with -g32, -g64, -g128 (w8a16 also -g16)") from None
    if spec in ("native", "gguf") or spec.startswith("gguf:"):
        return spec, None
    return None, None


def runs_as_stored(quantize) -> bool:
    """The specs a model loaded quantized (``atb convert --quantize`` directory, ``load_model(quantize="native")``)
    runs as stored with: none, or "native" / "native+<format>" (what such a GGUF load already applied)."""
    return quantize is None or (isinstance(quantize, str) and split_native(quantize)[0] in ("native", "gguf"))


def gguf_path_of(model) -> str | None:
    """The GGUF file a model was loaded from by ``atb.checkpoints.load_model`` (None if unknown)."""
    path = getattr(model, "atb_source_path", None)
    return path if isinstance(path, str) and path.endswith(".gguf") and os.path.isfile(path) else None


def describe(model, quantize) -> str | None:
    """The engine's ``quantize`` label (``memory_summary()["quantize"]``): the spec string given, "custom" for
    a ``QuantizedModelWeights``, ``"stored:<format>[-g<group>]"`` for a model loaded from an ``atb convert
    --quantize`` directory (which runs quantized with ``quantize`` unset), None for float weights."""
    stored = getattr(model, "atb_quantization_config", None)
    if stored is not None and runs_as_stored(quantize):
        fmt, group = stored.get("format", "?"), stored.get("group_size")
        return f"stored:{fmt}" + (f"-g{group}" if group and not fmt.startswith("native") else "")
    return quantize if quantize is None or isinstance(quantize, str) else "custom"


def resolve(model, quantize) -> QuantizedModelWeights | None:
    # A model loaded from an `atb convert --quantize` directory carries its stored quantized weights (its
    # projections have no float copy): they are what it runs on, and re-quantizing them is not possible.
    stored = getattr(model, "atb_quantized", None)
    if stored is not None and runs_as_stored(quantize):
        return stored
    if stored is not None and not isinstance(quantize, QuantizedModelWeights):
        raise ValueError(f"quantize={quantize!r}: this model's weights are stored quantized by atb convert "
                         f"({getattr(model, 'atb_quantization_config', {}).get('format', '?')}) and run as stored; "
                         f"leave quantize unset")
    if quantize is None:
        return None
    if isinstance(quantize, QuantizedModelWeights):
        return quantize
    if not isinstance(quantize, str):
        raise TypeError(f"quantize: expected a spec string or a QuantizedModelWeights, got {type(quantize).__name__}")
    source, rest = split_native(quantize)
    if source is not None:
        from atb.quant.gguf import load_native

        path = source[5:] if source.startswith("gguf:") else gguf_path_of(model)
        if not path:
            raise ValueError("quantize='native' runs the GGUF file the model came from, but this model was not loaded "
                             "from one by atb.checkpoints.load_model; pass quantize='gguf:<path to the file>'")
        return load_native(model, path, rest=rest)
    fmt, group = parse_spec(quantize)
    return quantize_model(model, fmt, group)
