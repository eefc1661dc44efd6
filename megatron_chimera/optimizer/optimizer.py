"""Megatron's optimizer wrappers: fp32 training, and fp16/bf16 models with fp32 main parameters.

The runtime reduces the gradients before :meth:`MegatronOptimizer.step`: into each parameter's
``main_grad`` (its view of a gradient buffer, :mod:`megatron_chimera.distributed.grad_buffer`) or,
without buffers, its ``.grad``. The step makes the fp32 main gradients (views of fp32 buffers, no
copy; a copy from 16-bit buffers), unscales them and checks for inf/NaN (fp16), reduces the
found-inf flag with MAX over ``found_inf_group`` so that every rank of a model replica skips
together, clips by the global norm over ``grad_norm_group``, steps the main parameters and copies
them back into the model.

:class:`MegatronOptimizer` holds what every variant shares; the local optimizers
(:class:`FP32Optimizer`, :class:`Float16OptimizerWithFloat16Params`) keep the full main
parameters of this rank's stages, the distributed optimizer
(:mod:`megatron_chimera.optimizer.distributed_optimizer`) only its shard of them. Checkpoints see
either through the same per-parameter entries (:mod:`megatron_chimera.optimizer.param_state`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_chimera.distributed.data_parallel import NormFilter
from megatron_chimera.distributed.grad_buffer import ModelGradBuffers
from megatron_chimera.model.fused import FusedBackend
from megatron_chimera.optimizer.clip_grads import clip_grads_, count_zeros, get_grad_norm
from megatron_chimera.optimizer.grad_scaler import MegatronGradScaler
from megatron_chimera.optimizer.kernels import multi_tensor_scale_
from megatron_chimera.optimizer.param_state import (
    MAIN_PARAM,
    ParamEntry,
    ParamFragments,
    ParamStateError,
    group_entries,
    is_elementwise,
    load_inner,
    own_copy,
    to_host,
)

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

    ``main_params`` are the inner optimizer's parameters; ``counts_in_norm[i]`` says whether
    ``main_params[i]`` counts in the global grad norm (each model element once over
    ``grad_norm_group``). ``grad_buffers``: the gradient buffers the runtime reduces into
    (zeroed by :meth:`zero_grad`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, main_params: list[nn.Parameter],
                 counts_in_norm: list[bool], clip_grad: float,
                 grad_scaler: MegatronGradScaler | None, backend: FusedBackend,
                 grad_norm_group=None, found_inf_group=None,
                 log_num_zeros_in_grad: bool = False,
                 grad_buffers: ModelGradBuffers | None = None) -> None:
        self.optimizer = optimizer
        self.main_params = main_params
        self.clip_grad = clip_grad
        self.grad_scaler = grad_scaler
        self.backend = backend
        self.grad_norm_group = grad_norm_group
        self.found_inf_group = found_inf_group
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        self.grad_buffers = grad_buffers
        self._counts_in_norm = counts_in_norm
        self._collected: dict[int, ParamEntry] = {}
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
    def _model_params(self) -> list[nn.Parameter]:
        """The model parameters whose ``.grad`` this optimizer clears."""
        return []

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear main grads and model grads, and zero the gradient buffers (with buffers, every
        ``.grad`` is dropped: the buffers hold the gradients)."""
        set_to_none = set_to_none or self.grad_buffers is not None
        for params in (self._model_params(), self.main_params):
            for p in params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
        if self.grad_buffers is not None:
            self.grad_buffers.zero_()

    def _prepare_main_grads(self) -> None:
        """Make ``main_param.grad`` the fp32 model gradient."""
        raise NotImplementedError

    def _copy_main_params_to_model(self) -> None:
        """Write updated main parameters into the model."""
        raise NotImplementedError

    def finish_param_sync(self) -> None:
        """Wait until every model parameter holds its updated value (a no-op unless parameters
        are gathered in the background)."""

    def _unscale_and_check(self) -> bool:
        """Unscale main grads by 1/scale; True when any is inf/NaN on any rank of the group."""
        grads = [p.grad for p in self.main_params if p.grad is not None]
        device = grads[0].device if grads else self._device()
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        inv_scale = torch.full((1,), self.grad_scaler.inv_scale, dtype=torch.float32,
                               device=device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        if (self.found_inf_group is not None and dist.is_initialized()
                and dist.get_world_size(self.found_inf_group) > 1):
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.found_inf_group)
        return bool(found_inf.item() > 0)

    def _device(self) -> torch.device:
        return self.main_params[0].device if self.main_params else torch.device("cpu")

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
        device = self._device()
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
    def param_state_to_save(self, stages: list[tuple[int, dict[str, nn.Parameter], bool]]
                            ) -> dict[int, dict[str, ParamEntry]]:
        """Per-parameter entries of every ``(stage, params by global name, writer)`` of this
        rank, for the stages it writes. Every rank calls it (the distributed optimizer gathers
        its shards here)."""
        raise NotImplementedError

    def collect_param_state(self, params: dict[str, nn.Parameter],
                            saved: dict[str, ParamEntry]) -> None:
        """Take the saved entries of ``params`` (global names) into this rank's main parameters
        and pending inner state; :meth:`load_collected_state` applies the inner state."""
        raise NotImplementedError

    def state_ranges(self, params: dict[str, nn.Parameter]) -> dict[str, list[tuple[int, int]]]:
        """Per parameter (global name) of ``params``, the flat ranges ``(offset, length)`` of its
        local shard whose optimizer state this rank holds (sharded checkpoints)."""
        raise NotImplementedError

    def state_fragments(self, params: dict[str, nn.Parameter]) -> dict[str, ParamFragments]:
        """This rank's optimizer state of ``params`` without any communication: per parameter,
        its scalars (torch's ``step``) and, per range of :meth:`state_ranges`, the flat
        per-element values (moments, ``main_param``)."""
        raise NotImplementedError

    def collect_state_fragments(self, params: dict[str, nn.Parameter],
                                saved: dict[str, ParamFragments]) -> None:
        """Take the saved fragments of :meth:`state_ranges` into this rank's main parameters
        and pending inner state (:meth:`load_collected_state` applies it)."""
        raise NotImplementedError

    def load_collected_state(self, common: dict[str, Any]) -> None:
        """Restore the inner optimizer from the collected entries and ``common`` (group entries,
        grad scaler, skipped steps: :meth:`common_state`)."""
        load_inner(self.optimizer, self._collected, common.get("param_groups"))
        self._collected = {}
        if self.grad_scaler is not None and common.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(common["grad_scaler"])
        self.skipped_steps = int(common.get("skipped_steps", 0))

    def common_state(self) -> dict[str, Any]:
        """What the checkpoint keeps once for the whole optimizer."""
        scaler = self.grad_scaler
        return {"grad_scaler": scaler.state_dict() if scaler is not None else None,
                "skipped_steps": int(self.skipped_steps),
                "param_groups": group_entries(self.optimizer)}


