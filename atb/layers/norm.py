"""RMSNorm over the fused kernels, sharing the HF weight Parameter (no copy)."""
from __future__ import annotations

import torch
from torch import nn

from atb import kernels


class RMSNorm(nn.Module):
    """``weight * x / rms(x)`` with HF LlamaRMSNorm numerics; ``forward(x, residual)`` is the fused PRENORM form.

    ``weight`` is used as given (an HF ``Parameter`` stays shared with its model).
    """

    def __init__(self, weight: torch.Tensor, eps: float = 1e-6, *, soc_type: str | None = None):
        super().__init__()
        if not isinstance(weight, nn.Parameter):
            weight = nn.Parameter(weight, requires_grad=False)
        self.weight = weight
        self.eps = float(eps)
        self.soc_type = soc_type

    @classmethod
    def from_hf(cls, module, *, soc_type: str | None = None) -> "RMSNorm":
        return cls(module.weight, getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)), soc_type=soc_type)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``rms_norm(x)``; with ``residual``: ``(rms_norm(x + residual), x + residual)``."""
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps, soc_type=self.soc_type)
        return kernels.add_rms_norm(x, residual, self.weight, self.eps, soc_type=self.soc_type)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
