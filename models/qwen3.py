"""Qwen3: per-head RMSNorm on q and k (over head_dim, before rope), optional bias, optional sliding window."""
from __future__ import annotations

from .qwen2 import Qwen2Adapter


class Qwen3Adapter(Qwen2Adapter):
    """Qwen2's per-layer sliding windows; the q/k norms come with the weights (LayerWeights.q_norm/k_norm)."""
    model_type = "qwen3"
    prefix = "Qwen3"


ADAPTER = Qwen3Adapter
