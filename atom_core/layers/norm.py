"""RMSNorm, calling the registry's rms_norm / fused_add_rms_norm / rms_norm_linear ops."""

from __future__ import annotations

import torch
from torch import nn

from atom_core.layers.context import get_build_context
from atom_core.ops import resolve_op


class RMSNorm(nn.Module):
    """``forward(x)`` -> norm(x); ``forward(x, residual)`` -> (norm(x + residual), x + residual).

    The ops are resolved once, at construction, for the build context's device, so the
    forward pass does no registry look-ups.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        device = get_build_context().device
        self._rms_norm = resolve_op("rms_norm", device)
        self._fused_add_rms_norm = resolve_op("fused_add_rms_norm", device)
        self._rms_norm_linear = resolve_op("rms_norm_linear", device)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._rms_norm(x, self.weight, self.eps)
        return self._fused_add_rms_norm(x, residual, self.weight, self.eps)

    def project(
        self, x: torch.Tensor, residual: torch.Tensor | None, linear: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(norm(x + residual)), x + residual), residual None meaning 0; one kernel
        where the device's ``rms_norm_linear`` fuses them. ``linear`` is a column-parallel
        or replicated layer: its forward is the ``linear`` op on its ``op_weight`` and bias."""
        return self._rms_norm_linear(x, residual, self.weight, self.eps, linear.op_weight,
                                     linear.bias)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
