"""Qwen3: per-head RMSNorm on q and k (over head_dim, before rope), optional bias, optional sliding window."""
from __future__ import annotations

from .base import FamilyAdapter
from .qwen2 import layer_type_windows


class Qwen3Adapter(FamilyAdapter):
    model_type = "qwen3"
    prefix = "Qwen3"

    def sliding_windows(self, config) -> tuple:
        return layer_type_windows(config)


ADAPTER = Qwen3Adapter
