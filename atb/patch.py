"""Accelerate a loaded HF model in place: ``patch_hf_model``, ``unpatch_hf_model``, ``check_model``.

How each part is hooked (in place: no parameter is copied or re-created, and
everything done is undone by ``unpatch_hf_model``):

* **Attention core** — transformers' own hooks: an ``"atb"`` function is
  registered with ``AttentionInterface`` (flash_attention for prefill,
  paged_attention over HF's ``DynamicCache`` for decode, see
  ``atb.layers.attention``) and an ``"atb"`` mask function with
  ``AttentionMaskInterface`` (it hands over the 2-D padding mask, or None when
  there is no padding, instead of materializing a 4-D mask every step); the
  model's ``attn_implementation`` is set to ``"atb"``. The KV cache stays
  HF's ``DynamicCache`` in HF's layout, so ``generate`` and every cache
  feature it uses (reordering, cropping, streamers) work unchanged, and a
  cache filled by the stock model can be continued by the patched one.
* **Rope** — HF applies rope inside the attention module's forward
  (``apply_rotary_pos_emb`` on ``[B, H, S, D]`` views, before the cache
  update), so it cannot be moved into the attention function. Each attention
  module's ``forward`` runs HF's exact sequence of steps (q/k/v projections,
  q/k norm, rope, cache update, attention interface, o_proj) with the
  engine's own layer code (``atb.layers.decoder``): rope is the fused
  ``atb.kernels.rope``, applied in place on the token-major projection outputs
  (which also saves the transposes HF makes). The model's rotary module
  gathers cos/sin from a table computed once (``atb.layers.RotaryEmbedding``,
  bit-identical rows); dynamic NTK keeps HF's rotary module, whose frequencies
  depend on the sequence length.
* **RMSNorm / MLP** — ``forward`` bound onto the fused kernels (``rms_norm``;
  the engine's SwiGLU MLP), reading the module's own Parameters.
* **Linear** — every projection (q/k/v in one launch, gate+up+silu*mul in one
  pass, o, down, LM head) goes through ``atb.layers.linear``, which asks
  ``atb.kernels.linear.native_linear_wins(rows, dtype, op)`` (the one routing
  policy) whether the native kernel or torch's GEMM runs.
* **Decoder layer** — a ``forward`` in HF's order whose residual adds are
  fused: the add after attention with the post-attention norm
  (``add_rms_norm``), and the add after the MLP with down_proj.

Forwards are bound as methods (Liger's way), so ``copy.deepcopy`` of a patched
model gives a patched copy computing with its own parameters. With autograd
recording (grad mode on and a parameter or input requiring grad) every patched
module runs its class's stock forward, and the ``"atb"`` attention function
falls back to SDPA, so training and fine-tuning get correct gradients; the
kernels themselves have no backward and refuse inputs that require grad.

The model loop and the embedding stay on the stock path; the report lists every
module and says why.
"""
from __future__ import annotations

import sys
import types
import warnings
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import torch

from atb import kernels
from atb.hugepages import move_parameters_to_huge_pages
from atb.layers import decoder
from atb.layers.attention import hf_attention
from atb.layers.decoder import AttentionShape
from atb.layers.linear import ROUTE_POLICY, ROUTE_TORCH, linear
from atb.layers.rotary import RotaryEmbedding, SUPPORTED as ROPE_SUPPORTED
from atb.quant.formats import QuantizedWeight
from atb.registry import get_adapter, supported_model_types

ATTN_NAME = "atb"
# How the report words the routing of projections (the one routing policy decides it).
_LINEAR_ROUTE = "where atb.kernels.linear.native_linear_wins(rows, dtype, op), else torch's GEMM"
# Oldest transformers this module is written and tested against (rope_parameters, the `cache` argument name,
# AttentionMaskInterface signatures) and the newest tested.
MIN_TRANSFORMERS = (5, 24)
NEWEST_TESTED = (5, 25)

_STATE_ATTR = "_atb_patch_state"


def _version_tuple(v: str) -> tuple[int, int]:
    parts = []
    for p in v.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)  # type: ignore[return-value]


