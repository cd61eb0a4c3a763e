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
  module gets a per-instance ``forward`` with HF's exact sequence of steps
  (q/k/v projections, q/k norm, rope, cache update, attention interface,
  o_proj) in which rope is the fused ``atb.kernels.rope``, applied in place on
  the token-major projection outputs (which also saves the transposes HF
  makes). The model's rotary module gathers cos/sin from a table computed once
  (``atb.layers.RotaryEmbedding``, bit-identical rows); dynamic NTK keeps
  HF's rotary module, whose frequencies depend on the sequence length.
* **RMSNorm / MLP** — per-instance ``forward`` rebinding onto the fused
  kernels (``rms_norm``; ``silu_mul`` between the gate/up and down
  projections), reading the module's own Parameters.
* **Linear** — projections read the HF weights through
  ``atb.kernels.linear_multi`` (q/k/v in one launch), ``linear_swiglu``
  (gate+up+silu*mul in one pass) and ``linear`` (o, down, LM head) wherever
  ``native_linear_wins``: decode sizes (fewer than 32 rows) and, in fp16/bf16,
  prefill too (the native GEMM is 4-6x torch's there); fp32 prefill stays on
  torch's GEMM, which wins in fp32.

* **Decoder layer** — a per-instance ``forward`` in HF's order whose residual
  adds are fused: the add after attention with the post-attention norm
  (``add_rms_norm``), and at decode sizes the add after the MLP with down_proj
  (``linear_residual``).

The model loop and the embedding stay on the stock path; the report lists every
module and says why.
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from atb import kernels
from atb.kernels.linear import LINEAR_CROSSOVER_M, native_linear_wins
from atb.layers.attention import hf_attention
from atb.layers.rotary import RotaryEmbedding, SUPPORTED as ROPE_SUPPORTED
from atb.quant.formats import QuantizedWeight
from atb.registry import get_adapter, supported_model_types

ATTN_NAME = "atb"
# How the report words the routing of projections (native_linear_wins decides it).
_LINEAR_ROUTE = (f"below {LINEAR_CROSSOVER_M} rows and at every size in fp16/bf16; torch GEMM for fp32 prefill")
# Oldest transformers this module is written and tested against (rope_parameters, the `cache` argument name,
# AttentionMaskInterface signatures) and the newest tested.
MIN_TRANSFORMERS = (5, 24)
NEWEST_TESTED = (5, 24)

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


# ---- the fused forwards (closures over the module's own parameters; lean per-call path) -------------------------
# With patch_hf_model(quantize=...), a projection module carries its quantized weight as ``_atb_qweight``; the
# forwards below read it in place of ``weight``, and route it to the native kernels at every size.
_QWEIGHT_ATTR = "_atb_qweight"


def _weight(mod):
    q = mod.__dict__.get(_QWEIGHT_ATTR)
    return mod.weight if q is None else q


def _wins(rows: int, dtype, w) -> bool:
    return isinstance(w, QuantizedWeight) or native_linear_wins(rows, dtype)


def _flinear(x, w, b=None):
    """``F.linear``, or for a quantized weight the native kernel (it has no torch path)."""
    return kernels.linear_auto(x, w, b) if isinstance(w, QuantizedWeight) else F.linear(x, w, b)


def _quant_linear_forward(mod, soc_type):
    w, b = mod.__dict__[_QWEIGHT_ATTR], mod.bias
    linear_auto = kernels.linear_auto

    def forward(x):
        return linear_auto(x, w, b, soc_type=soc_type)
    return forward


def _quant_embedding_forward(mod, soc_type):
    w = mod.__dict__[_QWEIGHT_ATTR]
    dtype = mod.weight.dtype

    def forward(ids):
        return w.rows(ids, dtype, soc_type=soc_type)  # each token's row dequantized
    return forward

def _norm_forward(module, soc_type):
    weight, eps = module.weight, float(module.variance_epsilon)
    rms_norm = kernels.rms_norm

    def forward(hidden_states):
        return rms_norm(hidden_states, weight, eps, soc_type=soc_type)
    return forward


def _mlp_forward(module, soc_type, use_linear):
    g, u, d = module.gate_proj, module.up_proj, module.down_proj
    gw, gb, uw, ub, dw, db = _weight(g), g.bias, _weight(u), u.bias, _weight(d), d.bias
    silu_mul, linear = kernels.silu_mul, _flinear
    linear_swiglu, atb_linear = kernels.linear_swiglu, kernels.linear

    def forward(x):
        if use_linear and gb is None and ub is None:
            rows = x.numel() // x.shape[-1]
            if _wins(rows, x.dtype, gw):
                # One pass over gate and up with silu(gate) * up fused in, then down.
                h = linear_swiglu(x.reshape(rows, -1), gw, uw, soc_type=soc_type)
                return atb_linear(h, dw, db, soc_type=soc_type).view(*x.shape[:-1], -1)
        return linear(silu_mul(linear(x, gw, gb), linear(x, uw, ub), soc_type=soc_type), dw, db)
    return forward


def _attention_forward(module, spec, layer_idx, soc_type, use_linear):
    H, KH, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    qp, kp, vp, op = module.q_proj, module.k_proj, module.v_proj, module.o_proj
    qw, qb, kw, kb, vw, vb, ow, ob = (_weight(qp), qp.bias, _weight(kp), kp.bias, _weight(vp), vp.bias, _weight(op),
                                      op.bias)
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    window = spec.sliding_windows[layer_idx]
    config, scaling, attn_dropout = module.config, module.scaling, module.attention_dropout
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward")
    rope, linear = kernels.rope, _flinear
    linear_multi, atb_linear = kernels.linear_multi, kernels.linear
    # q/k/v in one launch needs all three float or all three quantized (a GGUF file may mix).
    same_kind = len({isinstance(w, QuantizedWeight) for w in (qw, kw, vw)}) == 1

    def forward(hidden_states, position_embeddings=None, attention_mask=None, cache=None, past_key_values=None,
                **kwargs):
        if cache is None:
            cache = past_key_values
        B, S, hidden = hidden_states.shape
        fast = use_linear and same_kind and _wins(B * S, hidden_states.dtype, qw)
        if fast:
            # q/k/v in one launch over the three weights.
            q, k, v = linear_multi(hidden_states.reshape(B * S, hidden), (qw, kw, vw), (qb, kb, vb),
                                   soc_type=soc_type)
        else:
            q, k, v = linear(hidden_states, qw, qb), linear(hidden_states, kw, kb), linear(hidden_states, vw, vb)
        q, k, v = q.view(B * S, H, D), k.view(B * S, KH, D), v.view(B, S, KH, D)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        cos, sin = position_embeddings
        if cos.shape[0] != B:
            cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)
        rope(q, k, cos.reshape(B * S, -1), sin.reshape(B * S, -1), inplace=True, soc_type=soc_type)
        q = q.view(B, S, H, D).transpose(1, 2)
        k = k.view(B, S, KH, D).transpose(1, 2)
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, layer_idx, kwargs=kwargs)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager)
        out, weights = attend(module, q, k, v, attention_mask, dropout=attn_dropout if module.training else 0.0,
                              scaling=scaling, sliding_window=window, **kwargs)
        if fast or isinstance(ow, QuantizedWeight):
            return atb_linear(out.reshape(B * S, -1), ow, ob, soc_type=soc_type).view(B, S, -1), weights
        return linear(out.reshape(B, S, -1), ow, ob), weights
    return forward


