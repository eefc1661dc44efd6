"""Megatron's optimizer wrappers: fp32 training, and fp16/bf16 models with fp32 main parameters.

The runtime all-reduces the model parameters' ``.grad`` before :meth:`MegatronOptimizer.step`.
For 16-bit models the step copies those grads into fp32 main grads, unscales them and checks for
inf/NaN (fp16), reduces the found-inf flag with MAX over ``found_inf_group`` so that every rank of
a model replica skips together, clips by the global norm over ``grad_norm_group``, steps the fp32
main parameters and copies them back into the model.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_chimera.model.fused import FusedBackend
from megatron_chimera.optimizer.clip_grads import clip_grads_, count_zeros, get_grad_norm
from megatron_chimera.optimizer.grad_scaler import MegatronGradScaler
from megatron_chimera.optimizer.kernels import multi_tensor_scale_

NormFilter = Callable[[nn.Parameter], bool]
# Megatron's ``timers(name)`` -> an object with start() / stop()
TimersLike = Callable[[str], Any]


@contextlib.contextmanager
def _timed(timers: TimersLike | None, name: str) -> Iterator[None]:
    """Time the block with Megatron's timer ``name`` when ``timers`` is given."""
    if timers is None:
        yield
        return
    timers(name).start()
    try:
        yield
    finally:
        timers(name).stop()


