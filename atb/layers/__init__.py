"""The Python executor: the decoder layer written once (``decoder``), the one routing point for projections
(``linear``), the HF-layout attention core (``attention``), rotary tables and the paged KV cache."""
from atb.layers.attention import hf_attention
from atb.layers.rotary import RotaryEmbedding

__all__ = ["hf_attention", "RotaryEmbedding"]