def check_transformers_version() -> str:
    """Raises below the oldest supported transformers, warns above the newest tested; returns the version."""
    import transformers

    version = transformers.__version__
    vt = _version_tuple(version)
    if vt < MIN_TRANSFORMERS:
        raise RuntimeError(f"atb.patch_hf_model needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))}, "
                           f"found {version}")
    if vt > NEWEST_TESTED:
        warnings.warn(f"atb.patch_hf_model was tested up to transformers {'.'.join(map(str, NEWEST_TESTED))}.x; "
                      f"found {version}. Check the result with atb.check_model and a greedy comparison.",
                      stacklevel=3)
    return version


# ---- the report ------------------------------------------------------------------------------------------------
@dataclass
class ModuleStatus:
    name: str          # qualified module name ("model.layers.0.mlp")
    cls: str           # HF class name
    role: str          # atb role, or "" when the class has none
    status: str        # "fused", "stock" or "unsupported"
    detail: str        # what runs (fused) or why it stays stock / is unsupported


@dataclass
class PatchReport:
    """What ``patch_hf_model`` replaced and what stayed stock, and why (``print(report)`` for a table)."""

    model_class: str
    model_type: str
    dtype: str
    transformers_version: str
    patched: bool                       # False for check_model (nothing changed)
    options: dict
    modules: list = field(default_factory=list)   # ModuleStatus for every module of the model
    attn_implementation: tuple = ("", "")         # (before, after)
    cache: str = ""
    notes: list = field(default_factory=list)

    def by_class(self) -> list[tuple[str, str, str, int, str]]:
        """(class, role, status, count, detail) rows, one per distinct (class, status, detail)."""
        rows: dict = {}
        for m in self.modules:
            key = (m.cls, m.role, m.status, m.detail)
            rows[key] = rows.get(key, 0) + 1
        return [(c, r, s, n, d) for (c, r, s, d), n in rows.items()]

    def names(self, status: str) -> list[str]:
        return [m.name for m in self.modules if m.status == status]

    @property
    def fused(self) -> list[str]:
        return self.names("fused")

    @property
    def stock(self) -> list[str]:
        return self.names("stock")

    @property
    def unsupported(self) -> list[str]:
        return self.names("unsupported")

    @property
    def supported(self) -> bool:
        return not self.unsupported

    def status_of(self, cls: str) -> set[str]:
        return {m.status for m in self.modules if m.cls == cls}

    def __str__(self) -> str:
        head = "atb.patch_hf_model" if self.patched else "atb.check_model"
        lines = [f"{head}: {self.model_class} (model_type={self.model_type}, {self.dtype}), "
                 f"transformers {self.transformers_version}"]
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        lines.append(f"  options: {opts}")
        if self.attn_implementation[0]:
            lines.append(f"  attn_implementation: {self.attn_implementation[0]} -> {self.attn_implementation[1]}")
        if self.cache:
            lines.append(f"  KV cache: {self.cache}")
        rows = self.by_class()
        w_cls = max([len(r[0]) for r in rows] + [12])
        lines.append(f"  {'module type':<{w_cls}}  {'count':>5}  {'path':<11}  detail")
        order = {"fused": 0, "stock": 1, "unsupported": 2}
        for c, _r, s, n, d in sorted(rows, key=lambda r: (order[r[2]], r[0])):
            lines.append(f"  {c:<{w_cls}}  {n:>5}  {s:<11}  {d}")
        counts = {s: len(self.names(s)) for s in ("fused", "stock", "unsupported")}
        lines.append(f"  modules: {counts['fused']} fused, {counts['stock']} stock, {counts['unsupported']} unsupported")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    __repr__ = __str__


