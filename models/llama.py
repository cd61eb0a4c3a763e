"""LLaMA family: SmolLM2, TinyLlama, Llama 2 / 3 (GQA or MHA, optional attention/MLP bias, rope scaling)."""
from __future__ import annotations

from .base import FamilyAdapter


class LlamaAdapter(FamilyAdapter):
    model_type = "llama"
    prefix = "Llama"


ADAPTER = LlamaAdapter