def _decoder_layer_forward(layer, soc_type, mlp_native: bool):
    """HF's decoder layer with its residual adds fused: ``add_rms_norm`` for the add after attention and the
    post-attention norm, and (decode sizes, fused MLP) ``linear_residual`` for down_proj plus the add after
    the MLP. The same roundings as HF's separate adds; attention and MLP run through their own (patched)
    modules otherwise, so every other hook keeps working."""
    attn, mlp, ln1, ln2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
    w2, eps2 = ln2.weight, float(ln2.variance_epsilon)
    gw, uw, dw, db = _weight(mlp.gate_proj), _weight(mlp.up_proj), _weight(mlp.down_proj), mlp.down_proj.bias
    same_kind = isinstance(gw, QuantizedWeight) == isinstance(uw, QuantizedWeight) == isinstance(dw, QuantizedWeight)
    add_rms_norm, linear_swiglu, linear_residual = kernels.add_rms_norm, kernels.linear_swiglu, kernels.linear_residual

    def forward(hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, past_key_values=None, **kwargs):
        if cache is None:
            cache = past_key_values
        attn_out, _ = attn(hidden_states=ln1(hidden_states), attention_mask=attention_mask, position_ids=position_ids,
                           cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        normed, residual = add_rms_norm(attn_out, hidden_states, w2, eps2, soc_type=soc_type)
        rows = normed.numel() // normed.shape[-1]
        if mlp_native and same_kind and _wins(rows, normed.dtype, gw):
            h = linear_swiglu(normed.reshape(rows, -1), gw, uw, soc_type=soc_type)
            return linear_residual(h, dw, residual.reshape(rows, -1), db, soc_type=soc_type).view(residual.shape)
        return residual + mlp(normed)
    return forward


def _lm_head_forward(module, soc_type):
    w, b = _weight(module), module.bias
    linear_auto = kernels.linear_auto

    def forward(x):
        return linear_auto(x, w, b, soc_type=soc_type)
    return forward


def _rotary_forward(table: RotaryEmbedding):
    cos_sin = table.cos_sin

    def forward(x, position_ids, layer_type=None):
        return cos_sin(position_ids, x.dtype)
    return forward


# ---- the transformers hooks -------------------------------------------------------------------------------------
def atb_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                          position_ids=None, **kwargs):
    """The ``"atb"`` AttentionInterface function (HF layout in, ``[B, S, H, D]`` out, no attention weights)."""
    if dropout:
        raise ValueError("atb attention: dropout is not supported (the patched model is for inference; "
                         "call model.eval())")
    out = hf_attention(query, key, value, padding_mask=attention_mask, scale=scaling, window=sliding_window or None,
                       position_ids=position_ids, soc_type=getattr(module, "_atb_soc_type", None))
    return out, None


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
    mlp_bias = spec.has_mlp_bias
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
                status, detail = "fused", "atb.kernels.silu_mul between torch gate/up and down projections"
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
                if _mlp_native(options, config_reasons, mlp_bias):
                    detail += "; decode: down_proj + residual add as atb.kernels.linear_residual"
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
            elif parent_role == "mlp" and _mlp_native(options, config_reasons, mlp_bias):
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


