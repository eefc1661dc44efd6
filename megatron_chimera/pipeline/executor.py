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

The host's cost per action is kept small: each rank's lowered list is compiled once per mode
(:mod:`.program`: messages, labels, buffer lifetimes, batches), receive buffers come from a pool
and are reused once nothing reads them (:class:`~.p2p.BufferPool`), the busy timer is two clock
reads (CPU) or two recorded events from a reused pool (CUDA), and a sent tensor is let go as soon
as its send is posted (the backend holds it until sent; an activation keeps only its ``grad_fn``).

Failures: an exception on any rank is recorded in the c10d store before it propagates; a rank
whose communication then fails raises :class:`~.failures.PipelineFailure` naming the rank that
failed first (:mod:`.failures`). Where the rank sits comes from an injected
:class:`~.topology.PipelineTopology`, how messages move from a :class:`~.transport.Transport`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from megatron_chimera.model.moe.aux_loss import moe_routers
from megatron_chimera.model.moe.expert_comm import BackwardTape
from megatron_chimera.parallel_state import (
    get_expert_model_parallel_world_size,
    nccl_semantics_requested,
)
from megatron_chimera.pipeline.busy_timer import ActionTimer, BusyTimer, injected_slowdown
from megatron_chimera.pipeline.executor_config import (
    ExecutorPolicy,
    ForwardStepFunc,
    Gradients,
    StageWork,
)
from megatron_chimera.pipeline.expert_order import check_issued, stage_layouts
from megatron_chimera.pipeline.failures import PipelineFailure, pipeline_failure
from megatron_chimera.pipeline.nccl_semantics import NcclSemanticsTransport
from megatron_chimera.pipeline.overlap import Half, PairRuntime, leading_half
from megatron_chimera.pipeline.p2p import (
    P2PCommunicator,
    deallocate_output_tensor,
    uniform_specs,
)
from megatron_chimera.pipeline.program import Compute, Paired, Post, Program, compile_program
from megatron_chimera.pipeline.stage_state import (
    SavedForward,
    custom_backward,
    restored_rng,
    saved_rng_state,
    taping,
)
from megatron_chimera.pipeline.topology import PipelineTopology
from megatron_chimera.pipeline.transport import Transport
from megatron_chimera.schedules.actions import BACKWARD, FORWARD, Action, Schedule
from megatron_chimera.schedules.device_sync_check import ExpertComm, plan_gradient_collectives
from megatron_chimera.schedules.expert_ops import expert_ops
from megatron_chimera.schedules.lowering import (
    ACTIVATION,
    SEND,
    Message,
    connection_order,
    lower,
)
from megatron_chimera.schedules.shapes import check_sized_lists
from megatron_chimera.schedules.validate import validate_lowered
from megatron_chimera.tensor_parallel.weight_grad import (
    WeightGradStore,
    defer_weight_grad,
    deferrable_modules,
    set_weight_grad_deferral,
)

__all__ = ["PipelineExecutor", "StageWork", "Gradients", "ExecutorPolicy", "PipelineFailure",
           "IterationResult", "GatheredIteration", "ForwardStepFunc", "ActionTimer",
           "make_transport", "deallocate_output_tensor", "custom_backward"]


@dataclass
class IterationResult:
    """What one iteration left on this rank: per micro-batch losses (device tensors, on ranks
    holding a last stage), the busy timer, wall seconds, the executed compute order and the
    point-to-point payload bytes this rank sent."""

    local_losses: dict[int, dict[str, Any]]
    busy: BusyTimer
    iteration_seconds: float
    executed: list[Action]
    p2p_bytes_sent: int = 0


@dataclass
class GatheredIteration:
    """One iteration's figures on the logging rank: losses of every micro-batch (ordered by
    data-parallel rank, then micro-batch) and every rank's compute-busy seconds, in all and
    per action kind."""

    losses: list[dict[str, float]]
    busy_seconds_per_rank: list[float]
    busy_by_kind_per_rank: list[dict[str, float]] = field(default_factory=list)


def make_transport(topology: PipelineTopology, tag_of: Any = None) -> Transport:
    """The transport of this process: NCCL semantics on gloo when the test harness asks for them
    (``MEGATRON_CHIMERA_NCCL_SEMANTICS=1``), else plain."""
    if nccl_semantics_requested() and dist.is_initialized() and dist.get_backend() == "gloo":
        return NcclSemanticsTransport(topology)
    return Transport(topology, tag_of)
