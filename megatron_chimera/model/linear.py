"""A linear layer whose weight gradient can be deferred, for split-backward (zero-bubble) schedules.

:class:`Linear` behaves exactly like ``torch.nn.Linear`` unless a :class:`WeightGradStore` is
attached to it (``with defer_weight_grad(module, store): loss.backward()``). Then its backward
returns the input gradient only and queues ``(input, grad_output)`` in the store; ``store.flush()``
(the ``W`` action) computes ``grad_output^T @ input`` and accumulates it into the weight's
gradient buffer (``weight.main_grad``) or, without one, into ``weight.grad``. The
deferrable function and the store live in :mod:`megatron_chimera.tensor_parallel.weight_grad`,
shared with the tensor-parallel linears (which defer the same way).
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_chimera.tensor_parallel.weight_grad import (
    WeightGradStore,
    defer_weight_grad,
    linear_with_deferrable_weight_grad,
)

__all__ = ["Linear", "WeightGradStore", "defer_weight_grad"]


class Linear(nn.Linear):
    """``torch.nn.Linear`` (same parameters and state dict) with a deferrable weight gradient."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.weight_grad_store: WeightGradStore | None = None
        self.weight_grad_deferrable = True  # see weight_grad.set_weight_grad_deferral

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Same result as ``nn.Linear``; routes through the deferrable autograd function."""
        return linear_with_deferrable_weight_grad(inputs, self, self.bias)

    def forward_without_bias(self, inputs: torch.Tensor
                             ) -> tuple[torch.Tensor, nn.Parameter | None]:
        """``(x W^T, bias)``: the bias left for the caller (Megatron's ``skip_bias_add``); its
        gradient then comes from autograd, only the weight gradient can be deferred."""
        return linear_with_deferrable_weight_grad(inputs, self, None), self.bias
