"""SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` over the fused kernels.

The three projections keep the HF weights (``[out, in]``) as they are: fusing
gate and up into one matrix would need a copy of 2/3 of the MLP weights.
Where the native linear kernels win (``native_linear_wins``: decode sizes,
and every size in fp16/bf16) one pass over gate and up has ``silu(gate) * up``
fused in (``linear_swiglu``) and ``linear`` does down; fp32 prefill uses
torch's GEMM and the ``silu_mul`` kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atb import kernels
from atb.kernels.linear import native_linear_wins


class SwiGLUMLP(nn.Module):
    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *, gate_bias=None, up_bias=None,
                 down_bias=None, soc_type: str | None = None):
        super().__init__()
        if gate.shape != up.shape or down.shape[1] != gate.shape[0] or down.shape[0] != gate.shape[1]:
            raise ValueError(f"SwiGLUMLP: gate {tuple(gate.shape)}, up {tuple(up.shape)} must be [I, H] and "
                             f"down {tuple(down.shape)} must be [H, I]")
        self.gate, self.up, self.down = gate, up, down
        self.gate_bias, self.up_bias, self.down_bias = gate_bias, up_bias, down_bias
        self.soc_type = soc_type

    @classmethod
    def from_hf(cls, module, *, soc_type: str | None = None) -> "SwiGLUMLP":
        g, u, d = module.gate_proj, module.up_proj, module.down_proj
        return cls(g.weight, u.weight, d.weight, gate_bias=g.bias, up_bias=u.bias, down_bias=d.bias, soc_type=soc_type)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        soc = self.soc_type
        rows = x.numel() // x.shape[-1]
        if native_linear_wins(rows, x.dtype) and self.gate_bias is None and self.up_bias is None:
            h = kernels.linear_swiglu(x.reshape(rows, -1), self.gate, self.up, soc_type=soc)
            return kernels.linear(h, self.down, self.down_bias, soc_type=soc).view(*x.shape[:-1], -1)
        h = kernels.silu_mul(F.linear(x, self.gate, self.gate_bias), F.linear(x, self.up, self.up_bias), soc_type=soc)
        return F.linear(h, self.down, self.down_bias)