class MegatronOptimizer:
    """Common step logic over an inner ``torch.optim`` optimizer of *main* parameters.

    ``model_params`` and ``main_params`` are parallel lists (the same objects for fp32).
    ``norm_param_filter(model_param)`` says whether a parameter counts in the global grad norm.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model_params: list[nn.Parameter],
                 main_params: list[nn.Parameter], clip_grad: float,
                 grad_scaler: MegatronGradScaler | None, backend: FusedBackend,
                 grad_norm_group=None, found_inf_group=None,
                 norm_param_filter: NormFilter | None = None,
                 log_num_zeros_in_grad: bool = False) -> None:
        self.optimizer = optimizer
        self.model_params = model_params
        self.main_params = main_params
        self.clip_grad = clip_grad
        self.grad_scaler = grad_scaler
        self.backend = backend
        self.grad_norm_group = grad_norm_group
        self.found_inf_group = found_inf_group
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        keep = norm_param_filter or (lambda _p: True)
        self._counts_in_norm = [bool(keep(p)) for p in model_params]
        self.skipped_steps = 0

    # ------------------------------------------------------------------ loss scale
    def get_loss_scale(self) -> float:
        """Current loss scale (1.0 without a scaler)."""
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale``: call backward on this."""
        return loss * self.get_loss_scale() if self.grad_scaler is not None else loss

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (the LR scheduler writes ``lr`` and ``weight_decay``)."""
        return self.optimizer.param_groups

    # ------------------------------------------------------------------ step
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear model grads (and main grads of 16-bit models)."""
        for params in (self.model_params, self.main_params):
            for p in params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def _prepare_main_grads(self) -> None:
        """Make ``main_param.grad`` the fp32 model gradient (no-op for fp32 models)."""

    def _copy_main_params_to_model(self) -> None:
        """Write updated main parameters into the model (no-op for fp32 models)."""

    def _unscale_and_check(self) -> bool:
        """Unscale main grads by 1/scale; True when any is inf/NaN on any rank of the group."""
        grads = [p.grad for p in self.main_params if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        inv_scale = torch.full((1,), self.grad_scaler.inv_scale, dtype=torch.float32,
                               device=device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        if (self.found_inf_group is not None and dist.is_initialized()
                and dist.get_world_size(self.found_inf_group) > 1):
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.found_inf_group)
        return bool(found_inf.item() > 0)

    @torch.no_grad()
    def step(self, timers: TimersLike | None = None) -> tuple[bool, float | None, int | None]:
        """One update: ``(update_successful, grad_norm, num_zeros)``. A skipped step bumps
        ``skipped_steps``: fp16 overflow returns ``(False, None, None)``; a non-finite global
        grad norm (with clipping on) returns ``(False, norm, None)``. ``timers`` times the parts
        under Megatron's names (``optimizer-copy-to-main-grad``, ...)."""
        with _timed(timers, "optimizer-copy-to-main-grad"):
            self._prepare_main_grads()
        if self.grad_scaler is not None:
            with _timed(timers, "optimizer-unscale-and-check-inf"):
                found_inf = self._unscale_and_check()
            self.grad_scaler.update(found_inf)
            if found_inf:
                self.skipped_steps += 1
                return False, None, None
        grads_for_norm = [m.grad for m, counted in zip(self.main_params, self._counts_in_norm)
                          if counted and m.grad is not None]
        grad_norm = None
        device = self.main_params[0].device
        if self.clip_grad > 0.0:
            with _timed(timers, "optimizer-clip-main-grad"):
                grad_norm = get_grad_norm(grads_for_norm, self.grad_norm_group, self.backend,
                                          device)
                finite = math.isfinite(grad_norm)
                if finite:
                    clip_grads_([m.grad for m in self.main_params if m.grad is not None],
                                grad_norm, self.clip_grad)
            if not finite:
                # inf/NaN gradients without a loss scaler (fp32/bf16): every rank of the group
                # sees the same global norm, so all skip together instead of corrupting weights
                self.skipped_steps += 1
                return False, grad_norm, None
        num_zeros = None
        if self.log_num_zeros_in_grad:
            with _timed(timers, "optimizer-count-zeros"):
                num_zeros = count_zeros(grads_for_norm, self.grad_norm_group, device)
        with _timed(timers, "optimizer-inner-step"):
            self.optimizer.step()
        with _timed(timers, "optimizer-copy-main-to-model-params"):
            self._copy_main_params_to_model()
        return True, grad_norm, num_zeros

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, grad scaler, skipped steps (and fp32 main params if 16-bit)."""
        state: dict[str, Any] = {
            "optimizer": self.optimizer.state_dict(),
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
            "skipped_steps": self.skipped_steps,
        }
        if self.main_params is not self.model_params:
            state["fp32_from_fp16_params"] = [p.detach().clone() for p in self.main_params]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""
        self.optimizer.load_state_dict(state["optimizer"])
        if self.grad_scaler is not None:
            if state.get("grad_scaler") is None:
                raise ValueError("checkpoint has no grad-scaler state but this run uses --fp16")
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        saved = state.get("fp32_from_fp16_params")
        if self.main_params is not self.model_params:
            if saved is None or len(saved) != len(self.main_params):
                raise ValueError("checkpoint's fp32 main parameters do not match this model")
            with torch.no_grad():
                for main, value in zip(self.main_params, saved):
                    main.copy_(value)


class FP32Optimizer(MegatronOptimizer):
    """fp32 model: the model parameters are the main parameters."""


class Float16OptimizerWithFloat16Params(MegatronOptimizer):
    """fp16/bf16 model with fp32 main parameters (and a grad scaler for fp16)."""

    def _copies(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(main, model) pairs where the main parameter is a separate fp32 copy."""
        return [(m, p) for m, p in zip(self.main_params, self.model_params) if m is not p]

    def _prepare_main_grads(self) -> None:
        with_grad = []
        for main, model in self._copies():
            if model.grad is None:
                main.grad = None
                continue
            if main.grad is None:
                main.grad = torch.empty_like(main)
            with_grad.append((main, model))
        multi_tensor_scale_([p.grad for _, p in with_grad], [m.grad for m, _ in with_grad], 1.0,
                            self.backend)

    def _copy_main_params_to_model(self) -> None:
        copies = self._copies()
        multi_tensor_scale_([m.data for m, _ in copies], [p.data for _, p in copies], 1.0,
                            self.backend)