class LocalOptimizer(MegatronOptimizer):
    """Full main parameters of every local stage: ``model_params[i]`` is updated from
    ``main_params[i]`` (the same object for fp32 parameters; a shared main for the local copies
    of the tied embedding). ``norm_param_filter(model_param)`` says whether a parameter counts in
    the global grad norm (default: all)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model_params: list[nn.Parameter],
                 main_params: list[nn.Parameter], clip_grad: float,
                 grad_scaler: MegatronGradScaler | None, backend: FusedBackend,
                 grad_norm_group=None, found_inf_group=None,
                 norm_param_filter: NormFilter | None = None,
                 log_num_zeros_in_grad: bool = False,
                 grad_buffers: ModelGradBuffers | None = None) -> None:
        keep = norm_param_filter or (lambda _p: True)
        unique, counts, seen = [], [], set()
        for model, main in zip(model_params, main_params):
            if id(main) not in seen:  # the first model parameter of a main decides
                seen.add(id(main))
                unique.append(main)
                counts.append(bool(keep(model)))
        super().__init__(optimizer, unique, counts, clip_grad, grad_scaler, backend,
                         grad_norm_group, found_inf_group, log_num_zeros_in_grad, grad_buffers)
        self.model_params = model_params
        self._main_of_model = list(main_params)

    def _model_params(self) -> list[nn.Parameter]:
        return self.model_params

    def _pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(main, model) pairs whose model parameter is not its own main parameter."""
        return [(m, p) for m, p in zip(self._main_of_model, self.model_params) if m is not p]

    def _sources(self) -> list[tuple[nn.Parameter, torch.Tensor | None]]:
        """(main, reduced model gradient) for each main parameter, once."""
        found, seen = [], set()
        for main, model in zip(self._main_of_model, self.model_params):
            if id(main) in seen:
                continue
            seen.add(id(main))
            grad = getattr(model, "main_grad", None)
            found.append((main, grad if grad is not None else model.grad))
        return found

    def _prepare_main_grads(self) -> None:
        copies = []
        for main, grad in self._sources():
            if grad is None:
                main.grad = None
            elif grad.dtype == main.dtype:
                main.grad = grad  # an fp32 buffer view or fp32 .grad: no copy
            else:
                if main.grad is None or main.grad.data_ptr() == grad.data_ptr():
                    main.grad = torch.empty_like(main)
                copies.append((grad, main.grad))
        multi_tensor_scale_([g for g, _ in copies], [m for _, m in copies], 1.0, self.backend)

    def _copy_main_params_to_model(self) -> None:
        pairs = self._pairs()
        multi_tensor_scale_([m.data for m, _ in pairs], [p.data for _, p in pairs], 1.0,
                            self.backend)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, grad scaler, skipped steps and the fp32 main parameters that
        are separate copies."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
            "skipped_steps": self.skipped_steps,
            "fp32_from_fp16_params": [m.detach().clone() for m, _ in self._pairs()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""
        self.optimizer.load_state_dict(state["optimizer"])
        if self.grad_scaler is not None:
            if state.get("grad_scaler") is None:
                raise ValueError("checkpoint has no grad-scaler state but this run uses --fp16")
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        pairs = self._pairs()
        saved = state.get("fp32_from_fp16_params") or []
        if len(saved) != len(pairs):
            raise ValueError("checkpoint's fp32 main parameters do not match this model")
        with torch.no_grad():
            for (main, _), value in zip(pairs, saved):
                main.copy_(value)

    def _main_of(self) -> dict[int, nn.Parameter]:
        return {id(p): m for p, m in zip(self.model_params, self._main_of_model)}

    def param_state_to_save(self, stages: list[tuple[int, dict[str, nn.Parameter], bool]]
                            ) -> dict[int, dict[str, ParamEntry]]:
        main_of = self._main_of()
        result: dict[int, dict[str, ParamEntry]] = {}
        for stage, params, writer in stages:
            if not writer:
                continue
            state: dict[str, ParamEntry] = {}
            for name, param in params.items():
                main = main_of.get(id(param))
                if main is None:
                    continue
                entry = {k: to_host(v) for k, v in self.optimizer.state.get(main, {}).items()}
                if main is not param and main.dtype != param.dtype:
                    entry[MAIN_PARAM] = to_host(main)
                state[name] = entry
            result[stage] = state
        return result

    def collect_param_state(self, params: dict[str, nn.Parameter],
                            saved: dict[str, ParamEntry]) -> None:
        main_of = self._main_of()
        for name, param in params.items():
            main = main_of.get(id(param))
            if main is None:
                continue
            if name not in saved:
                raise ParamStateError(f"no optimizer state for parameter {name}")
            entry = dict(saved[name])
            main_value = entry.pop(MAIN_PARAM, None)
            if main is not param:
                with torch.no_grad():
                    main.copy_(main_value if main_value is not None else param.float())
            # own copies: the tied embedding's copies share one saved entry
            self._collected[id(main)] = own_copy(entry)


    def state_ranges(self, params: dict[str, nn.Parameter]) -> dict[str, list[tuple[int, int]]]:
        main_of = self._main_of()
        return {name: [(0, param.numel())] for name, param in params.items()
                if id(param) in main_of}

    def state_fragments(self, params: dict[str, nn.Parameter]) -> dict[str, ParamFragments]:
        entries = self.param_state_to_save([(0, params, True)])[0]
        found = {}
        for name, entry in entries.items():
            numel = params[name].numel()
            flat = {k: v.reshape(-1) for k, v in entry.items() if is_elementwise(v, numel)}
            scalars = {k: v for k, v in entry.items() if k not in flat}
            found[name] = ParamFragments(scalars, {0: flat})
        return found

    def collect_state_fragments(self, params: dict[str, nn.Parameter],
                                saved: dict[str, ParamFragments]) -> None:
        entries = {}
        for name, fragments in saved.items():
            shape = params[name].shape
            flat = fragments.ranges.get(0, {})
            entries[name] = {**fragments.scalars, **{k: v.view(shape) for k, v in flat.items()}}
        self.collect_param_state(params, entries)


class FP32Optimizer(LocalOptimizer):
    """fp32 model: the model parameters are the main parameters."""


class Float16OptimizerWithFloat16Params(LocalOptimizer):
    """fp16/bf16 model with fp32 main parameters (and a grad scaler for fp16)."""
