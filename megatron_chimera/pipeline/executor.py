"""Runs one rank's lowered action list of any :class:`Schedule` with real stage modules.

The schedule is lowered once per mode (training, forward-only) into per-rank lists with
explicit ``SEND`` and ``RECV`` operations (:mod:`megatron_chimera.schedules.lowering`), checked
against NCCL's rules (:func:`~megatron_chimera.schedules.validate.validate_lowered`), and
executed as it stands: a ``RECV`` posts the receive, a compute action waits for the message it
consumes, a ``SEND`` posts the output of the action before it. Before the first iteration every
direction of the rank is connected once, in one global order (NCCL blocks at a first exchange).

``F`` runs ``forward_step_func(batch, model)`` (the stage input set with ``set_input_tensor``),
computes the loss at the last stage; ``B`` back-propagates the received output gradient (or the
scaled loss); ``W`` (split backward) computes the weight gradients its ``B`` queued.

Loss scaling: each micro-batch loss is divided by ``loss_scale_divisor = N x W`` before its
backward, and :class:`GradientSynchronizer` SUMs gradients over each stage-replica group, so every
replica ends with the mean gradient over the ``B x N x W`` samples of the mini-batch. The
synchronizer hears when this rank's last backward (or W) of a stage begins and ends, so that it
can reduce buckets while that backward still runs (``--overlap-grad-reduce``). It also sums the
gradients of sequence-parallel parameters (partial on each tensor-parallel rank) over the
tensor-parallel group, bucket by bucket before the bucket's reduction
(:func:`~megatron_chimera.tensor_parallel.allreduce_sequence_parallel_grads`).

Tensor parallelism is invisible to the lists: the T ranks of a tensor-parallel group run the same
list, exchange messages only with the equal tensor rank of their neighbours, and meet in the
collectives inside their forward and backward computations (and the synchronizer's) in the same
order.

Losses and busy times stay on the device (no host sync per iteration); :meth:`gather` brings the
results of any number of iterations to the logging rank (the last global rank, Megatron's
convention) in one collective, at log intervals.

Failures: an exception on any rank is recorded in the c10d store before it propagates; a rank
whose communication then fails raises :class:`~.failures.PipelineFailure` naming the rank that
failed first (:mod:`.failures`). Where the rank sits comes from an injected
:class:`~.topology.PipelineTopology`, how messages move from a :class:`~.transport.Transport`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from megatron_chimera.model.linear import WeightGradStore, defer_weight_grad
from megatron_chimera.pipeline.failures import PipelineFailure, pipeline_failure
from megatron_chimera.pipeline.grad_sync import GradientSynchronizer
from megatron_chimera.pipeline.p2p import P2PCommunicator
from megatron_chimera.pipeline.topology import PipelineTopology
from megatron_chimera.pipeline.transport import Transport, make_transport
from megatron_chimera.schedules.actions import BACKWARD, FORWARD, WEIGHT, Action, Schedule
from megatron_chimera.schedules.lowering import (
    ACTIVATION,
    DEFAULT_LOOKAHEAD,
    SEND,
    Comm,
    LoweredSchedule,
    Message,
    connection_order,
    lower,
    needed_message,
    produced_message,
)
from megatron_chimera.schedules.validate import validate_lowered
from megatron_chimera.tensor_parallel import get_cuda_rng_tracker
from megatron_chimera.tensor_parallel.random import restored_tracker_states

ForwardStepFunc = Callable[[Any, nn.Module], tuple[torch.Tensor, Callable]]
__all__ = ["PipelineExecutor", "PipelineFailure", "IterationResult", "GatheredIteration",
           "ForwardStepFunc", "ActionTimer"]


class SavedForward(NamedTuple):
    """What a forward leaves for its backward: the stage input (with ``requires_grad``), and
    either the output (stored activations) or the RNG state to replay it (recomputation)."""

    input_tensor: torch.Tensor | None
    output: torch.Tensor | None
    rng_state: tuple | None


@dataclass
class IterationResult:
    """What one iteration left on this rank: per micro-batch losses (device tensors, on ranks
    holding a last stage), the busy timer, wall seconds, the executed compute order and the
    point-to-point payload bytes this rank sent."""

    local_losses: dict[int, dict[str, Any]]
    busy: _BusyTimer
    iteration_seconds: float
    executed: list[Action]
    p2p_bytes_sent: int = 0


@dataclass
class GatheredIteration:
    """One iteration's figures on the logging rank: losses of every micro-batch (ordered by
    data-parallel rank, then micro-batch) and every rank's compute-busy seconds."""

    losses: list[dict[str, float]]
    busy_seconds_per_rank: list[float]


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
    """Sums compute time: wall clock on CPU, CUDA events on GPU (read when gathered, so no
    host-device sync happens during the iteration). With an ``action_timer`` it also reports
    each compute action's seconds (on GPU when the events are read: the executor reads them at
    the end of a timed iteration)."""

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
        """Busy seconds (synchronises the device on CUDA: call at log intervals)."""
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
    """Executes this rank's lowered list of ``schedule`` for one iteration at a time.

    ``topology`` says where this rank sits; ``stage_modules`` maps every stage this rank holds to
    its module (one module per stage, shared by the pipes that visit it); ``tensor_shape`` and
    ``dtype`` describe every p2p message (``[seq, micro_batch, hidden]``);
    ``loss_scale_divisor`` is ``N x W``; ``grad_sync`` is None for evaluation-only use;
    ``scale_loss`` is the fp16 grad scaler's hook; ``recompute`` keeps only stage inputs and
    re-runs the forward at B; ``weight_grad_store_factory`` makes the store of each split
    backward (W); ``transport`` moves the messages (default: :func:`make_transport`);
    ``recv_lookahead`` is how many compute actions early a receive is posted when NCCL's rules
    allow it; ``safe_posting=False`` ignores those rules (only to show that tests catch it);
    ``action_timer(action, seconds)``, when set (it may be set or cleared between iterations),
    receives the compute time of every F, B and W -- compute only, never a SEND, a RECV or a
    wait for a message (the profiler's hook, :mod:`~megatron_chimera.pipeline.profiler`); on
    CUDA the iteration's times are then read at its end (one device sync per timed iteration).
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
        recv_lookahead: int = DEFAULT_LOOKAHEAD,
        deallocate_outputs: bool = True,
        weight_grad_store_factory: Callable[[], WeightGradStore] = WeightGradStore,
        transport: Transport | None = None,
        warm_up: bool = True,
        safe_posting: bool = True,
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
        self.deallocate_outputs = deallocate_outputs and not recompute
        self.weight_grad_store_factory = weight_grad_store_factory
        self.transport = transport or make_transport(
            topology, lambda m: m.tag(schedule.num_pipes, schedule.num_microbatches))
        self.lowered = {mode: lower(schedule, mode, recv_lookahead, safe_posting)
                        for mode in (False, True)}
        if safe_posting:
            for lowered in self.lowered.values():
                validate_lowered(lowered, ranks=[pipeline_rank])
        self._connected = not warm_up
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

    def connect(self) -> None:
        """Exchange one tiny message in every direction of the schedule that the transport has
        not connected yet, in the one global order every rank follows (a no-op after the first
        call). A schedule rebuilt at run time gets new executors on the same transport: only a
        direction the running schedule never used is connected then."""
        if self._connected:
            return
        for src, dst in connection_order(*self.lowered.values()):
            self.transport.connect(src, dst)
        self._connected = True

    # ------------------------------------------------------------------ one iteration
    def run(self, microbatches: Sequence[Any], forward_only: bool = False) -> IterationResult:
        """Run this rank's list for one iteration on ``microbatches`` (indexed by global id)."""
        if len(microbatches) != self.schedule.num_microbatches:
            raise ValueError(
                f"expected {self.schedule.num_microbatches} micro-batches, got {len(microbatches)}"
            )
        start = time.perf_counter()
        comm = P2PCommunicator(self.transport, self.tensor_shape, self.dtype, self.device)
        run = _Iteration(self, comm, microbatches, self.lowered[forward_only])
        try:
            self.connect()
            self.transport.begin_iteration()
            if self.grad_sync is not None and not forward_only:
                self.grad_sync.start_iteration()
            run.execute()
            comm.finish()
            if self.grad_sync is not None and not forward_only:
                self.grad_sync.finish()
            if run.timer.action_timer is not None:
                run.timer.total()  # the action timer gets this iteration's times now
        except Exception as exc:
            raise self._failure(exc, run.current) from exc
        return IterationResult(local_losses=run.losses, busy=run.timer,
                               iteration_seconds=time.perf_counter() - start,
                               executed=run.executed, p2p_bytes_sent=comm.bytes_sent)

    def _failure(self, exc: BaseException, op: Any) -> PipelineFailure:
        rank = dist.get_rank() if dist.is_initialized() else self.pipeline_rank
        where = f" in {op.short()}" if op is not None else ""
        return pipeline_failure(f"rank {rank} (pipeline rank {self.pipeline_rank}) failed{where}: "
                                f"{type(exc).__name__}: {exc}")

    def gather(self, results: Sequence[IterationResult]) -> list[GatheredIteration] | None:
        """Losses and busy seconds of ``results`` (the same iterations on every rank) on the
        logging rank, in one collective; None elsewhere. Syncs the device: call it at log
        intervals."""
        local = [({m: _as_float_dict(d) for m, d in r.local_losses.items()}, r.busy.total())
                 for r in results]
        if not dist.is_initialized():
            return [_merge([(0, losses, busy)]) for losses, busy in local]
        world, me = dist.get_world_size(), dist.get_rank()
        payload = (self.topology.data_parallel_rank, local)
        logging_rank = world - 1
        gathered: list[Any] | None = [None] * world if me == logging_rank else None
        dist.gather_object(payload, gathered, dst=logging_rank)
        if gathered is None:
            return None
        return [_merge([(dp, per_rank[i][0], per_rank[i][1]) for dp, per_rank in gathered])
                for i in range(len(results))]