# ---- the fused forwards ----------------------------------------------------------------------------------------
# Liger-style: each is a plain function bound to its module as a method (``types.MethodType``), reading the
# module's own parameters at call time through the family adapter. So ``copy.deepcopy`` of a patched model
# rebinds the methods to the copy (the copy computes with its own parameters) and nothing holds a stale
# reference. The projections, q/k norm and rope are the engine's layer code (``atb.layers.decoder``).
@dataclass(frozen=True)
class _Conf:
    """What a patched module needs besides its parameters (kept in the module's ``__dict__``)."""

    adapter: object
    soc_type: str | None
    route: str                        # how projections pick a kernel: policy, or torch with ``linear=False``
    shape: AttentionShape | None = None
    layer_idx: int = 0
    window: int | None = None
    mlp_fused: bool = False           # decoder layer: the MLP runs the fused SwiGLU
    # patch_hf_model(quantize=...): quantized copies by LayerWeights field name ("q", ..., "down"; "weight" for a
    # plain linear / embedding module), read in place of the module's parameters.
    quant: dict = field(default_factory=dict)


_CONF = "_atb_conf"


def _grad_needed(module, args, kwargs) -> bool:
    """Autograd would record this call: grad mode on and a parameter or tensor input requires grad."""
    if not torch.is_grad_enabled():
        return False
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            return True
    return any(p.requires_grad for p in module.parameters())


def _or_stock(fused):
    """The module's forward: ``fused`` for inference, the class's stock forward when gradients are needed
    (the kernels have no backward)."""
    def forward(self, *args, **kwargs):
        if _grad_needed(self, args, kwargs):
            return type(self).forward(self, *args, **kwargs)
        return fused(self, *args, **kwargs)
    forward.__name__ = forward.__qualname__ = f"atb_{fused.__name__.lstrip('_')}"
    return forward


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


@_or_stock
def _norm(self, hidden_states):
    return kernels.rms_norm(hidden_states, self.weight, float(self.variance_epsilon),
                            soc_type=self.__dict__[_CONF].soc_type)


@_or_stock
def _mlp(self, x):
    c = self.__dict__[_CONF]
    w = SimpleNamespace(**{**c.adapter.mlp_weights(self), **c.quant})
    return decoder.mlp(_rows(x), w, soc_type=c.soc_type, route=c.route).view(*x.shape[:-1], -1)


@_or_stock
def _attention(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, past_key_values=None,
               **kwargs):
    """HF's attention steps (q/k/v, q/k norm, rope, cache update, attention interface, o_proj) with the engine's
    projections and rope applied in place on the token-major projection outputs."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    c = self.__dict__[_CONF]
    if cache is None:
        cache = past_key_values
    B, S, _ = hidden_states.shape
    H, KH, D = c.shape.num_heads, c.shape.num_kv_heads, c.shape.head_dim
    w = SimpleNamespace(**{**c.adapter.attention_weights(self), **c.quant})
    cos, sin = position_embeddings
    if cos.shape[0] != B:
        cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)
    q, k, v = decoder.qkv_rope(_rows(hidden_states), w, c.shape, cos.reshape(B * S, -1), sin.reshape(B * S, -1),
                               soc_type=c.soc_type, route=c.route)
    q = q.view(B, S, H, D).transpose(1, 2)
    k = k.view(B, S, KH, D).transpose(1, 2)
    v = v.view(B, S, KH, D).transpose(1, 2)
    if cache is not None:
        k, v = cache.update(k, v, c.layer_idx, kwargs=kwargs)
    eager = getattr(sys.modules[type(self).__module__], "eager_attention_forward")
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
    out, weights = attend(self, q, k, v, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
                          scaling=self.scaling, sliding_window=c.window, **kwargs)
    out = decoder.o_proj(out.reshape(B * S, -1), w, soc_type=c.soc_type, route=c.route)
    return out.view(B, S, -1), weights


@_or_stock
def _decoder_layer(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                   position_embeddings=None, past_key_values=None, **kwargs):
    """HF's decoder layer with its residual adds fused: ``add_rms_norm`` for the add after attention and the
    post-attention norm, and (fused MLP) the add after the MLP into down_proj. The same roundings as HF's
    separate adds; attention runs through its own (patched) module, so every other hook keeps working."""
    c = self.__dict__[_CONF]
    if cache is None:
        cache = past_key_values
    attn_out, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                 position_ids=position_ids, cache=cache, use_cache=use_cache,
                                 position_embeddings=position_embeddings, **kwargs)
    ln2 = self.post_attention_layernorm
    normed, residual = kernels.add_rms_norm(attn_out, hidden_states, ln2.weight, float(ln2.variance_epsilon),
                                            soc_type=c.soc_type)
    if not c.mlp_fused:
        return residual + self.mlp(normed)
    w = SimpleNamespace(**{**c.adapter.mlp_weights(self.mlp), **c.quant})
    return decoder.mlp(_rows(normed), w, _rows(residual), soc_type=c.soc_type, route=c.route).view(residual.shape)


@_or_stock
def _lm_head(self, x):
    c = self.__dict__[_CONF]
    w = c.quant.get("weight", self.weight)
    return linear(_rows(x), w, self.bias, soc_type=c.soc_type, route=c.route).view(*x.shape[:-1], -1)


@_or_stock
def _quant_linear(self, x):
    """A projection module on its quantized copy (any path that calls the module itself)."""
    c = self.__dict__[_CONF]
    return linear(_rows(x), c.quant["weight"], self.bias, soc_type=c.soc_type).view(*x.shape[:-1], -1)


@_or_stock
def _quant_embedding(self, ids):
    """The embedding lookup in a quantized table: each token's row dequantized natively."""
    c = self.__dict__[_CONF]
    return c.quant["weight"].rows(ids, self.weight.dtype, soc_type=c.soc_type)


