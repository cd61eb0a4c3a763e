"""Rotary position embedding: cos/sin tables from the model's own rope settings.

The inverse frequencies and the attention scaling come from transformers' own
functions (``ROPE_INIT_FUNCTIONS[rope_type]``, or the family's
``compute_default_rope_parameters``), or straight from a loaded model's HF
rotary module, so the numbers are HF's. The table is built the way HF builds
one position's row (``pos.float() * inv_freq``, ``cat(freqs, freqs)``,
``cos() * attention_scaling``, cast to the dtype): element-wise operations, so
a gathered row equals what HF computes for that position.

Table: ``cos``/``sin`` ``[positions, rotary_dim]`` in HF (neox) layout; rows
are gathered by position id. It grows on demand (doubling) past the first
``max_positions`` rows, so a 128k-context config costs nothing up front.

Dynamic NTK (``rope_type="dynamic"``) mirrors HF's stateful update exactly:
while every position seen is below ``max_position_embeddings`` the original
frequencies (the table) are used; a call whose longest position exceeds the
longest seen so far recomputes the frequencies for that length and applies
them to *every* position of that call (cos/sin computed on the fly, not from
the table); a later call entirely below ``max_position_embeddings`` resets to
the original frequencies. As in HF, keys already cached keep the rotation
they were written with.
"""
from __future__ import annotations

import torch
from torch import nn

_STATIC_TYPES = ("default", "linear", "llama3", "yarn")
SUPPORTED = _STATIC_TYPES + ("dynamic",)


def _rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    return params