def _merge(per_rank: list[tuple[int, dict[int, dict[str, float]], float]]) -> GatheredIteration:
    by_replica: dict[int, dict[int, dict[str, float]]] = {}
    for dp, losses, _ in per_rank:
        by_replica.setdefault(dp, {}).update(losses)
    losses = [by_replica[dp][m] for dp in sorted(by_replica) for m in sorted(by_replica[dp])]
    return GatheredIteration(losses, [busy for _, _, busy in per_rank])


class _Iteration:
    """Mutable state of one ``PipelineExecutor.run`` (saved tensors, stores, losses, timing)."""

    def __init__(self, executor: PipelineExecutor, comm: P2PCommunicator,
                 microbatches: Sequence[Any], lowered: LoweredSchedule) -> None:
        self.ex = executor
        self.comm = comm
        self.microbatches = microbatches
        self.ops = lowered.lists[executor.pipeline_rank]
        self.forward_only = lowered.forward_only
        self.last_stage = executor.schedule.num_stages - 1
        self.saved: dict[tuple[int, int, int], SavedForward] = {}
        self.stores: dict[tuple[int, int, int], WeightGradStore] = {}
        self.outbox: dict[Message, torch.Tensor] = {}
        self.to_deallocate: list[tuple[Any, torch.Tensor]] = []
        self.losses: dict[int, dict[str, Any]] = {}
        self.executed: list[Action] = []
        self.timer = _BusyTimer(executor.device, executor.action_timer)
        self.current: Any = None

    def execute(self) -> None:
        """Walk the lowered list; report finished stages to the gradient synchronizer."""
        final = {} if self.forward_only else self.ex._last_grad_action
        sync_point = self.ex.transport.sync_point
        for op in self.ops:
            self.current = op
            if isinstance(op, Comm):
                if op.op == SEND:
                    self._send(op.message)
                else:
                    self.comm.post_recv(op.message)
                continue
            sync_point(op.short())
            self._release_sent_outputs()
            index = len(self.executed)
            last_of_stage = final.get(index) if self.ex.grad_sync is not None else None
            if last_of_stage is not None:
                self.ex.grad_sync.final_action_begins(last_of_stage)
            if op.kind == FORWARD:
                self._forward(op)
            elif op.kind == BACKWARD:
                self._backward(op)
            else:
                self._weight(op)
            self.executed.append(op)
            if last_of_stage is not None:
                self.ex.grad_sync.stage_done(last_of_stage)
        self.current = None

    def _send(self, message: Message) -> None:
        output = self.outbox.pop(message)
        work = self.comm.send(message, output)
        if self.ex.deallocate_outputs and message.direction == ACTIVATION:
            self.to_deallocate.append((work, output))

    def _deliver(self, action: Action, tensor: torch.Tensor) -> None:
        """Hand ``action``'s output to the consumer: locally, or to the SEND that follows."""
        message = produced_message(self.ex.schedule, action)
        if message is None:
            return
        if message.dst == self.ex.pipeline_rank:
            self.comm.put_local(message, tensor)
        else:
            self.outbox[message] = tensor

    def _receive(self, action: Action) -> torch.Tensor:
        return self.comm.take(needed_message(self.ex.schedule, action))

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
            input_tensor = self._receive(action)
            input_tensor.requires_grad_(not self.forward_only)
        keep_graph = not self.forward_only and not ex.recompute
        rng_state = _rng_state(ex.device) if ex.recompute and not self.forward_only else None
        with self.timer.measure(action), torch.set_grad_enabled(keep_graph):
            output, loss_func = self._run_forward(action, input_tensor)
            if action.stage == self.last_stage:
                loss, stats = loss_func(output)
                self.losses[action.microbatch] = {  # converted when gathered (no sync)
                    k: v.detach() if torch.is_tensor(v) else v for k, v in stats.items()
                }
                output = loss
        if action.stage < self.last_stage:
            self._deliver(action, output)
        if self.forward_only:
            return
        key = (action.pipe, action.stage, action.microbatch)
        if ex.recompute:
            self.saved[key] = SavedForward(input_tensor, None, rng_state)
        else:
            self.saved[key] = SavedForward(input_tensor, output, None)

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
        grad_output = self._receive(action) if action.stage < self.last_stage else None
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
            self._deliver(action, grad)

    def _weight(self, action: Action) -> None:
        store = self.stores.pop((action.pipe, action.stage, action.microbatch))
        with self.timer.measure(action):
            store.flush()


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda, get_cuda_rng_tracker().get_states()


@contextlib.contextmanager
def _restored_rng(state: tuple | None, device: torch.device):
    """Replay the forward's random streams (dropout: the default generator and the
    tensor-parallel tracker's) during recomputation, then restore."""
    if state is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), restored_tracker_states(state[2]):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield
