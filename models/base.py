"""The adapter base: how one HF architecture family maps onto atb.

An adapter answers three questions about a loaded HF model of its family:

* ``spec(config)``: the shapes and options the fused path needs (`ModelSpec`; which biases and
  norms a layer has is read off its `LayerWeights`);
* ``layer_weights(model, i)`` / ``embed_tokens`` / ``final_norm`` / ``lm_head``:
  the HF parameter tensors themselves, never copies, so atb code that reads
  them sees every in-place update and costs no memory;
* ``module_roles``: which HF module classes play which atb role
  (``rms_norm``, ``attention``, ``mlp``, ``rotary``, ...), for patching and
  for :func:`atb.check_model`.

Family modules (``llama``, ``mistral``, ``qwen2``, ``qwen3``) subclass
`FamilyAdapter` and override only what differs. They are found through
``atb.registry.get_adapter``, which imports them lazily by name.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

# Rope types whose cos/sin depend only on the position (one table serves all
# calls) and "dynamic", whose frequencies depend on the longest position seen
# (atb mirrors HF's stateful update, see atb.layers.rotary).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str
    theta: float
    rotary_dim: int            # <= head_dim; the rest of each head passes through unrotated
    parameters: dict = field(hash=False, compare=False)  # config.rope_parameters as given
    max_position_embeddings: int = 0
    style: str = "neox"        # HF LLaMA-family layout: cos = cat(freqs, freqs).cos()


@dataclass(frozen=True)
class ModelSpec:
    """Everything the fused path needs to know about a model's shapes and options."""

    model_type: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rms_norm_eps: float
    sliding_windows: tuple      # per layer: None (full attention) or the window size
    hidden_act: str
    rope: RopeSpec


@dataclass
class LayerWeights:
    """One decoder layer's HF parameters (the Parameter objects, shared, not copied)."""

    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    post_attention_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The non-None entries by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def map(self, fn) -> "LayerWeights":
        """A new description with ``fn`` applied to every present entry (None stays None)."""
        return LayerWeights(**{f.name: None if getattr(self, f.name) is None else fn(getattr(self, f.name))
                               for f in fields(self)})


def _bias(linear) -> torch.Tensor | None:
    return linear.bias if getattr(linear, "bias", None) is not None else None