def compute_inv_freq(config, default_fn=None) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 ``[rotary_dim // 2]``, attention_scaling) from transformers' own functions."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = _rope_parameters(config).get("rope_type", "default")
    if rope_type not in SUPPORTED:
        raise ValueError(f"RotaryEmbedding: rope_type '{rope_type}' is not supported; supported: {', '.join(SUPPORTED)}")
    if rope_type == "default":
        if default_fn is None:
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

            default_fn = LlamaRotaryEmbedding.compute_default_rope_parameters
        inv_freq, scaling = default_fn(config)
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    return inv_freq.float(), float(scaling)


_vector_math_ready = False


def _set_up_vector_math() -> None:
    """Makes the process's first float32 cos and sin calls alone, on one element.

    torch computes them with MKL's vector math, which splits a long vector over the OpenMP team itself. A
    process's first call, split over two threads that were both awake (kernels had just run on the team),
    returned one thread's half of the values about 12 bits accurate (errors up to 1.5e-4; HF's table and the
    other half are within 1 ulp). AMX Xeon, torch 2.13, fresh processes: a 128-row SmolLM2 rope table built
    by DecodeGraph.from_model after the fuzz test's in-process cases, 2 of 10 runs off, 0 of 28 with this
    call first; the 128-row table of tests/test_layers.py's script, 3 of 20 off, 0 of 12. One element is
    never split, so the first call is this thread's alone.
    """
    global _vector_math_ready
    if not _vector_math_ready:
        one = torch.zeros(1)
        one.cos(), one.sin()
        _vector_math_ready = True


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    # The same element-wise steps as the HF LLaMA-family rotary forward, in float32.
    _set_up_vector_math()
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


class RotaryEmbedding(nn.Module):
    """cos/sin tables computed once; ``cos_sin(positions)`` gathers rows, ``forward`` rotates q and k.

    Args:
        config: the HF model config (``rope_parameters``, ``head_dim``, ``max_position_embeddings``).
        max_positions: rows computed up front (default: min(max_position_embeddings, 4096)); more on demand.
        default_fn: the family's HF default-rope function (adapters pass it; LLaMA's otherwise).
        inv_freq, attention_scaling: take these from a loaded HF rotary module instead of recomputing
            (``RotaryEmbedding.from_hf``), so a model whose buffers were modified still matches.
    """

    def __init__(self, config, *, max_positions: int | None = None, default_fn=None,
                 inv_freq: torch.Tensor | None = None, attention_scaling: float | None = None):
        super().__init__()
        self.config = config
        self.rope_type = _rope_parameters(config).get("rope_type", "default")
        if inv_freq is None:
            inv_freq, attention_scaling = compute_inv_freq(config, default_fn)
        elif self.rope_type not in SUPPORTED:
            raise ValueError(f"RotaryEmbedding: rope_type '{self.rope_type}' is not supported; "
                             f"supported: {', '.join(SUPPORTED)}")
        self.inv_freq = inv_freq.detach().float().cpu().clone()
        self.attention_scaling = float(attention_scaling)
        self.rotary_dim = 2 * self.inv_freq.numel()
        self.max_position_embeddings = int(config.max_position_embeddings)
        self._cos = self._sin = torch.empty(0, self.rotary_dim)
        self._by_dtype: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._grow(max_positions or min(self.max_position_embeddings, 4096))
        # Dynamic NTK state, as HF keeps it on its rotary module.
        self._dyn_inv_freq = self.inv_freq
        self._dyn_scaling = self.attention_scaling
        self._dyn_cached_len = self.max_position_embeddings

    @classmethod
    def from_hf(cls, rotary_module, *, max_positions: int | None = None) -> "RotaryEmbedding":
        """Built from a loaded model's HF rotary module (its ``original_inv_freq`` and ``attention_scaling``)."""
        inv = getattr(rotary_module, "original_inv_freq", None)
        if inv is None:
            inv = rotary_module.inv_freq
        return cls(rotary_module.config, max_positions=max_positions, inv_freq=inv,
                   attention_scaling=rotary_module.attention_scaling)

    @property
    def num_positions(self) -> int:
        return self._cos.shape[0]

    def _grow(self, n: int) -> None:
        have = self._cos.shape[0]
        if n <= have:
            return
        n = max(n, 2 * have)
        cos, sin = _cos_sin(torch.arange(n), self.inv_freq, self.attention_scaling)
        self._cos, self._sin = cos, sin
        self._by_dtype = {}

    def table(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole (cos, sin) table ``[num_positions, rotary_dim]`` in ``dtype`` (cast once, then cached)."""
        t = self._by_dtype.get(dtype)
        if t is None:
            t = self._by_dtype[dtype] = (self._cos.to(dtype), self._sin.to(dtype))
        return t

    def _dynamic(self, positions: torch.Tensor, dtype: torch.dtype):
        """HF's dynamic_rope_update: returns on-the-fly (cos, sin) when scaled, None for the table path."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        seq_len = torch.max(positions) + 1
        original = self.max_position_embeddings
        if seq_len > self._dyn_cached_len:
            inv, self._dyn_scaling = ROPE_INIT_FUNCTIONS["dynamic"](self.config, None, seq_len=seq_len)
            self._dyn_inv_freq = inv.float()
            self._dyn_cached_len = int(seq_len)
        if seq_len < original and self._dyn_cached_len > original:
            self._dyn_inv_freq, self._dyn_cached_len = self.inv_freq, original
            self._dyn_scaling = self.attention_scaling
        if self._dyn_inv_freq is self.inv_freq:
            return None
        cos, sin = _cos_sin(positions, self._dyn_inv_freq, self._dyn_scaling)
        return cos.to(dtype), sin.to(dtype)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) ``[*positions.shape, rotary_dim]`` in ``dtype`` for integer ``positions`` (>= 0)."""
        if self.rope_type == "dynamic":
            out = self._dynamic(positions, dtype)
            if out is not None:
                return out
        cos, sin = self.table(dtype)
        flat = positions.reshape(-1)
        try:
            c, s = cos.index_select(0, flat), sin.index_select(0, flat)
        except (IndexError, RuntimeError):
            if flat.numel() and int(flat.min()) < 0:
                raise ValueError(f"RotaryEmbedding: positions must be >= 0, got min {int(flat.min())}") from None
            self._grow(int(flat.max()) + 1)
            cos, sin = self.table(dtype)
            c, s = cos.index_select(0, flat), sin.index_select(0, flat)
        shape = (*positions.shape, self.rotary_dim)
        return c.view(shape), s.view(shape)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, *, inplace: bool = False,
                soc_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q ``[tokens, heads, head_dim]`` and k ``[tokens, kv_heads, head_dim]`` at ``positions`` ``[tokens]``."""
        from atb.kernels import rope

        cos, sin = self.cos_sin(positions, q.dtype)
        return rope(q, k, cos, sin, style="neox", inplace=inplace, soc_type=soc_type)

    def extra_repr(self) -> str:
        return (f"rope_type={self.rope_type}, rotary_dim={self.rotary_dim}, "
                f"attention_scaling={self.attention_scaling}, positions={self.num_positions}")
