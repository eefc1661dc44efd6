"""Runs one rank's action list of any :class:`Schedule` with real stage modules.

``F`` receives the stage input (stage > 0), runs ``forward_step_func(batch, model)``, computes the
loss at the last stage and sends the output; ``B`` receives the output gradient (stage < last),
back-propagates and sends the input gradient; ``W`` (split backward) computes the weight
gradients queued by its ``B`` (``B`` runs inside :func:`defer_weight_grad`).

Loss scaling: each micro-batch loss is divided by ``loss_scale_divisor = N x W`` before its
backward, and :class:`GradientSynchronizer` SUMs gradients over each stage-replica group, so every
replica ends with the mean gradient over the ``B x N x W`` samples of the mini-batch.

Losses: every last-stage rank records ``{name: value}`` per micro-batch; at the end of ``run`` they
are gathered (with each rank's compute-busy seconds) on the logging rank, the last global rank
(Megatron's convention).

Failures: an exception on any rank is recorded in the c10d store before it propagates; a rank
whose communication then fails raises :class:`~.failures.PipelineFailure` naming the rank that
failed first (:mod:`.failures`).

Where the rank sits (pipeline rank, data-parallel rank, peers) comes from an injected
:class:`~.topology.PipelineTopology`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from megatron_chimera.model.linear import WeightGradStore, defer_weight_grad
from megatron_chimera.pipeline.failures import PipelineFailure, pipeline_failure
from megatron_chimera.pipeline.grad_sync import GradientSynchronizer
from megatron_chimera.pipeline.p2p import P2PCommunicator, iteration_actions
from megatron_chimera.pipeline.topology import PipelineTopology
from megatron_chimera.schedules.actions import BACKWARD, FORWARD, WEIGHT, Action, Schedule

ForwardStepFunc = Callable[[Any, nn.Module], tuple[torch.Tensor, Callable]]
__all__ = ["PipelineExecutor", "PipelineFailure", "IterationResult", "ForwardStepFunc",
           "ActionTimer"]


class SavedForward(NamedTuple):
    """What a forward leaves for its backward: the stage input (with ``requires_grad``), and
    either the output (stored activations) or the RNG state to replay it (recomputation)."""

    input_tensor: torch.Tensor | None
    output: torch.Tensor | None
    rng_state: tuple | None


@dataclass
class IterationResult:
    """What one iteration produced on this rank (``losses``, ``busy_seconds_per_rank``: only on
    the logging rank)."""

    local_losses: dict[int, dict[str, float]]
    busy_seconds: float
    iteration_seconds: float
    executed: list[Action]
    losses: list[dict[str, float]] = field(default_factory=list)
    busy_seconds_per_rank: list[float] = field(default_factory=list)


def deallocate_output_tensor(output: torch.Tensor) -> None:
    """Megatron's trick: free an output's data once sent, keeping its ``grad_fn`` for backward."""
    output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor) -> None:
    """Backward without autograd's shape check, so ``output`` may have been deallocated."""
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True,
    )


ActionTimer = Callable[[Action, float], None]


class _BusyTimer:
    """Sums compute time: wall clock on CPU, CUDA events on GPU (read at the end). With an
    ``action_timer`` it also reports each action's seconds (on GPU when the iteration ends)."""

    def __init__(self, device: torch.device, action_timer: ActionTimer | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self.action_timer = action_timer
        self._events: list[tuple[Any, Any, Action | None]] = []

    @contextlib.contextmanager
    def measure(self, action: Action | None = None):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end, action))
        else:
            t0 = time.perf_counter()
            yield
            elapsed = time.perf_counter() - t0
            self.seconds += elapsed
            if self.action_timer is not None and action is not None:
                self.action_timer(action, elapsed)

    def total(self) -> float:
        if self._events:
            torch.cuda.synchronize()
            for start, end, action in self._events:
                elapsed = start.elapsed_time(end) / 1000.0
                self.seconds += elapsed
                if self.action_timer is not None and action is not None:
                    self.action_timer(action, elapsed)
            self._events.clear()
        return self.seconds


