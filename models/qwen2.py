"""Qwen2: bias on q/k/v (not on o), optional sliding window on the layers ``config.layer_types`` marks."""
from __future__ import annotations

from .base import FamilyAdapter


class Qwen2Adapter(FamilyAdapter):
    model_type = "qwen2"
    prefix = "Qwen2"

    def sliding_windows(self, config) -> tuple:
        """Per-layer window from ``config.layer_types`` ("sliding_attention" layers use config.sliding_window)."""
        types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        return tuple(int(window) if (t == "sliding_attention" and window) else None for t in types)


ADAPTER = Qwen2Adapter