def _mlp_native(options, config_reasons, mlp_bias) -> bool:
    """The MLP's projections run on the native linear kernels (fused MLP, linear=True, no gate/up bias)."""
    return _mlp_fused(options, config_reasons) and options["linear"] and not mlp_bias


def _dtype_name(model) -> str:
    p = next(model.parameters(), None)
    return str(p.dtype).replace("torch.", "") if p is not None else "?"


_DEFAULT_OPTIONS = dict(rms_norm=True, rope=True, attention=True, mlp=True, linear=True)


def check_model(model) -> PatchReport:
    """Which module types would run fused, stock or unsupported under ``patch_hf_model`` — nothing is changed.

    An unsupported family is reported (every module ``unsupported``) rather than raised.
    """
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


def _attach_quantized(model, adapter, quantized, rebind, soc_type) -> None:
    """Gives every projection module, the embedding and the LM head its quantized weight (``_atb_qweight``,
    read by the fused forwards) and a forward over it, so stock paths run quantized too."""
    names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
    for layer, lw in zip(adapter.layers(model), quantized.layers):
        for field_name, path in names.items():
            w = getattr(lw, field_name)
            if isinstance(w, QuantizedWeight):
                mod = layer.get_submodule(path)
                mod.__dict__[_QWEIGHT_ATTR] = w
                rebind(mod, _quant_linear_forward(mod, soc_type))
    for mod, w in ((model.get_input_embeddings(), quantized.embed), (model.get_output_embeddings(), quantized.lm_head)):
        if mod is not None and isinstance(w, QuantizedWeight):
            mod.__dict__[_QWEIGHT_ATTR] = w
            rebind(mod, _quant_embedding_forward(mod, soc_type) if isinstance(mod, torch.nn.Embedding)
                   else _quant_linear_forward(mod, soc_type))