@_or_stock
def _rotary(self, x, position_ids, layer_type=None):
    """cos/sin rows gathered from a table computed once (bit-identical to HF's)."""
    return self.__dict__["_atb_rope_table"].cos_sin(position_ids, x.dtype)


# ---- the transformers hooks -------------------------------------------------------------------------------------
def atb_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                          position_ids=None, **kwargs):
    """The ``"atb"`` AttentionInterface function (HF layout in, ``[B, S, H, D]`` out, no attention weights)."""
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return _sdpa_fallback(module, query, key, value, attention_mask, scaling, dropout, sliding_window)
    if dropout:
        raise ValueError("atb attention: dropout is not supported (the patched model is for inference; "
                         "call model.eval())")
    out = hf_attention(query, key, value, padding_mask=attention_mask, scale=scaling, window=sliding_window or None,
                       position_ids=position_ids, soc_type=getattr(module, "_atb_soc_type", None))
    return out, None


def _sdpa_fallback(module, query, key, value, padding_mask, scaling, dropout, window):
    """HF's SDPA attention with the causal / window / padding mask the kernels would apply (autograd path)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    S, L = query.shape[2], key.shape[2]
    mask = None
    if padding_mask is not None or window or S != L:
        i = torch.arange(L - S, L).view(S, 1)
        j = torch.arange(L).view(1, L)
        allowed = j <= i
        if window:
            allowed = allowed & (j > i - window)
        mask = allowed.view(1, 1, S, L)
        if padding_mask is not None:
            mask = mask & padding_mask.bool()[:, None, None, :]
        # A query that sees no key (a padding row) would give NaN; its output is never used.
        mask = mask | ~mask.any(-1, keepdim=True)
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling)


def atb_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
             use_vmap=False, **kwargs):
    """The ``"atb"`` AttentionMaskInterface function: the 2-D padding mask (bool ``[B, kv_len]``), or None.

    Causality and sliding windows are applied by the kernels themselves, so only padding needs a mask.
    Mask overlays (``or_mask_function``/``and_mask_function``, which HF signals with ``use_vmap``) cannot be
    expressed that way and are refused.
    """
    if use_vmap:
        raise ValueError("atb attention: custom mask overlays (or/and mask functions) are not supported; "
                         "patch with attention=False for this model")
    from transformers.masking_utils import causal_mask_function

    if mask_function is causal_mask_function and int(q_offset) + q_length != kv_length:
        # A preallocated cache (StaticCache) hands attention its whole buffer, unwritten slots included.
        raise ValueError(f"atb attention: the cache holds {kv_length} key slots for {int(q_offset) + q_length} "
                         "tokens; only caches that grow with the sequence (DynamicCache, the generate default) "
                         "are supported (patch with attention=False for static caches)")
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def _register_hooks() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, atb_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, atb_mask)


# ---- planning: one function decides, patch applies, check only reports -----------------------------------------
_OPTION_OF_ROLE = {"rms_norm": "rms_norm", "mlp": "mlp", "rotary": "rope"}
_ROPE_TABLE_TYPES = tuple(t for t in ROPE_SUPPORTED if t != "dynamic")


def _plan(model, adapter, options: dict) -> list[ModuleStatus]:
    spec = adapter.spec
    roles = adapter.module_roles()
    config_reasons = adapter.unsupported_reasons()
    rope_type = spec.rope.rope_type
    rope_fused = options["rope"] and "rope" not in config_reasons
    attn_bits = []
    if rope_fused:
        attn_bits.append("rope: atb.kernels.rope in place on q/k")
    if options["attention"] and "attention" not in config_reasons:
        attn_bits.append("attention: 'atb' AttentionInterface (flash_attention prefill, paged_attention decode)")
    out = []
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        role = roles.get(cls, "")
        status, detail = "stock", ""
        if role == "rms_norm":
            if not options["rms_norm"]:
                detail = "rms_norm=False"
            else:
                status, detail = "fused", "atb.kernels.rms_norm on the module's weight"
        elif role == "mlp":
            if "mlp" in config_reasons:
                detail = config_reasons["mlp"]
            elif not options["mlp"]:
                detail = "mlp=False"
            else:
                status, detail = "fused", ("SwiGLU of atb.layers.decoder: gate+up+silu*mul as atb.kernels.linear_swiglu "
                                           f"(silu_mul after torch's GEMM otherwise) and down, {_LINEAR_ROUTE}")
        elif role == "attention":
            if attn_bits:
                status = "fused"
                detail = "; ".join(attn_bits)
                if not (options["rope"] and "rope" not in config_reasons):
                    detail += "; rope: stock apply_rotary_pos_emb (" + config_reasons.get("rope", "rope=False") + ")"
                if not (options["attention"] and "attention" not in config_reasons):
                    detail += "; attention core: stock (" + config_reasons.get("attention", "attention=False") + ")"
            else:
                detail = "rope=False, attention=False" if not config_reasons else "; ".join(config_reasons.values())
        elif role == "rotary":
            if not options["rope"]:
                detail = "rope=False"
            elif "rope" in config_reasons:
                detail = config_reasons["rope"]
            elif rope_type not in _ROPE_TABLE_TYPES:
                detail = (f"rope_type '{rope_type}': HF recomputes frequencies from the sequence length; its cos/sin "
                          "feed the fused rope kernel")
            else:
                status, detail = "fused", f"cos/sin gathered from a table computed once ({rope_type} rope)"
        elif role == "decoder_layer":
            if options["rms_norm"]:
                status, detail = "fused", ("HF layer order; residual add + post-attention norm as "
                                           "atb.kernels.add_rms_norm")
                if _mlp_native(options, config_reasons):
                    detail += "; down_proj + residual add as atb.kernels.linear_residual " + _LINEAR_ROUTE
            else:
                detail = "HF layer structure and residual adds kept (rms_norm=False)"
        elif role in ("decoder", "causal_lm"):
            detail = "HF model loop, masks, cache handling and generate() kept"
        elif name == "lm_head":
            if options["linear"]:
                status, detail = "fused", f"atb.kernels.linear {_LINEAR_ROUTE}"
            else:
                detail = "linear=False"
        elif role == "linear":
            parent = name.rsplit(".", 1)[0]
            parent_role = roles.get(type(model.get_submodule(parent)).__name__, "")
            if parent_role == "attention" and options["linear"] and rope_fused:
                status, detail = "fused", ("weight read by the fused attention forward: atb.kernels.linear_multi "
                                           f"(q/k/v) / linear (o) {_LINEAR_ROUTE}")
            elif parent_role == "mlp" and _mlp_native(options, config_reasons):
                status, detail = "fused", ("weight read by the fused MLP: atb.kernels.linear_swiglu (gate+up) / "
                                           f"linear (down) {_LINEAR_ROUTE}")
            else:
                detail = "torch F.linear on the HF weight (no copy)"
        elif role == "embedding":
            detail = "torch embedding lookup"
        elif cls == "ModuleList":
            detail = "container"
        elif name.endswith("act_fn"):
            if _mlp_fused(options, config_reasons):
                status, detail = "fused", "folded into the fused MLP (silu_mul)"
            else:
                detail = "stock activation"
        else:
            detail = "no atb equivalent"
        out.append(ModuleStatus(name or "(root)", cls, role, status, detail))
    return out


def _mlp_fused(options, config_reasons) -> bool:
    return options["mlp"] and "mlp" not in config_reasons


def _mlp_native(options, config_reasons) -> bool:
    """The MLP's projections may run on the native linear kernels (fused MLP, linear=True)."""
    return _mlp_fused(options, config_reasons) and options["linear"]


