"""Mistral: LLaMA layout plus a sliding attention window on every layer (``config.sliding_window``)."""
from __future__ import annotations

from .base import FamilyAdapter


class MistralAdapter(FamilyAdapter):
    model_type = "mistral"
    prefix = "Mistral"

    def sliding_windows(self, config) -> tuple:
        # MistralAttention passes config.sliding_window to every layer (None = full attention).
        window = getattr(config, "sliding_window", None)
        return (int(window) if window else None,) * config.num_hidden_layers


ADAPTER = MistralAdapter