def patch_hf_model(model, *, soc_type: str | None = None, rms_norm: bool = True, rope: bool = True,
                   attention: bool = True, mlp: bool = True, linear: bool = True, quantize=None) -> PatchReport:
    """Accelerates a loaded HF LLaMA-family model in place; returns a `PatchReport`.

    The model keeps its parameters (same tensors, ``data_ptr`` unchanged) and its ``generate``; patching again
    with the same options changes nothing, with other options re-patches. ``unpatch_hf_model`` undoes it.
    Raises ValueError for an unsupported ``model_type`` (naming the supported ones).

    Options (each part can be left on the stock path): ``rms_norm``, ``rope`` (fused rope + the patched
    attention forward), ``attention`` (the "atb" attention function), ``mlp`` (SwiGLU with silu_mul),
    ``linear`` (projections and the LM head through ``atb.kernels.linear*`` where ``native_linear_wins``:
    decode sizes, and prefill in fp16/bf16; fp32 prefill stays on torch's GEMM). ``soc_type`` is the SoC every kernel tiles for.
    ``quantize`` (``"w8a16"``, ``"w4a16[-gN]"``, ``"native"`` or an ``atb.quantize(model)`` result, as for
    ``TransformerInfer``): every projection, the embedding and the LM head run on quantized copies of their
    weights through the native kernels (fewer bytes per token); the float parameters stay in place for
    ``unpatch_hf_model``, so memory grows by the quantized copies rather than shrinking.
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

    def rebind(mod, fwd):
        had = "forward" in mod.__dict__
        forwards.append((mod, had, mod.__dict__.get("forward")))
        mod.forward = fwd

    config_reasons = adapter.unsupported_reasons()
    rope_fused = options["rope"] and "rope" not in config_reasons
    attn_fused = options["attention"] and "attention" not in config_reasons
    layer_of = {id(layer.self_attn): i for i, layer in enumerate(adapter.layers(model))}
    from atb.quant.engine import resolve

    quantized = resolve(model, quantize)
    try:
        if quantized is not None:
            _attach_quantized(model, adapter, quantized, rebind, soc_type)
        for name, st in status.items():
            if st.status != "fused":
                continue
            mod = modules[name if name != "(root)" else ""]
            if st.role == "rms_norm":
                rebind(mod, _norm_forward(mod, soc_type))
            elif st.role == "mlp":
                rebind(mod, _mlp_forward(mod, soc_type, options["linear"]))
            elif name == "lm_head":
                rebind(mod, _lm_head_forward(mod, soc_type))
            elif st.role == "rotary":
                rebind(mod, _rotary_forward(RotaryEmbedding.from_hf(mod)))
            elif st.role == "decoder_layer":
                rebind(mod, _decoder_layer_forward(mod, soc_type,
                                                   _mlp_native(options, config_reasons, spec.has_mlp_bias)))
            elif st.role == "attention":
                mod._atb_soc_type = soc_type
                if rope_fused:
                    rebind(mod, _attention_forward(mod, spec, layer_of[id(mod)], soc_type, options["linear"]))
        attn_before = model.config._attn_implementation
        attn_set = False
        if attn_fused:
            _register_hooks()
            model.set_attn_implementation(ATTN_NAME)
            attn_set = True
    except Exception:
        _restore(model, forwards, None, False)
        raise

    report = PatchReport(type(model).__name__, spec.model_type, _dtype_name(model), version, True, all_options,
                         plan, (attn_before, model.config._attn_implementation),
                         "HF DynamicCache (created by generate), contiguous [B, KH, L, D]; with attention=True decode "
                         "reads it in place through paged_attention")
    if quantized is not None:
        report.notes.append(f"quantized ({quantize if isinstance(quantize, str) else 'custom'}): every projection, "
                            f"the embedding and the LM head read their quantized copies; per tensor: "
                            + "; ".join(f"{k}: {v}" for k, v in list(quantized.report.items())[:3]) + "; ...")
    if config_reasons:
        report.notes.append("partial patch: " + "; ".join(f"{k} stays stock: {v}" for k, v in config_reasons.items()))
    setattr(model, _STATE_ATTR, _PatchState(all_options, report, forwards, attn_before, attn_set))
    return report


def _restore(model, forwards, attn_before, attn_set) -> None:
    for mod, had, previous in reversed(forwards):
        if had:
            mod.forward = previous
        else:
            mod.__dict__.pop("forward", None)
        mod.__dict__.pop("_atb_soc_type", None)
    for mod in model.modules():
        mod.__dict__.pop("_atb_soc_type", None)
        mod.__dict__.pop(_QWEIGHT_ATTR, None)
    if attn_set:
        model.set_attn_implementation(attn_before)


def unpatch_hf_model(model) -> bool:
    """Restores the stock forwards and attention implementation; returns False if the model was not patched."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        return False
    _restore(model, state.forwards, state.attn_before, state.attn_set)
    del model.__dict__[_STATE_ATTR]
    return True


def is_patched(model) -> bool:
    return getattr(model, _STATE_ATTR, None) is not None