def _dtype_name(model) -> str:
    p = next(model.parameters(), None)
    return str(p.dtype).replace("torch.", "") if p is not None else "?"


_DEFAULT_OPTIONS = dict(rms_norm=True, rope=True, attention=True, mlp=True, linear=True)


def check_model(model) -> PatchReport:
    """Which module types would run fused, stock or unsupported under ``patch_hf_model`` — nothing is changed.

    An unsupported family is reported (every module ``unsupported``) rather than raised.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"check_model: model must be a torch.nn.Module (a loaded HF model), got {type(model).__name__}")
    import transformers

    options = dict(_DEFAULT_OPTIONS)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", "?")
    report = PatchReport(type(model).__name__, model_type, _dtype_name(model), transformers.__version__, False, options)
    try:
        adapter = get_adapter(model)
    except ValueError:
        report.modules = [ModuleStatus(n or "(root)", type(m).__name__, "", "unsupported",
                                       f"model_type '{model_type}' has no atb adapter "
                                       f"(supported: {', '.join(supported_model_types())})")
                          for n, m in model.named_modules()]
        return report
    report.modules = _plan(model, adapter, options)
    if _version_tuple(transformers.__version__) < MIN_TRANSFORMERS:
        report.notes.append(f"transformers {transformers.__version__} is below the supported "
                            f"{'.'.join(map(str, MIN_TRANSFORMERS))}: patch_hf_model will refuse it")
    state = getattr(model, _STATE_ATTR, None)
    if state is not None:
        report.notes.append("this model is currently patched")
    return report


# ---- patch / unpatch --------------------------------------------------------------------------------------------
@dataclass
class _PatchState:
    options: dict
    report: PatchReport
    forwards: list            # (module, had_instance_forward, previous instance forward)
    attn_before: str | None
    attn_set: bool
    # quantize=: (parameter, its quantized copy) for every float weight released at patch time
    released: list = field(default_factory=list)


_PROJECTIONS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def _quant_of(adapter, model, quantized) -> dict:
    """id(module) -> its quantized weights by field: attention / MLP / decoder-layer modules get their
    projections, each projection Linear, the embedding and the LM head their own (``"weight"``)."""
    out = {}
    for layer, lw in zip(adapter.layers(model), quantized.layers):
        q = {f: getattr(lw, f) for f in _PROJECTIONS if isinstance(getattr(lw, f), QuantizedWeight)}
        out[id(layer.self_attn)] = {f: q[f] for f in ("q", "k", "v", "o") if f in q}
        out[id(layer.mlp)] = out[id(layer)] = {f: q[f] for f in ("gate", "up", "down") if f in q}
        for f, path in _PROJECTIONS.items():
            if f in q:
                out[id(layer.get_submodule(path))] = {"weight": q[f]}
    for mod, w in ((model.get_input_embeddings(), quantized.embed), (model.get_output_embeddings(), quantized.lm_head)):
        if mod is not None and isinstance(w, QuantizedWeight):
            out[id(mod)] = {"weight": w}
    return out


def patch_hf_model(model, *, soc_type: str | None = None, rms_norm: bool = True, rope: bool = True,
                   attention: bool = True, mlp: bool = True, linear: bool = True, quantize=None) -> PatchReport:
    """Accelerates a loaded HF LLaMA-family model in place; returns a `PatchReport`.

    The model keeps its parameters (the same Parameter objects and values; their storage moves once into 2 MiB
    transparent huge pages, where the decode GEMVs stream them faster, and the old storage is freed:
    `atb.hugepages`) and its ``generate``; patching again
    with the same options changes nothing, with other options re-patches. ``unpatch_hf_model`` undoes it.
    Raises ValueError for an unsupported ``model_type`` (naming the supported ones).

    Options (each part can be left on the stock path): ``rms_norm``, ``rope`` (fused rope + the patched
    attention forward), ``attention`` (the "atb" attention function), ``mlp`` (SwiGLU with silu_mul),
    ``linear`` (projections and the LM head through ``atb.kernels.linear*`` where ``native_linear_wins``:
    decode sizes, and prefill in fp16/bf16; fp32 prefill stays on torch's GEMM). ``soc_type`` is the SoC every kernel tiles for.
    ``quantize`` (``"w8a16"``, ``"w4a16[-gN]"``, ``"native"`` or an ``atb.quantize(model)`` result, as for
    ``TransformerInfer``): every projection, the embedding and the LM head run on quantized copies of their
    weights through the native kernels (fewer bytes per token), and their float parameters are released
    (each becomes an empty tensor of its dtype), so the model's memory shrinks to the quantized size.
    Gradients through those weights are then unavailable (a forward recording autograd raises), and
    ``unpatch_hf_model`` restores them dequantized from the quantized copies (quantization is lossy:
    they are not the original values).
    """
    version = check_transformers_version()
    options = dict(rms_norm=bool(rms_norm), rope=bool(rope), attention=bool(attention), mlp=bool(mlp),
                   linear=bool(linear))
    adapter = get_adapter(model)   # ValueError for other families
    if soc_type is not None:
        from atb.soc import get_soc

        get_soc(soc_type)          # validate the name now, not at the first forward
    all_options = dict(options, soc_type=soc_type, quantize=quantize)
    state = getattr(model, _STATE_ATTR, None)
    if state is not None:
        if state.options == all_options:
            return state.report
        unpatch_hf_model(model)

    spec = adapter.spec
    plan = _plan(model, adapter, options)
    status = {m.name: m for m in plan}
    modules = dict(model.named_modules())
    forwards = []

    from atb.quant.engine import resolve

    quantized = resolve(model, quantize)
    quant = {} if quantized is None else _quant_of(adapter, model, quantized)
    if quantized is None:
        move_parameters_to_huge_pages(model)

    def rebind(mod, fused, conf):
        if id(mod) in quant:
            conf = replace(conf, quant=quant[id(mod)])
        had = "forward" in mod.__dict__
        forwards.append((mod, had, mod.__dict__.get("forward")))
        mod.__dict__[_CONF] = conf
        mod.forward = types.MethodType(fused, mod)

    config_reasons = adapter.unsupported_reasons()
    rope_fused = options["rope"] and "rope" not in config_reasons
    attn_fused = options["attention"] and "attention" not in config_reasons
    layer_of = {id(layer.self_attn): i for i, layer in enumerate(adapter.layers(model))}
    base = _Conf(adapter, soc_type, ROUTE_POLICY if options["linear"] else ROUTE_TORCH)
    try:
        for name, st in status.items():
            if st.status != "fused":
                continue
            mod = modules[name if name != "(root)" else ""]
            if st.role == "rms_norm":
                rebind(mod, _norm, base)
            elif st.role == "mlp":
                rebind(mod, _mlp, base)
            elif name == "lm_head":
                rebind(mod, _lm_head, base)
            elif st.role == "rotary":
                mod.__dict__["_atb_rope_table"] = RotaryEmbedding.from_hf(mod)
                rebind(mod, _rotary, base)
            elif st.role == "decoder_layer":
                rebind(mod, _decoder_layer, replace(base, mlp_fused=_mlp_fused(options, config_reasons)))
            elif st.role == "attention":
                mod._atb_soc_type = soc_type
                if rope_fused:
                    i = layer_of[id(mod)]
                    scale = float(getattr(mod, "scaling", spec.head_dim ** -0.5))
                    rebind(mod, _attention, replace(base, shape=AttentionShape.from_spec(spec, scale), layer_idx=i,
                                                    window=spec.sliding_windows[i]))
        if quantized is not None:
            # Every module holding a quantized copy that the plan left on its stock forward (projection Linears,
            # the embedding, an unfused LM head) runs on the copy too.
            rebound = {id(m) for m, _, _ in forwards}
            for mod in model.modules():
                if id(mod) in quant and "weight" in quant[id(mod)] and id(mod) not in rebound:
                    rebind(mod, _quant_embedding if isinstance(mod, torch.nn.Embedding) else _quant_linear, base)
        attn_before = model.config._attn_implementation
        attn_set = False
        if attn_fused:
            _register_hooks()
            model.set_attn_implementation(ATTN_NAME)
            attn_set = True
    except Exception:
        _restore(model, forwards, None, False)
        raise
    released = [] if quantized is None else _release_float_weights(model, quant)

    report = PatchReport(type(model).__name__, spec.model_type, _dtype_name(model), version, True, all_options,
                         plan, (attn_before, model.config._attn_implementation),
                         "HF DynamicCache (created by generate), contiguous [B, KH, L, D]; with attention=True decode "
                         "reads it in place through paged_attention")
    report.notes.append("with autograd recording (grad mode on and a parameter or input requiring grad) every patched "
                        "module runs its stock forward, so gradients are exact; inference (torch.no_grad, "
                        "inference_mode, generate) runs fused")
    if quantized is not None:
        report.notes.append(f"quantized ({quantize if isinstance(quantize, str) else 'custom'}): every projection, "
                            "the embedding and the LM head read their quantized copies; their float parameters "
                            "were released (unpatch_hf_model restores them dequantized)")
    if config_reasons:
        report.notes.append("partial patch: " + "; ".join(f"{k} stays stock: {v}" for k, v in config_reasons.items()))
    setattr(model, _STATE_ATTR, _PatchState(all_options, report, forwards, attn_before, attn_set, released))
    return report


def _release_float_weights(model, quant) -> list:
    """Empties the float ``weight`` of every module reading a quantized copy (a tied table once) so its
    storage is freed; returns (parameter, quantized copy) pairs for ``unpatch_hf_model``."""
    released, seen = [], set()
    for mod in model.modules():
        w = quant.get(id(mod), {}).get("weight")
        p = getattr(mod, "weight", None)
        if isinstance(w, QuantizedWeight) and isinstance(p, torch.Tensor) and id(p) not in seen:
            seen.add(id(p))
            released.append((p, w))
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    _return_freed_memory()
    return released


def _return_freed_memory() -> None:
    """glibc keeps freed heap pages (the released weights, quantization's temporaries) for reuse, so the
    process's RSS would not show the bytes saved: hand them back to the OS (a no-op elsewhere)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _restore(model, forwards, attn_before, attn_set) -> None:
    for mod, had, previous in reversed(forwards):
        if had:
            mod.forward = previous
        else:
            mod.__dict__.pop("forward", None)
    for mod in model.modules():
        for key in ("_atb_soc_type", _CONF, "_atb_rope_table"):
            mod.__dict__.pop(key, None)
    if attn_set:
        model.set_attn_implementation(attn_before)


def unpatch_hf_model(model) -> bool:
    """Restores the stock forwards and attention implementation; returns False if the model was not patched."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        return False
    _restore(model, state.forwards, state.attn_before, state.attn_set)
    for p, w in state.released:
        p.data = w.dequantize(p.dtype)
    del model.__dict__[_STATE_ATTR]
    return True


def is_patched(model) -> bool:
    return getattr(model, _STATE_ATTR, None) is not None