def _as_float_dict(stats: dict[str, Any]) -> dict[str, float]:
    return {k: float(v.detach().float().mean()) if torch.is_tensor(v) else float(v)
            for k, v in stats.items()}


class PipelineExecutor:
    """Executes ``schedule.actions[pipeline_rank]`` for one iteration with real stage modules.

    ``topology`` says where this rank sits; ``stage_modules`` maps every stage this rank holds to
    its module (one module per stage, shared by the pipes that visit it); ``tensor_shape`` and
    ``dtype`` describe every p2p message (``[seq, micro_batch, hidden]``);
    ``loss_scale_divisor`` is ``N x W``; ``grad_sync`` is None for evaluation-only use;
    ``scale_loss`` is the fp16 grad scaler's hook; ``recompute`` keeps only stage inputs and
    re-runs the forward at B; ``weight_grad_store_factory`` makes the store
    of each split backward (W); ``gather_losses`` collects losses on the last global rank;
    ``action_timer(action, seconds)``, when set (it may be set or cleared between iterations),
    receives the compute time of every F, B and W (the profiler's hook,
    :mod:`~megatron_chimera.pipeline.profiler`).
    """

    def __init__(
        self,
        schedule: Schedule,
        topology: PipelineTopology,
        stage_modules: dict[int, nn.Module],
        forward_step_func: ForwardStepFunc,
        tensor_shape: Sequence[int],
        dtype: torch.dtype,
        loss_scale_divisor: float,
        grad_sync: GradientSynchronizer | None = None,
        device: torch.device | str = "cpu",
        recompute: bool = False,
        scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
        recv_lookahead: int = 2,
        deallocate_outputs: bool = True,
        weight_grad_store_factory: Callable[[], WeightGradStore] = WeightGradStore,
        gather_losses: bool = True,
        action_timer: ActionTimer | None = None,
    ) -> None:
        pipeline_rank = topology.pipeline_rank
        missing = set(schedule.stages_of_rank(pipeline_rank)) - set(stage_modules)
        if missing:
            raise ValueError(f"pipeline rank {pipeline_rank} lacks stage modules {sorted(missing)}")
        self.schedule = schedule
        self.topology = topology
        self.pipeline_rank = pipeline_rank
        self.stage_modules = stage_modules
        self.forward_step_func = forward_step_func
        self.tensor_shape = tuple(tensor_shape)
        self.dtype = dtype
        self.loss_scale_divisor = float(loss_scale_divisor)
        self.grad_sync = grad_sync
        self.device = torch.device(device)
        self.recompute = recompute
        self.scale_loss = scale_loss
        self.recv_lookahead = max(1, recv_lookahead)
        self.deallocate_outputs = deallocate_outputs and not recompute
        self.weight_grad_store_factory = weight_grad_store_factory
        self.gather_losses = gather_losses
        self.action_timer = action_timer
        self._last_grad_action = self._final_gradient_actions()

    def _final_gradient_actions(self) -> dict[int, int]:
        """Index of this rank's last B (last W when split) per stage: its gradient is then final."""
        kind = WEIGHT if self.schedule.split_backward else BACKWARD
        last: dict[int, int] = {}
        for i, action in enumerate(self.schedule.actions[self.pipeline_rank]):
            if action.kind == kind:
                last[action.stage] = i
        return {i: stage for stage, i in last.items()}

    # ------------------------------------------------------------------ one iteration
    def run(self, microbatches: Sequence[Any], forward_only: bool = False) -> IterationResult:
        """Run this rank's actions for one iteration on ``microbatches`` (indexed by global id)."""
        if len(microbatches) != self.schedule.num_microbatches:
            raise ValueError(
                f"expected {self.schedule.num_microbatches} micro-batches, got {len(microbatches)}"
            )
        start = time.perf_counter()
        comm = P2PCommunicator(
            self.schedule, self.pipeline_rank, self.tensor_shape, self.dtype, self.device,
            self.topology, forward_only,
        )
        run = _Iteration(self, comm, microbatches, forward_only)
        try:
            if self.grad_sync is not None and not forward_only:
                self.grad_sync.start_iteration()
            run.execute()
            comm.finish()
            if self.grad_sync is not None and not forward_only:
                self.grad_sync.finish()
            result = IterationResult(
                local_losses={m: _as_float_dict(d) for m, d in run.losses.items()},
                busy_seconds=run.timer.total(),
                iteration_seconds=time.perf_counter() - start, executed=run.executed,
            )
            if self.gather_losses and dist.is_initialized():
                self._gather(result)
        except Exception as exc:
            raise self._failure(exc, run.current) from exc
        return result

    def _failure(self, exc: BaseException, action: Action | None) -> PipelineFailure:
        rank = dist.get_rank() if dist.is_initialized() else self.pipeline_rank
        where = f" in {action.short()}" if action is not None else ""
        return pipeline_failure(f"rank {rank} (pipeline rank {self.pipeline_rank}) failed{where}: "
                                f"{type(exc).__name__}: {exc}")

    def _gather(self, result: IterationResult) -> None:
        """Collect per-micro-batch losses and busy seconds of every rank on the last global rank."""
        world, me = dist.get_world_size(), dist.get_rank()
        payload = (self.topology.data_parallel_rank, result.local_losses, result.busy_seconds)
        logging_rank = world - 1
        gathered: list[Any] | None = [None] * world if me == logging_rank else None
        dist.gather_object(payload, gathered, dst=logging_rank)
        if gathered is None:
            return
        by_replica: dict[int, dict[int, dict[str, float]]] = {}
        for dp, losses, _ in gathered:
            by_replica.setdefault(dp, {}).update(losses)
        result.losses = [by_replica[dp][m] for dp in sorted(by_replica)
                         for m in sorted(by_replica[dp])]
        result.busy_seconds_per_rank = [busy for _, _, busy in gathered]