class FamilyAdapter:
    """Base adapter for LLaMA-style decoder-only models (HF ``*ForCausalLM``).

    Subclasses set ``model_type`` and ``prefix`` (the HF class-name prefix,
    e.g. ``"Llama"``) and override the hooks below where their family differs.
    """

    model_type: str = ""
    prefix: str = ""

    def __init__(self, config):
        if getattr(config, "model_type", None) != self.model_type:
            raise ValueError(f"{type(self).__name__} handles model_type '{self.model_type}', "
                             f"got '{getattr(config, 'model_type', None)}'")
        self.config = config
        self.spec = self.build_spec(config)

    # ---- shapes ---------------------------------------------------------------------------------
    def head_dim(self, config) -> int:
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def sliding_windows(self, config) -> tuple:
        return (None,) * config.num_hidden_layers

    def rope_spec(self, config) -> RopeSpec:
        params = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = params.get("rope_type", "default")
        head_dim = self.head_dim(config)
        if rope_type == "default":
            # HF's default rope for these families rotates the whole head
            # (LlamaRotaryEmbedding.compute_default_rope_parameters ignores partial_rotary_factor).
            rotary_dim = head_dim
        else:
            rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        return RopeSpec(rope_type=rope_type, theta=float(params.get("rope_theta", 10000.0)), rotary_dim=rotary_dim,
                        parameters=params, max_position_embeddings=int(config.max_position_embeddings))

    def build_spec(self, config) -> ModelSpec:
        num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return ModelSpec(
            model_type=self.model_type,
            num_layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=num_kv,
            head_dim=self.head_dim(config),
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            rms_norm_eps=float(config.rms_norm_eps),
            sliding_windows=tuple(self.sliding_windows(config)),
            hidden_act=str(getattr(config, "hidden_act", "silu")),
            rope=self.rope_spec(config),
        )

    # ---- module tree ----------------------------------------------------------------------------
    def decoder(self, model):
        """The bare decoder (``LlamaModel``) of a ``*ForCausalLM`` or of the bare model itself."""
        inner = getattr(model, "model", None)
        if inner is not None and hasattr(inner, "layers"):
            return inner
        if hasattr(model, "layers"):
            return model
        raise ValueError(f"{type(model).__name__}: no decoder with .layers found (expected model.model.layers)")

    def layers(self, model):
        return self.decoder(model).layers

    def attention_weights(self, attn) -> dict:
        """The attention module's parameters by `LayerWeights` field (q/k/v/o, biases, q/k norm)."""
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        return dict(q=attn.q_proj.weight, k=attn.k_proj.weight, v=attn.v_proj.weight, o=attn.o_proj.weight,
                    q_bias=_bias(attn.q_proj), k_bias=_bias(attn.k_proj), v_bias=_bias(attn.v_proj),
                    o_bias=_bias(attn.o_proj), q_norm=q_norm.weight if q_norm is not None else None,
                    k_norm=k_norm.weight if k_norm is not None else None)

    def mlp_weights(self, mlp) -> dict:
        """The MLP module's parameters by `LayerWeights` field (gate/up/down and biases)."""
        return dict(gate=mlp.gate_proj.weight, up=mlp.up_proj.weight, down=mlp.down_proj.weight,
                    gate_bias=_bias(mlp.gate_proj), up_bias=_bias(mlp.up_proj), down_bias=_bias(mlp.down_proj))

    def layer_weights_of(self, layer) -> LayerWeights:
        """One HF decoder layer module's parameters as a `LayerWeights` (the tensors themselves)."""
        return LayerWeights(input_norm=layer.input_layernorm.weight,
                            post_attention_norm=layer.post_attention_layernorm.weight,
                            **self.attention_weights(layer.self_attn), **self.mlp_weights(layer.mlp))

    def layer_weights(self, model, i: int) -> LayerWeights:
        return self.layer_weights_of(self.layers(model)[i])

    def embed_tokens(self, model) -> torch.Tensor:
        return self.decoder(model).embed_tokens.weight

    def final_norm(self, model) -> torch.Tensor:
        return self.decoder(model).norm.weight

    def lm_head(self, model) -> torch.Tensor:
        """The output projection weight (the embedding itself when tied)."""
        head = getattr(model, "lm_head", None)
        if head is None:
            raise ValueError(f"{type(model).__name__} has no lm_head (pass the *ForCausalLM model)")
        return head.weight

    def rotary(self, model):
        """The HF rotary-embedding module (computes cos/sin once per forward)."""
        return self.decoder(model).rotary_emb

    def module_roles(self) -> dict[str, str]:
        """HF class name -> atb role. Classes not listed run on the stock path."""
        p = self.prefix
        return {
            f"{p}RMSNorm": "rms_norm",
            f"{p}Attention": "attention",
            f"{p}MLP": "mlp",
            f"{p}RotaryEmbedding": "rotary",
            f"{p}DecoderLayer": "decoder_layer",
            f"{p}Model": "decoder",
            f"{p}ForCausalLM": "causal_lm",
            "Embedding": "embedding",
            "Linear": "linear",
        }

    # ---- what the fused path supports -----------------------------------------------------------
    def unsupported_reasons(self) -> dict[str, str]:
        """Role -> why this model's configuration keeps that role on the stock path."""
        s = self.spec
        out = {}
        if s.hidden_act not in ("silu", "swish"):
            out["mlp"] = f"hidden_act '{s.hidden_act}' (the fused MLP is SwiGLU: silu(gate) * up)"
        if s.rope.rope_type not in SUPPORTED_ROPE_TYPES:
            out["rope"] = (f"rope_type '{s.rope.rope_type}' (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        if s.num_heads % s.num_kv_heads:
            out["attention"] = f"num_heads {s.num_heads} is not a multiple of num_kv_heads {s.num_kv_heads}"
        return out
