"""A linear layer whose weight gradient can be deferred, for split-backward (zero-bubble) schedules.

A split-backward schedule runs the backward of a micro-batch in two actions: ``B`` computes only
the gradient with respect to the layer inputs (it is on the pipeline's critical path), ``W``
computes the weight and bias gradients later, in time the pipeline would otherwise idle.

:class:`Linear` behaves exactly like ``torch.nn.Linear`` unless a :class:`WeightGradStore` is
attached to it (``with defer_weight_grad(module, store): loss.backward()``). Then its backward
returns the input gradient only and queues ``(input, grad_output)`` in the store; ``store.flush()``
(the ``W`` action) computes ``grad_output^T @ input`` and accumulates it into the weight's
gradient buffer (``weight.main_grad``) or, without one, into ``weight.grad``. The
store hangs off the module, not a global, so backward threads and several stage replicas on one
rank cannot mix up their queues.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn


class WeightGradStore:
    """Weight-gradient work queued by the B of one (pipe, stage, micro-batch), run by its W."""

    def __init__(self) -> None:
        self._pending: list[
            tuple[nn.Parameter, nn.Parameter | None, torch.Tensor, torch.Tensor]
        ] = []

    def put(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        inputs: torch.Tensor,
        grad_output: torch.Tensor,
    ) -> None:
        """Queue the weight (and bias) gradient of one linear layer."""
        self._pending.append((weight, bias, inputs, grad_output))

    def __len__(self) -> int:
        return len(self._pending)

    def flush(self) -> None:
        """Compute every queued weight/bias gradient, accumulate it into ``.grad``, free inputs."""
        with torch.no_grad():
            for weight, bias, inputs, grad_output in self._pending:
                _accumulate(weight, _weight_grad(inputs, grad_output))
                if bias is not None:
                    _accumulate(bias, _bias_grad(grad_output))
        self._pending.clear()


def _weight_grad(inputs: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
    return flat_grad.t().matmul(inputs.reshape(-1, inputs.shape[-1]))


def _bias_grad(grad_output: torch.Tensor) -> torch.Tensor:
    return grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Add ``grad`` into the parameter's gradient buffer (``main_grad``, see
    :mod:`megatron_chimera.distributed.grad_buffer`) when it has one, else into ``.grad``."""
    main_grad = getattr(param, "main_grad", None)
    if main_grad is not None:
        main_grad.add_(grad)
        return
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class _LinearFunction(torch.autograd.Function):
    """y = x W^T + b, with a backward that can hand the weight gradient to a WeightGradStore."""

    @staticmethod
    def forward(ctx, inputs, weight, bias, module):  # type: ignore[override]
        ctx.save_for_backward(inputs, weight)
        ctx.has_bias = bias is not None
        ctx.module = module
        output = inputs.matmul(weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        inputs, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        store: WeightGradStore | None = ctx.module.weight_grad_store
        bias = ctx.module.bias if ctx.has_bias else None
        if store is not None:
            store.put(ctx.module.weight, bias, inputs, grad_output)
            return grad_input, None, None, None
        grad_weight = _weight_grad(inputs, grad_output) if ctx.needs_input_grad[1] else None
        grad_bias = _bias_grad(grad_output) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias, None


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

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Same result as ``nn.Linear``; routes through the deferrable autograd function."""
        return _LinearFunction.apply(inputs, self.weight, self.bias, self)

    def forward_without_bias(self, inputs: torch.Tensor
                             ) -> tuple[torch.Tensor, nn.Parameter | None]:
        """``(x W^T, bias)``: the bias left for the caller (Megatron's ``skip_bias_add``); its
        gradient then comes from autograd, only the weight gradient can be deferred."""
        return _LinearFunction.apply(inputs, self.weight, None, self), self.bias


def deferrable_linears(module: nn.Module) -> list[Linear]:
    """``module``'s :class:`Linear` layers (what :func:`defer_weight_grad` switches)."""
    return [m for m in module.modules() if isinstance(m, Linear)]


@contextlib.contextmanager
def defer_weight_grad(module: nn.Module | Sequence[Linear],
                      store: WeightGradStore) -> Iterator[WeightGradStore]:
    """Within the block, backwards through ``module``'s :class:`Linear` layers queue their weight
    gradients in ``store`` instead of computing them; run ``store.flush()`` later (the W action).
    A list of layers (:func:`deferrable_linears`, kept by a caller that defers every
    iteration) saves walking the module each time."""
    linears = deferrable_linears(module) if isinstance(module, nn.Module) else module
    for linear in linears:
        linear.weight_grad_store = store
    try:
        yield store
    finally:
        for linear in linears:
            linear.weight_grad_store = None