_NO_CHANGE = contextlib.nullcontext()  # the grad mode is already the one wanted (reusable)


def _as_float_dict(stats: dict[str, Any]) -> dict[str, float]:
    return {k: float(v.detach().float().mean()) if torch.is_tensor(v) else float(v)
            for k, v in stats.items()}


class PipelineExecutor:
    """Executes this rank's lowered list of ``schedule`` for one iteration at a time.

    ``topology`` says where this rank sits, ``work`` what it runs (:class:`StageWork`),
    ``gradients`` how losses and gradients are treated (:class:`Gradients`; the default suits
    evaluation), ``policy`` how the lists are posted (:class:`ExecutorPolicy`); ``transport``
    moves the messages (default: :func:`make_transport`). ``action_timer(action, seconds)``,
    when set (it may be set or cleared between iterations), receives the compute time of every
    F, B and W -- compute only, never a SEND, a RECV or a wait for a message (the profiler's
    hook, :mod:`~megatron_chimera.pipeline.profiler`); on CUDA the iteration's times are then
    read at its end (one device sync per timed iteration).
    """

    def __init__(
        self,
        schedule: Schedule,
        topology: PipelineTopology,
        work: StageWork,
        gradients: Gradients = Gradients(),  # noqa: B008 - frozen records
        policy: ExecutorPolicy = ExecutorPolicy(),  # noqa: B008
        transport: Transport | None = None,
        action_timer: ActionTimer | None = None,
    ) -> None:
        pipeline_rank = topology.pipeline_rank
        missing = set(schedule.stages_of_rank(pipeline_rank)) - set(work.modules)
        if missing:
            raise ValueError(f"pipeline rank {pipeline_rank} lacks stage modules {sorted(missing)}")
        self.schedule = schedule
        self.topology = topology
        self.pipeline_rank = pipeline_rank
        self.stage_modules = work.modules
        self.forward_step_func = work.forward_step_func
        self.tensor_shape = tuple(work.tensor_shape)
        self.dtype = work.dtype
        self.device = torch.device(work.device)
        self.recompute = work.recompute
        self.loss_scale_divisor = float(gradients.loss_scale_divisor)
        self.grad_sync = gradients.grad_sync
        self.scale_loss = gradients.scale_loss
        self.weight_grad_store_factory = gradients.weight_grad_store_factory
        self.deallocate_outputs = policy.deallocate_outputs and not work.recompute
        self.overlap_pairs = policy.overlap_pairs
        self.time_kinds = policy.time_kinds
        # the rank's MoE layers reach their all-to-alls through the paired runtime; with pairs
        # every training backward runs in pieces cut at them (overlap on or off: same sums)
        self.pair_runtime = PairRuntime(self.device)
        self.cut_backward = any(schedule.pairs)
        # (handed at every run: another executor of the same modules, e.g. evaluation's, may
        # have handed its own meanwhile)
        self._comm_users = [sub for module in work.modules.values() for sub in module.modules()
                            if hasattr(sub, "set_expert_comm")]
        self.transport = transport or make_transport(
            topology, lambda m: m.tag(schedule.num_pipes, schedule.num_microbatches))
        safe_posting = policy.safe_posting
        self.lowered = {mode: lower(schedule, mode, policy.recv_lookahead, safe_posting)
                        for mode in (False, True)}
        # the expert all-to-alls as lowered ops: the NCCL-semantics mode proves this rank's
        # list with them and checks each iteration's against them (schedules/expert_ops.py)
        layouts = stage_layouts(work.modules) if nccl_semantics_requested() else None
        self.expert_ops = {mode: expert_ops(lowered, pipeline_rank, layouts, self.recompute,
                                            self.overlap_pairs)
                           for mode, lowered in self.lowered.items()} if layouts else None
        experts = (ExpertComm({pipeline_rank: self.expert_ops[False]},
                              get_expert_model_parallel_world_size()) if self.expert_ops else None)
        overlap = self.grad_sync is not None and self.grad_sync.overlap_grad_reduce
        plan = None
        if safe_posting:
            plan = validate_lowered(self.lowered[False], [pipeline_rank], overlap,
                                    gradient_collectives=self.grad_sync is not None,
                                    experts=experts)
            validate_lowered(self.lowered[True], [pipeline_rank])
        elif self.grad_sync is not None:  # (the collectives' plan of the safe lowering)
            plan = plan_gradient_collectives(
                lower(schedule, False, policy.recv_lookahead, True), overlap)
        # gradient collectives issued only at the end of the iteration (see the plan)
        self.deferred_collectives = plan.deferred if plan is not None else frozenset()
        self.programs: dict[bool, Program] = {
            mode: compile_program(lowered, pipeline_rank) for mode, lowered in self.lowered.items()}
        self.comm = P2PCommunicator(self.transport, uniform_specs(self.tensor_shape, self.dtype),
                                    self.device)
        self._linears = {s: deferrable_modules(m) for s, m in work.modules.items()}
        self._routers = moe_routers(work.modules.values())  # MoE layers' auxiliary losses
        self._events: list[Any] = []  # CUDA events of the busy timers, reused
        self._connected = not policy.warm_up
        self.action_timer = action_timer
        self.slowdown = injected_slowdown(dist.get_rank() if dist.is_initialized() else 0)
        self.tracer: Any = None  # set for a traced iteration (:mod:`.chrome_trace`)
        self.active: _Iteration | None = None  # the running iteration (read by :mod:`.hang`)

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
    def run(self, microbatches: Sequence[Any], forward_only: bool = False,
            microbatch_tokens: Sequence[int] | None = None) -> IterationResult:
        """Run this rank's list for one iteration on ``microbatches`` (indexed by global id);
        ``microbatch_tokens`` (variable-length micro-batches) gives every micro-batch's message
        length (first dimension), known on every rank, so no shape is exchanged."""
        if len(microbatches) != self.schedule.num_microbatches:
            raise ValueError(
                f"expected {self.schedule.num_microbatches} micro-batches, got {len(microbatches)}"
            )
        if microbatch_tokens is not None and len(microbatch_tokens) != len(microbatches):
            raise ValueError(f"{len(microbatch_tokens)} micro-batch token counts for "
                             f"{len(microbatches)} micro-batches")
        self.comm.set_tokens(microbatch_tokens)
        if microbatch_tokens is not None and nccl_semantics_requested():
            check_sized_lists(self.lowered[forward_only], microbatch_tokens)
        start = time.perf_counter()
        if not forward_only:  # split backwards need deferrable forwards; others, torch's own
            for linears in self._linears.values():
                set_weight_grad_deferral(linears, self.schedule.split_backward)
        for user in self._comm_users:
            user.set_expert_comm(self.pair_runtime)
        run = self.active = _Iteration(self, microbatches, self.programs[forward_only])
        try:
            self.connect()
            self.transport.begin_iteration()
            self.comm.begin_iteration()
            if self.grad_sync is not None and not forward_only:
                self.grad_sync.start_iteration(self.transport.collective_issued,
                                               self.deferred_collectives)
            if self._routers and not forward_only:
                self._set_aux_loss_scale()
            issued = self._expert_ops_begin()
            run.execute()
            if issued is not None:
                check_issued(self.expert_ops[forward_only], self.pair_runtime.issued[issued:],
                             self.pipeline_rank)
            self.comm.finish()
            if self.grad_sync is not None and not forward_only:
                waited = time.perf_counter()
                self.grad_sync.finish()
                if self.tracer is not None:
                    self.tracer.span("gradient reductions: wait", "grad-reduction", waited,
                                     time.perf_counter())
            if run.timer.action_timer is not None or self.tracer is not None:
                run.timer.total()  # the action timer / tracer get this iteration's times now
        except Exception as exc:
            raise self._failure(exc, run.current) from exc
        finally:
            self.active = None
        return IterationResult(local_losses=run.losses, busy=run.timer,
                               iteration_seconds=time.perf_counter() - start,
                               executed=run.executed, p2p_bytes_sent=self.comm.bytes_sent)

    def _expert_ops_begin(self) -> int | None:
        """Where this iteration's all-to-all labels start (None: not checked)."""
        if self.expert_ops is None:
            return None
        if self.pair_runtime.issued is None:
            self.pair_runtime.issued = []
        return len(self.pair_runtime.issued)

    def _set_aux_loss_scale(self) -> None:
        """The MoE auxiliary losses get the main loss's factor: 1 / (N x W), times the fp16 loss
        scale (:mod:`megatron_chimera.model.moe.aux_loss`)."""
        scale = 1.0 / self.loss_scale_divisor
        if self.scale_loss is not None:
            scale *= float(self.scale_loss(torch.ones((), device=self.device)))
        for router in self._routers:
            router.aux_loss_scale = scale

    def _failure(self, exc: BaseException, op: Any) -> PipelineFailure:
        rank = dist.get_rank() if dist.is_initialized() else self.pipeline_rank
        where = f" in {op.short()}" if op is not None else ""
        return pipeline_failure(f"rank {rank} (pipeline rank {self.pipeline_rank}) failed{where}: "
                                f"{type(exc).__name__}: {exc}")

    def gather(self, results: Sequence[IterationResult]) -> list[GatheredIteration] | None:
        """Losses and busy seconds of ``results`` (the same iterations on every rank) on the
        logging rank, in one collective; None elsewhere. Syncs the device: call it at log
        intervals."""
        local = [({m: _as_float_dict(d) for m, d in r.local_losses.items()}, r.busy.total(),
                  r.busy.by_kind) for r in results]
        if not dist.is_initialized():
            return [_merge([(0, *figures)]) for figures in local]
        world, me = dist.get_world_size(), dist.get_rank()
        payload = (self.topology.data_parallel_rank, local)
        logging_rank = world - 1
        gathered: list[Any] | None = [None] * world if me == logging_rank else None
        dist.gather_object(payload, gathered, dst=logging_rank)
        if gathered is None:
            return None
        return [_merge([(dp, *per_rank[i]) for dp, per_rank in gathered])
                for i in range(len(results))]


