"""nn.Modules over the fused kernels; they read HF parameters in place (no copies)."""
from atb.layers.attention import Attention, AttentionMetadata, hf_attention
from atb.layers.mlp import SwiGLUMLP
from atb.layers.norm import RMSNorm
from atb.layers.rotary import RotaryEmbedding

__all__ = ["Attention", "AttentionMetadata", "hf_attention", "SwiGLUMLP", "RMSNorm", "RotaryEmbedding"]