class _Iteration:
    """Mutable state of one ``PipelineExecutor.run`` (saved tensors, stores, losses, timing)."""

    def __init__(self, executor: PipelineExecutor, comm: P2PCommunicator,
                 microbatches: Sequence[Any], forward_only: bool) -> None:
        self.ex = executor
        self.comm = comm
        self.microbatches = microbatches
        self.forward_only = forward_only
        self.actions = iteration_actions(executor.schedule, executor.pipeline_rank, forward_only)
        self.last_stage = executor.schedule.num_stages - 1
        self.saved: dict[tuple[int, int, int], SavedForward] = {}
        self.stores: dict[tuple[int, int, int], WeightGradStore] = {}
        self.to_deallocate: list[tuple[dist.Work, torch.Tensor]] = []
        self.losses: dict[int, dict[str, Any]] = {}
        self.executed: list[Action] = []
        self.timer = _BusyTimer(executor.device, executor.action_timer)
        self.current: Action | None = None

    def execute(self) -> None:
        """Walk the action list; report finished stages to the gradient synchronizer."""
        for action in self.actions[:self.ex.recv_lookahead]:
            self.comm.prefetch(action)
        final = {} if self.forward_only else self.ex._last_grad_action
        for i, action in enumerate(self.actions):
            self.current = action
            if i + self.ex.recv_lookahead < len(self.actions):
                self.comm.prefetch(self.actions[i + self.ex.recv_lookahead])
            self._release_sent_outputs()
            if action.kind == FORWARD:
                self._forward(action)
            elif action.kind == BACKWARD:
                self._backward(action)
            else:
                self._weight(action)
            self.executed.append(action)
            if i in final and self.ex.grad_sync is not None:
                self.ex.grad_sync.stage_done(final[i])
        self.current = None

    def _release_sent_outputs(self) -> None:
        """Free the data of forward outputs whose sends completed (oldest first)."""
        self.comm.release_completed_sends()
        done = 0
        while done < len(self.to_deallocate) and self.to_deallocate[done][0].is_completed():
            deallocate_output_tensor(self.to_deallocate[done][1])
            done += 1
        del self.to_deallocate[:done]

    def _batch(self, microbatch: int) -> Any:
        return self.microbatches[microbatch]

    def _run_forward(self, action: Action, input_tensor: torch.Tensor | None):
        module = self.ex.stage_modules[action.stage]
        if action.stage > 0:
            module.set_input_tensor(input_tensor)
        return self.ex.forward_step_func(self._batch(action.microbatch), module)

    def _forward(self, action: Action) -> None:
        ex = self.ex
        input_tensor = None
        if action.stage > 0:
            input_tensor = self.comm.recv(action)
            input_tensor.requires_grad_(not self.forward_only)
        keep_graph = not self.forward_only and not ex.recompute
        rng_state = _rng_state(ex.device) if ex.recompute and not self.forward_only else None
        with self.timer.measure(action), torch.set_grad_enabled(keep_graph):
            output, loss_func = self._run_forward(action, input_tensor)
            if action.stage == self.last_stage:
                loss, stats = loss_func(output)
                self.losses[action.microbatch] = {  # converted after the iteration (no sync)
                    k: v.detach() if torch.is_tensor(v) else v for k, v in stats.items()
                }
                output = loss
        work = None
        if action.stage < self.last_stage:
            work = self.comm.send(action, output)
        if self.forward_only:
            return
        key = (action.pipe, action.stage, action.microbatch)
        if ex.recompute:
            self.saved[key] = SavedForward(input_tensor, None, rng_state)
        else:
            self.saved[key] = SavedForward(input_tensor, output, None)
            if ex.deallocate_outputs and work is not None:
                self.to_deallocate.append((work, output))

    def _recompute(self, action: Action, input_tensor: torch.Tensor | None, rng_state):
        if input_tensor is not None:
            input_tensor = input_tensor.detach().requires_grad_(True)
        with _restored_rng(rng_state, self.ex.device), torch.enable_grad():
            output, loss_func = self._run_forward(action, input_tensor)
            if action.stage == self.last_stage:
                output, _ = loss_func(output)
        return input_tensor, output

    def _backward(self, action: Action) -> None:
        ex = self.ex
        key = (action.pipe, action.stage, action.microbatch)
        input_tensor, output, rng_state = self.saved.pop(key)
        grad_output = self.comm.recv(action) if action.stage < self.last_stage else None
        module = ex.stage_modules[action.stage]
        defer = contextlib.nullcontext()
        if ex.schedule.split_backward:
            store = self.stores[key] = ex.weight_grad_store_factory()
            defer = defer_weight_grad(module, store)
        with self.timer.measure(action), defer:
            if ex.recompute:
                input_tensor, output = self._recompute(action, input_tensor, rng_state)
            if grad_output is None:
                loss = output / ex.loss_scale_divisor
                if ex.scale_loss is not None:
                    loss = ex.scale_loss(loss)
                loss.backward()
            else:
                custom_backward(output, grad_output)
        if action.stage > 0:
            grad = input_tensor.grad
            if grad is None:
                grad = torch.zeros(ex.tensor_shape, dtype=ex.dtype, device=ex.device)
            self.comm.send(action, grad)

    def _weight(self, action: Action) -> None:
        store = self.stores.pop((action.pipe, action.stage, action.microbatch))
        with self.timer.measure(action):
            store.flush()


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _restored_rng(state: tuple | None, device: torch.device):
    """Replay the forward's random stream (dropout) during recomputation, then restore."""
    if state is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield
