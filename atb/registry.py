"""Finds the adapter for a model family by ``config.model_type``.

Adapters live in ``atb.models.<family>`` and are imported lazily, by name,
the first time a model of that family is seen: nothing in ``atb`` imports
``atb.models`` at import time (adapters sit above ``atb.layers`` and may
import it).
"""
from __future__ import annotations

import importlib

# model_type -> module under atb.models
_FAMILIES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}


def supported_model_types() -> list[str]:
    return sorted(_FAMILIES)


def _config_of(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    if not hasattr(config, "model_type"):
        raise TypeError(f"expected an HF model or config, got {type(model_or_config).__name__}")
    return config


def get_adapter(model_or_config):
    """The family adapter (an instance, holding the ModelSpec) for an HF model or config.

    Raises ValueError naming the supported model types for any other family.
    """
    config = _config_of(model_or_config)
    family = _FAMILIES.get(config.model_type)
    if family is None:
        raise ValueError(f"atb: unsupported model_type '{config.model_type}'; "
                         f"supported: {', '.join(supported_model_types())}")
    module = importlib.import_module(f"atb.models.{family}")
    return module.ADAPTER(config)