def _merge(per_rank: list[tuple[int, dict[int, dict[str, float]], float, dict[str, float]]]
           ) -> GatheredIteration:
    by_replica: dict[int, dict[int, dict[str, float]]] = {}
    for dp, losses, _, _ in per_rank:
        by_replica.setdefault(dp, {}).update(losses)
    losses = [by_replica[dp][m] for dp in sorted(by_replica) for m in sorted(by_replica[dp])]
    return GatheredIteration(losses, [busy for _, _, busy, _ in per_rank],
                             [kinds for _, _, _, kinds in per_rank])


class _Iteration:
    """Mutable state of one ``PipelineExecutor.run`` (saved tensors, stores, losses, timing)."""

    def __init__(self, executor: PipelineExecutor, microbatches: Sequence[Any],
                 program: Program) -> None:
        self.ex = executor
        self.comm = executor.comm
        self.microbatches = microbatches
        self.program = program
        self.forward_only = program.forward_only
        self.last_stage = executor.schedule.num_stages - 1
        self.saved: dict[tuple[int, int, int], SavedForward] = {}
        self.stores: dict[tuple[int, int, int], WeightGradStore] = {}
        self.outbox: dict[Message, torch.Tensor] = {}
        self.releasing: tuple[Message, ...] = ()  # buffers of the previous action (see _compute)
        self.losses: dict[int, dict[str, Any]] = {}
        self.executed: list[Action] = []
        self.timer = BusyTimer(executor.device, executor._events, executor.action_timer,
                               executor.tracer, executor.slowdown, executor.time_kinds)
        self.current: Any = None
        self.stage_done: tuple[int, ...] = ()  # finished stages not yet reported (_compute)
        transport = executor.transport  # calls that would do nothing are not made at all:
        self.sync_point = transport.sync_point if transport.has_sync_points else None

    def execute(self) -> None:
        """Walk the compiled steps."""
        comm = self.comm
        for step in self.program.steps:
            self.current = step
            if type(step) is Post:
                if step.op == SEND:
                    for message in step.messages:
                        self._send(message)
                else:
                    comm.post_recvs(step.messages)
            elif type(step) is Paired:
                self._paired(step)
            else:
                self._compute(step)
        if self.stage_done:
            self._report_stage_done()
        self.current = None

    def _compute(self, step: Compute) -> None:
        """One compute action; report finished stages to the gradient synchronizer. The buffers
        the previous action freed go back to the pool only now, after its sends were posted (a
        send of a view of one pins it, see :meth:`.P2PCommunicator.send`)."""
        if self.stage_done:
            self._report_stage_done()
        if self.sync_point is not None:
            self.sync_point(step.label)
        if self.releasing:
            release = self.comm.release
            for message in self.releasing:
                release(message)
        self.releasing = step.releases
        sync = self.ex.grad_sync if step.final_stage is not None else None
        if sync is not None:
            sync.final_action_begins(step.final_stage)
        self._run_action(step)
        self.executed.append(step.action)
        if sync is not None:  # reported after this action's sends are posted
            self.stage_done = (step.final_stage,)

    def _run_action(self, step: Compute) -> None:
        self.ex.pair_runtime.run_alone(self._half(step))

    def _half(self, step: Compute) -> Half:
        """``step`` as a half of the paired runtime: F a driver, B and W lists of pieces."""
        kind = step.action.kind
        if kind == FORWARD:
            return Half(step.action, lambda: self._forward(step), False)
        if kind == BACKWARD:
            return Half(step.action, lambda: self._backward(step), True)
        return Half(step.action, lambda: self._weight(step), True)

    def _paired(self, step: Paired) -> None:
        """A paired action (F&B, F&F, B&B, or a W with an F or B of another micro-batch): both
        inputs are waited on inside the halves (both receives were posted before the pair),
        each half's all-to-alls overlap the other half's compute (:func:`~.overlap.run_pair`;
        a W computes one weight-gradient entry per all-to-all of its partner), and both
        outputs go to the SENDs that follow. Two backwards of one stage of a split-backward
        schedule share the stage's weight-gradient deferral, so they run one after the other
        (nothing to overlap then); a W only flushes its own store, so it may run beside a B of
        its stage."""
        if self.stage_done:
            self._report_stage_done()
        first, second = step.halves
        if self.sync_point is not None:
            self.sync_point(first.label)
            self.sync_point(second.label)
        if self.releasing:
            release = self.comm.release
            for message in self.releasing:
                release(message)
        self.releasing = first.releases + second.releases
        finals = tuple(h.final_stage for h in step.halves if h.final_stage is not None)
        sync = self.ex.grad_sync if finals else None
        if sync is not None:
            for stage in finals:
                sync.final_action_begins(stage)
        a, b = first.action, second.action
        shared_deferral = (self.ex.schedule.split_backward and a.kind == b.kind == BACKWARD
                           and a.stage == b.stage)
        halves = (self._half(first), self._half(second))
        if self.ex.overlap_pairs and not shared_deferral:
            self.ex.pair_runtime.run_pair(halves, leading_half((a.kind, b.kind)))
        else:  # one half after the other, each on the random streams run_pair gives it
            self.ex.pair_runtime.run_in_turn(halves)
        self.executed += (a, b)
        if sync is not None:  # reported after the pair's sends are posted
            self.stage_done = finals

    def _report_stage_done(self) -> None:
        """Tell the gradient synchronizer that the previous action finished a stage (two for a
        pair): its remaining buckets (and the tied embedding's) are issued now, after that
        action's sends, as the validator's collective check assumes."""
        stages, self.stage_done = self.stage_done, ()
        for stage in stages:
            launched = time.perf_counter()
            self.ex.grad_sync.stage_done(stage)
            if self.ex.tracer is not None:
                self.ex.tracer.span(f"reduce stage {stage}: launch", "grad-reduction", launched,
                                    time.perf_counter(), stage=stage)

    def _send(self, message: Message) -> None:
        output = self.outbox.pop(message)
        free = self.ex.deallocate_outputs and message.direction == ACTIVATION
        self.comm.send(message, output, free)

    def _deliver(self, step: Compute, tensor: torch.Tensor) -> None:
        """Hand ``step``'s output to the consumer: locally, or to the SEND that follows."""
        if step.local:
            self.comm.put_local(step.produces, tensor)
        else:
            self.outbox[step.produces] = tensor

    def _run_forward(self, action: Action, input_tensor: torch.Tensor | None):
        module = self.ex.stage_modules[action.stage]
        if action.stage > 0:
            module.set_input_tensor(input_tensor)
        return self.ex.forward_step_func(self.microbatches[action.microbatch], module)

    def _forward(self, step: Compute) -> None:
        ex, action = self.ex, step.action
        keep_graph = not self.forward_only and not ex.recompute
        rng_state = saved_rng_state(ex.device) if ex.recompute and not self.forward_only else None
        input_tensor = None  # taken late: what needs no input is done before its wait
        if step.needs is not None:
            input_tensor = self.comm.take(step.needs)
            input_tensor.requires_grad_(not self.forward_only)
        grad_mode = (_NO_CHANGE if keep_graph == torch.is_grad_enabled()  # sets it: enter now
                     else torch.set_grad_enabled(keep_graph))
        tape = BackwardTape() if keep_graph and ex.cut_backward else None
        with self.timer(action), grad_mode, self._recording(tape):
            output, loss_func = self._run_forward(action, input_tensor)
            if action.stage == self.last_stage:
                loss, stats = loss_func(output)
                self.losses[action.microbatch] = {  # converted when gathered (no sync)
                    k: v.detach() if torch.is_tensor(v) else v for k, v in stats.items()
                }
                output = loss
        if step.produces is not None:
            self._deliver(step, output)
        if self.forward_only:
            return
        if ex.recompute:
            self.saved[step.key] = SavedForward(input_tensor, None, rng_state)
        else:
            self.saved[step.key] = SavedForward(input_tensor, output, None, tape)

    def _recompute(self, action: Action, input_tensor: torch.Tensor | None, rng_state):
        if input_tensor is not None:
            input_tensor = input_tensor.detach().requires_grad_(True)
        with restored_rng(rng_state, self.ex.device), torch.enable_grad():
            output, loss_func = self._run_forward(action, input_tensor)
            if action.stage == self.last_stage:
                output, _ = loss_func(output)
        return input_tensor, output

    def _recording(self, tape: BackwardTape | None) -> contextlib.AbstractContextManager:
        """The MoE layers cut the graph of the forward in the block onto ``tape``."""
        runtime = self.ex.pair_runtime
        if tape is None and runtime.tape is None:
            return _NO_CHANGE
        return taping(runtime, tape)

    def _backward(self, step: Compute) -> Iterator[None]:
        """A backward as pieces (a generator): the recomputation (if any) and the backward
        down to its forward's last cut, then one piece per segment, each after its gradient
        all-to-all (:meth:`BackwardTape.pieces`); uncut, one piece."""
        ex, action = self.ex, step.action
        input_tensor, output, rng_state, tape = self.saved.pop(step.key)
        linears, store = None, None
        if ex.schedule.split_backward:
            store = self.stores[step.key] = ex.weight_grad_store_factory()
            linears = ex._linears[action.stage]
        # taken last: what needs no input is done before its wait
        grad_output = self.comm.take(step.needs) if step.needs is not None else None
        if ex.recompute:
            tape = BackwardTape() if ex.cut_backward else None
            with self.timer(action), self._recording(tape):
                input_tensor, output = self._recompute(action, input_tensor, rng_state)
        if grad_output is None:
            with self.timer(action):
                output = output / ex.loss_scale_divisor
                if ex.scale_loss is not None:
                    output = ex.scale_loss(output)
            grad_output = torch.ones_like(output)

        def run_backward(tensors: list, grads: list) -> None:
            defer = (defer_weight_grad(linears, store) if store is not None
                     else contextlib.nullcontext())
            with self.timer(action), defer:
                Variable._execution_engine.run_backward(
                    tensors=tuple(tensors), grad_tensors=tuple(grads), keep_graph=False,
                    create_graph=False, inputs=(), allow_unreachable=True, accumulate_grad=True)

        if tape is None:
            run_backward([output], [grad_output])
        else:
            yield from tape.pieces(ex.pair_runtime, output, grad_output, run_backward)
        if step.produces is not None:
            grad = input_tensor.grad
            if grad is None:
                spec = self.comm.spec_of(step.produces)
                grad = torch.zeros(spec.shape, dtype=spec.dtype, device=ex.device)
            self._deliver(step, grad)

    def _weight(self, step: Compute) -> Iterator[None]:
        """A W as pieces: one weight-gradient entry each."""
        store = self.stores.pop(step.key)
        steps = store.pieces()
        while True:
            with self.timer(step.action):
                done = next(steps, StopIteration) is StopIteration
            if done:
                return
            yield
