"""Benchmark every pipeline schedule with emulated compute and compare with the simulator.

Run under torchrun, one process per pipeline rank (W = world / D data-parallel replicas)::

    torchrun --nproc-per-node 8 tools/benchmark_schedules.py -D 8 --num-microbatches 8 32 \
        --forward-ms 20 --backward-ms 40 --weight-ms 20 --json bench.json

Stages sleep instead of computing (``megatron_chimera/pipeline/emulated.py``), so 8 ranks on 2
cores behave like 8 devices. Per schedule and N the table shows the measured iteration time (median
of ``--iters`` after ``--warmup``, per iteration the slowest rank; with ``--rounds R`` the rows
take turns R times and the median is over all R x ``--iters``, so that load from other processes
falls on every row alike), the simulator's makespan for the same costs with the p2p latency
measured by ping-pong in this run, their ratio, and throughput relative to 1F1B and to torch's
fastest schedule at the same N (same samples per iteration); a summary per N compares our
fastest row with torch's and names the largest measured/simulated.
``--backward-ms`` is the whole backward; with a split backward B takes ``backward - weight`` and
W takes ``--weight-ms``. A schedule with k stages per rank (interleaved, V-shaped) gets 1/k of
these times per stage. ``--end-stage-factor X`` makes the model's first and last stage X times as
heavy (embedding, LM head): the extra (X-1) x the times sits on the first and the last (chunk)
stage of every schedule. Rows ``torch-*`` run torch.distributed.pipelining's schedules on the
same emulated stages (no simulation). ``--trace`` runs one more iteration of each of our rows with
a timeline on every rank and prints where the time between compute actions went: message flights
the receiver waited for, the receiver's wake-up, and the executor's local gaps
(``megatron_chimera/pipeline/trace.py``).

Split-backward rows (Chimera-ZB; alike ZB-H1, ZBV, V-Half, BitPipe-ZB): ``chimera-zb`` is built
for the emulated per-stage costs (known in advance),
``chimera-zb:costs=unit`` for 1:1:1 (as training builds it before measuring), and
``chimera-zb:profile=K`` starts from the 1:1:1 order, times F/B/W per stage in K iterations with
the executor's profiler, rebuilds the order for the measured costs (as training does) and then
measures the rebuilt order. ``chimera-zb:p2p_us=T`` builds for the known costs and a message time
of T microseconds (``--chimera-zb-costs "...;p2p=T"`` in training): on this machine a message on
the critical path costs the runtime's host work, which ``--trace`` prints. Example (the README's
table)::

    torchrun --nproc-per-node 8 tools/benchmark_schedules.py -D 8 --num-microbatches 32 \
        --forward-ms 20 --backward-ms 40 --weight-ms 10 --end-stage-factor 1.5 \
        --schedules 1f1b,chimera,zb-h1,chimera-zb:costs=unit,chimera-zb:profile=3,chimera-zb,\
torch-zbv,torch-dualpipev

MoE all-to-all (issue 41): ``--all-to-all-ms A`` runs our rows on emulated MoE stages
(:class:`EmulatedMoEStage`: ``--layers-per-stage`` MoE layers, each attention, dispatch, experts,
combine) whose F and B each pay A per stage (dispatch + combine of all layers) in emulated
all-to-alls over the expert-parallel groups of ``--expert-model-parallel-size``; a row with
``:overlap_moe_expert_parallel_comm=1`` runs paired F&B actions whose halves' all-to-alls overlap
each other's compute (``pipeline/overlap.py``; its pairs chosen with each pair costed piece by piece
over ``--layers-per-stage`` layers, as the runtime runs it), and the simulator charges A per
unpaired F/B and each pair its time in the runtime's baton, piece by piece over the
``--layers-per-stage`` layers (``CostModel.moe_layers_per_stage``). Before its timed iterations each
MoE row measures the paired runtime's host costs on its ranks (``pipeline/pair_calibration.py``: per
unpaired F/B and per baton hand-over); the table then ends with the overlap/no-overlap ratios,
measured over simulated with and without those host costs, and the costs themselves. With
``--grad-reduce none`` (no ``profile=``, no stage output handed over on one rank) the MoE rows
run on queued emulated devices: each host runs ahead of its device across actions and pipeline
messages carry the device time (``pipeline/emulated_moe.py``: ``DeviceTimedTransport``), as on
GPUs, so measured over simulated is 1.00 where the runtime's host keeps ahead and shows where it
falls behind; the calibrated host costs are then what a runtime that waited for each action
would add::

    torchrun --nproc-per-node 8 tools/benchmark_schedules.py -D 4 --num-microbatches 16 \
        --forward-ms 40 --backward-ms 40 --weight-ms 0 --all-to-all-ms 40 \
        --expert-model-parallel-size 2 --layers-per-stage 2 --grad-reduce none \
        --schedules 1f1b,1f1b:overlap_moe_expert_parallel_comm=1,chimera,\
chimera:overlap_moe_expert_parallel_comm=1

Gradient reduction: ``--allreduce-ms`` gives each stage's reduction an emulated cost (every
rank's buckets cross one emulated link, :class:`EmulatedCollectives`; ``--layers-per-stage``
layers per stage, ``--ddp-bucket-size`` elements per bucket) and ``--grad-reduce`` picks how our
rows reduce: ``none`` (no emulated cost: the compute-only reference), ``end`` (every bucket after
the iteration's compute: nothing hidden), ``stage`` (each stage once its last backward is done:
the default), ``overlap`` (each bucket as soon as its gradients are final:
``--overlap-grad-reduce``). With ``none`` and ``end`` measured, the table ends with the share of
the reduction time each mode hides. Example::

    torchrun --nproc-per-node 8 tools/benchmark_schedules.py -D 4 --num-microbatches 8 \
        --schedules 1f1b,chimera --allreduce-ms 60 --grad-reduce none,end,stage,overlap
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_chimera import parallel_state
from megatron_chimera.atomic import atomic_write
from megatron_chimera.config import ConfigError, ParallelConfig
from megatron_chimera.distributed.grad_buffer import build_grad_buffers
from megatron_chimera.distributed.grad_sync import GradientSynchronizer
from megatron_chimera.errors import ToolArgumentParser, run_tool
from megatron_chimera.layout import ParallelLayout
from megatron_chimera.pipeline.emulated import (
    EmulatedCollectives,
    EmulatedCosts,
    EmulatedStage,
    SleepingWeightGradStore,
    emulated_forward_step,
    emulated_stage_costs,
)
from megatron_chimera.pipeline.emulated_moe import (
    DeviceTimedTransport,
    EmulatedAllToAll,
    EmulatedMoEStage,
    emulated_moe_forward_step,
)
from megatron_chimera.pipeline.executor import Gradients, PipelineExecutor, StageWork
from megatron_chimera.pipeline.pair_calibration import PairHostCosts, calibrate
from megatron_chimera.pipeline.profiling import ProfileRebuild
from megatron_chimera.pipeline.topology import PipelineTopology
from megatron_chimera.pipeline.torch_pipelining import build_torch_pipeline
from megatron_chimera.pipeline.trace import GapBreakdown, Timeline, TracingTransport, gap_breakdown
from megatron_chimera.schedules import build_schedule
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.lowering import lower
from megatron_chimera.schedules.registry import (
    SPLIT_BACKWARD_SCHEDULES,
    get_spec,
    parse_schedule_spec,
)
from megatron_chimera.schedules.simulate import CostModel, simulate
from megatron_chimera.schedules.validate import validate, validate_lowered
from megatron_chimera.training.initialize import initialize_distributed

DEFAULT_SCHEDULES = (
    "gpipe,1f1b,interleaved:virtual_pipeline_size=2,chimera,chimera:concat=direct,"
    "chimera:concat=forward-doubling,chimera:pipes=4,zb-h1,chimera-zb:costs=unit,"
    "chimera-zb:profile=3,chimera-zb,chimera-zb:pipes=4,zbv,v-half,bitpipe,bitpipe-zb:costs=unit,"
    "bitpipe-zb:profile=3,bitpipe-zb,torch-1f1b,torch-interleaved,torch-zbv,torch-dualpipev"
)
SEQ, MICRO_BATCH, HIDDEN = 8, 2, 4


@dataclass
class Row:
    """One measured configuration."""

    schedule: str
    options: dict[str, Any]
    pipeline_size: int
    num_microbatches: int
    measured_s: float  # median of ``times``
    simulated_s: float | None
    extra: dict[str, Any] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)  # every measured iteration, seconds

    def key(self) -> tuple:
        """What identifies the row across rounds."""
        return (self.schedule, tuple(sorted(self.options.items())), self.num_microbatches)

    def merged(self, later: Row) -> Row:
        """This row with the iterations of the same row measured in a later round."""
        times = self.times + later.times
        extra = dict(self.extra)
        if "gaps" in self.extra and "gaps" in later.extra:  # traced in both rounds
            extra["gaps"] = self.extra["gaps"].merged(later.extra["gaps"])
        if "pair_host" in self.extra and "pair_host" in later.extra:  # calibrated each round
            extra["pair_host"] = self.extra["pair_host"] + later.extra["pair_host"]
        return dataclasses.replace(self, measured_s=statistics.median(times), times=times,
                                   extra=extra)


@dataclass(frozen=True)
class HostCosts:
    """What the runtime adds to compute and ping-pong latency, measured in this run's traced
    iterations (every traced row pooled: one pair of figures for all rows). ``action_s``: host
    time before a compute action whose input is there (the mean local gap); ``message_s``: a
    message on the critical path -- the sender posting it after its compute, the flight, the
    receiver waking and starting -- less the receiver's ``action_s``, which the simulator charges
    before every compute anyway; ``overrun_s``: what a compute action itself takes beyond its
    nominal time (the emulated stage's real work and its sleep's wake-up), per action."""

    action_s: float
    message_s: float
    overrun_s: float = 0.0

    @property
    def per_action_s(self) -> float:
        """The simulator's ``action_overhead``: the host's time before and beyond each compute."""
        return self.action_s + self.overrun_s

    @classmethod
    def of(cls, gaps: GapBreakdown) -> HostCosts | None:
        """The figures of the pooled gaps (None without critical hops or local gaps)."""
        if not gaps.hops or not gaps.local_gaps:
            return None
        mean = statistics.fmean
        action = mean(gaps.local_gaps)
        message = mean(gaps.end_to_send) + mean(gaps.hops) + mean(gaps.wake_to_start) - action
        return cls(action, max(message, 0.0))

    def simulate(self, row: Row) -> float | None:
        """``row``'s makespan with these costs (None for a row without its simulation inputs)."""
        inputs = row.extra.get("sim_inputs")
        if inputs is None:
            return None
        schedule, model = inputs
        model = dataclasses.replace(model, p2p_alpha=self.message_s,
                                    action_overhead=self.per_action_s)
        return simulate(schedule, model).makespan


def pair_host_costs(row: Row) -> PairHostCosts | None:
    """An MoE row's calibrated host costs, each the low median over its rounds' calibrations
    (None for other rows): a load burst from elsewhere that covers one whole calibration (one
    in four or five on the shared VM, 5-10 ms per action) must not stand for the run, and
    with two rounds the plain median would be their mean."""
    found = row.extra.get("pair_host")
    if not found:
        return None
    return PairHostCosts(statistics.median_low(h.action_s for h in found),
                         statistics.median_low(h.hand_over_s for h in found),
                         found[0].unpaired, found[0].pair)


def simulated_with_pair_host(row: Row) -> float | None:
    """An MoE row's makespan simulated with its calibrated host costs: ``action_overhead`` per
    unpaired F/B (and once per pair), ``hand_over_cost`` per baton hand-over in a pair."""
    host, inputs = pair_host_costs(row), row.extra.get("sim_inputs")
    if host is None or inputs is None:
        return None
    schedule, model = inputs
    return simulate(schedule, dataclasses.replace(
        model, action_overhead=host.action_s, hand_over_cost=host.hand_over_s)).makespan


def host_costs(rows: list[Row]) -> HostCosts | None:
    """The run's :class:`HostCosts` from every traced row of ours (``--trace``), the compute
    overrun from each row's traced compute times against its simulated (nominal) ones."""
    pooled = GapBreakdown()
    overrun_s, actions = 0.0, 0
    for r in rows:
        if "gaps" not in r.extra:
            continue
        gaps = r.extra["gaps"]
        pooled = pooled.merged(gaps)
        nominal = r.extra.get("nominal_compute")  # per iteration: (seconds, actions)
        if nominal is not None and gaps.computes:
            seconds, count = nominal
            overrun_s += sum(gaps.computes) - len(gaps.computes) / count * seconds
            actions += len(gaps.computes)
    host = HostCosts.of(pooled)
    if host is None or not actions:
        return host
    return dataclasses.replace(host, overrun_s=max(overrun_s / actions, 0.0))


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``name:key=value:key=value`` -> (name, options); integer values become ints."""
    try:
        return parse_schedule_spec(spec)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def measure_p2p_latency(rounds: int = 200) -> float:
    """One-way latency of an activation message between ranks 0 and 1 (ping-pong), everywhere."""
    buf = torch.zeros(SEQ, MICRO_BATCH, HIDDEN)
    rank = dist.get_rank()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
    latency = torch.tensor([(time.perf_counter() - start) / (2 * rounds)])
    dist.broadcast(latency, 0)
    return float(latency)


def _max_over_ranks(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def hands_over_locally(schedule) -> bool:
    """Whether some stage's output goes to the next stage on the same rank (no message)."""
    return any(schedule.rank_of(p, s) == schedule.rank_of(p, s + 1)
               for p in range(schedule.num_pipes) for s in range(schedule.num_stages - 1))


def _timed(run, warmup: int, iters: int) -> list[float]:
    """Seconds of ``iters`` iterations (the slowest rank each) after ``warmup`` untimed ones."""
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        start = time.perf_counter()
        run()
        elapsed = _max_over_ranks(time.perf_counter() - start)
        if i >= warmup:
            times.append(elapsed)
    return times


def split_costs(per_stage: list[EmulatedCosts]) -> StageCosts:
    """The split-backward generators' view of emulated stages: F, B = backward - weight, W."""
    return StageCosts(tuple(c.forward_s for c in per_stage),
                      tuple(c.input_grad_s for c in per_stage),
                      tuple(c.weight_s for c in per_stage))


def build_message_seconds(name: str, p2p_us: Any, cost_source: str) -> float:
    """The row option ``p2p_us=T``: the message time (microseconds) a split-backward order is
    built for, with the known costs (the list scheduler then orders around messages of that
    cost, e.g. the runtime's per-message host cost that ``--trace`` prints); 0 by default."""
    try:
        value = float(p2p_us)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ConfigError(f"--schedules: {name}:p2p_us= takes microseconds >= 0, got {p2p_us}")
    if value and cost_source != "known":
        raise ConfigError(f"--schedules: {name}:p2p_us= applies to an order built for the known "
                          f"costs, not to costs={cost_source} or profile=")
    return value * 1e-6


def cost_model(per_stage: list[EmulatedCosts], split: bool, latency: float = 0.0,
               data_parallel_size: int = 1,
               all_to_all: tuple[float, ...] | float = 0.0, moe_layers: int = 0) -> CostModel:
    """The simulator's costs of emulated stages, with ``latency`` per message and all-reduce
    and ``all_to_all`` seconds per stage and direction (MoE) over ``moe_layers`` emulated MoE
    layers per stage (pairs costed piece by piece, as the paired runtime runs them)."""
    return CostModel(forward_cost=tuple(c.forward_s for c in per_stage),
                     backward_cost=tuple(c.backward_s for c in per_stage),
                     weight_cost=tuple(c.weight_s for c in per_stage) if split else 0.0,
                     p2p_alpha=latency, allreduce_alpha=latency,
                     data_parallel_size=data_parallel_size, all_to_all_cost=all_to_all,
                     moe_layers_per_stage=moe_layers)


GRAD_REDUCE_MODES = ("none", "end", "stage", "overlap")


class _ReduceAtEnd:
    """A synchronizer that hears nothing of the backward: every bucket after the compute."""

    overlap_grad_reduce = False  # no bucket is started from inside a backward

    def __init__(self, inner: GradientSynchronizer) -> None:
        self.inner = inner

    def start_iteration(self, *args: Any, **kwargs: Any) -> None:
        self.inner.start_iteration(*args, **kwargs)

    def final_action_begins(self, stage: int) -> None:
        """Ignored: nothing starts before the end."""

    def stage_done(self, stage: int) -> None:
        """Ignored: nothing starts before the end."""

    def finish(self) -> None:
        self.inner.finish()


def trace_iteration(stages: dict[int, EmulatedStage], make_executor, transport,
                    run: Any) -> GapBreakdown | None:
    """One more iteration with every rank's timeline recorded (:mod:`.trace`): the executor
    ``make_executor(transport, weight_grad_store_factory)`` runs it on a tracing wrapper of
    ``transport`` (its connections kept), ``run(executor)`` runs it. Rank 0 returns the gaps of
    every rank's timeline, the others None."""
    timeline = Timeline()
    for stage in stages.values():
        stage.trace_into(timeline)
    try:
        traced = make_executor(TracingTransport(transport, timeline),
                               functools.partial(SleepingWeightGradStore, timeline=timeline))
        dist.barrier()
        run(traced)
    finally:
        for stage in stages.values():
            stage.trace_into(None)
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(timeline.events, gathered, dst=0)
    return gap_breakdown(gathered) if gathered is not None else None


def _grad_sync(stages: dict[int, EmulatedStage], args: argparse.Namespace, mode: str):
    """Buffers and the synchronizer of ``mode`` with the emulated link cost."""
    buffers = build_grad_buffers(stages, grad_reduce_in_fp32=True,
                                 bucket_sizes={s: args.ddp_bucket_size for s in stages})
    elements = max(sum(p.numel() for p in m.parameters()) for m in stages.values())
    cost = 0.0 if mode == "none" else args.allreduce_ms / 1e3
    link = EmulatedCollectives(cost / elements)
    sync = GradientSynchronizer.from_parallel_state(buffers, mode == "overlap",
                                                    collectives=link)
    return (_ReduceAtEnd(sync) if mode == "end" else sync), buffers


def bench_ours(name: str, options: dict[str, Any], d: int, n: int, costs: EmulatedCosts,
               args: argparse.Namespace, latency: float, mode: str = "stage") -> Row:
    """Measure our executor on schedule ``name`` (gradients reduced as ``mode`` says) and
    simulate the same costs."""
    options = dict(options)
    if (options.keys() & {"costs", "profile", "p2p_us"}) and not get_spec(name).split_backward:
        raise ConfigError(f"--schedules: costs=, profile= and p2p_us= apply to "
                          f"{', '.join(SPLIT_BACKWARD_SCHEDULES)}, not {name}")
    profile = int(options.pop("profile", 0))
    cost_source = options.pop("costs", "unit" if profile else "known")
    if cost_source not in ("unit", "known") or (profile and cost_source != "unit"):
        raise ConfigError(f"--schedules: {name}:costs= takes unit or known (profile= starts "
                          f"from unit), got {cost_source}")
    p2p_us = options.pop("p2p_us", 0)
    build_p2p_s = build_message_seconds(name, p2p_us, cost_source)
    probe = build_schedule(name, d, n, **options)
    per_stage = emulated_stage_costs(costs, probe.num_stages, d, args.end_stage_factor,
                                     probe.split_backward)
    moe = args.all_to_all_ms > 0 or args.expert_model_parallel_size > 1
    if probe.split_backward and cost_source == "known":
        # with MoE the pairs (--overlap-moe-expert-parallel-comm) are chosen for the all-to-all
        # time too, per stage and direction as below
        known_a2a = ((args.all_to_all_ms / 1e3 * d / probe.num_stages,) * probe.num_stages
                     if moe and args.all_to_all_ms > 0 else ())
        options["costs"] = dataclasses.replace(split_costs(per_stage), p2p=build_p2p_s,
                                               all_to_all=known_a2a)
    if moe and options.get("overlap_moe_expert_parallel_comm"):
        # the pairs chosen for how the paired runtime runs them (piece by piece over the
        # stage's MoE layers, an F&F pair in turn), the cost the rows are simulated with
        spec = get_spec(name)
        schedule = spec.build(d, n, spec.options_type(**options),
                              moe_layers_per_stage=args.layers_per_stage)
    else:
        schedule = build_schedule(name, d, n, **options) if "costs" in options else probe
    validate(schedule)
    validate_lowered(lower(schedule))  # every rank alike: the executor checks only its own list
    w = ParallelLayout.from_world(dist.get_world_size(), pipeline=d).data
    # per stage and direction, scaled like the compute (k stages per rank: 1/k each)
    a2a = tuple(args.all_to_all_ms / 1e3 * d / schedule.num_stages
                for _ in range(schedule.num_stages))
    parallel_state.initialize_model_parallel(
        d, schedule.placement, schedule.num_stages, timeout=timedelta(minutes=5),
        expert_model_parallel_size=args.expert_model_parallel_size)
    extra: dict[str, Any] = {}
    try:
        prank = parallel_state.get_pipeline_model_parallel_rank()
        last = schedule.num_stages - 1
        if moe:
            exchange = EmulatedAllToAll(parallel_state.get_expert_model_parallel_group()
                                        if args.expert_model_parallel_size > 1 else None)
            stages = {s: EmulatedMoEStage(per_stage[s], a2a[s], exchange, s == 0, s == last,
                                          HIDDEN, s, layers=args.layers_per_stage)
                      for s in schedule.stages_of_rank(prank)}
            forward_step = emulated_moe_forward_step
        else:
            stages = {s: EmulatedStage(per_stage[s], s == 0, s == last, HIDDEN, s,
                                       layers=args.layers_per_stage)
                      for s in schedule.stages_of_rank(prank)}
            forward_step = emulated_forward_step
        grad_sync, buffers = _grad_sync(stages, args, mode)

        def executor_for(sched, transport=None, store_factory=SleepingWeightGradStore):
            return PipelineExecutor(
                sched, PipelineTopology.from_parallel_state(),
                StageWork(stages, forward_step, (SEQ, MICRO_BATCH, HIDDEN), torch.float32),
                Gradients(loss_scale_divisor=n * w, grad_sync=grad_sync,
                          weight_grad_store_factory=store_factory),
                transport=transport)

        # (emulated gradient collectives, local hand-overs and the profiler's action times are
        # host-timed)
        device_timed = (moe and mode == "none" and not profile
                        and not hands_over_locally(schedule))
        if device_timed:  # the hosts run ahead of their emulated devices (emulated_moe.py)
            exchange.sync_each_action = False
            extra["device_timed"] = True
            executor = executor_for(schedule, DeviceTimedTransport(
                PipelineTopology.from_parallel_state(),
                lambda m: m.tag(schedule.num_pipes, schedule.num_microbatches), exchange,
                latency))
        else:
            executor = executor_for(schedule)
        batch = torch.randn(SEQ, MICRO_BATCH, HIDDEN)

        def step(run_by: PipelineExecutor | None = None) -> None:
            buffers.zero_()
            (run_by or executor).run([batch] * n)
            if device_timed:
                exchange.sync_device()

        if profile:
            spec = get_spec(name)
            profiler = ProfileRebuild(schedule, spec.options_type(**options), profile)
            for _ in range(profile):
                profiler.start_iteration(executor)
                step()
                report = profiler.finish_iteration(executor)
            schedule = report.schedule  # re-lowered and validated by its executor, which
            executor = executor_for(schedule, executor.transport)  # keeps the connections
            extra.update(rebuild=report.line(), predicted_gain=report.predicted_gain)
            if dist.get_rank() == 0:
                print(f"{name} N={n} after {profile} profiled iterations:{report.line()}",
                      file=sys.stderr, flush=True)
        if moe:  # the paired runtime's host costs, on these ranks now (pair_calibration.py)
            exchange.sync_each_action = True  # (isolated actions, each timed to its end)
            extra["pair_host"] = [calibrate(stages[min(stages)], min(stages), batch)]
            exchange.sync_each_action = not device_timed
        times = _timed(step, args.warmup, args.iters)
        if args.trace and not moe:
            gaps = trace_iteration(stages, functools.partial(executor_for, schedule),
                                   executor.transport, step)
            if gaps is not None:
                extra["gaps"] = gaps
    finally:
        parallel_state.destroy_model_parallel()
    sim_a2a = a2a if moe else 0.0
    model = cost_model(per_stage, schedule.split_backward, latency, w, sim_a2a,
                       args.layers_per_stage if moe else 0)
    sim = simulate(schedule, model)
    compute_only = simulate(schedule, cost_model(per_stage, schedule.split_backward, 0.0, w))
    if moe:
        extra["exposed_all_to_all_s"] = max(sim.exposed_all_to_all)
    shown = {k: v for k, v in options.items() if k != "costs"}
    if build_p2p_s:
        shown["p2p_us"] = p2p_us  # as given: validate_perf_model builds the same order from it
    if profile:
        shown["profile"] = profile
    elif cost_source != "known":
        shown["costs"] = cost_source
    extra.update(pipes=schedule.num_pipes, concat=schedule.meta.get("concat"), W=w,
                 simulated_compute_s=compute_only.makespan, schedule_used=schedule.name,
                 nominal_compute=(sum(sim.busy), len(sim.events)),
                 sim_inputs=(schedule, model))
    if args.allreduce_ms:
        shown["grad_reduce"] = mode
    return Row(name, shown, d, n, statistics.median(times), sim.makespan, extra, times)


def bench_torch(name: str, d: int, n: int, costs: EmulatedCosts, args: argparse.Namespace) -> Row:
    """Measure one torch.distributed.pipelining schedule on the same emulated stages."""
    try:
        pipeline = build_torch_pipeline(name, d, n, costs, (MICRO_BATCH, SEQ, HIDDEN),
                                        end_stage_factor=args.end_stage_factor)
    except ValueError as exc:
        raise ConfigError(f"--schedules: {exc}") from exc
    times = _timed(pipeline.step, args.warmup, args.iters)
    return Row(name, {}, d, n, statistics.median(times), None, {"pipes": 1, "concat": None}, times)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (see the module docstring)."""
    p = ToolArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-D", "--pipeline-model-parallel-size", type=int, default=None,
                   help="pipeline ranks D (default: the world size)")
    p.add_argument("--num-microbatches", type=int, nargs="+", default=[8, 32])
    p.add_argument("--forward-ms", type=float, default=20.0)
    p.add_argument("--backward-ms", type=float, default=40.0, help="whole backward (B + W)")
    p.add_argument("--weight-ms", type=float, default=20.0,
                   help="weight-gradient part of the backward (W) for split schedules")
    p.add_argument("--end-stage-factor", type=float, default=1.0,
                   help="the first and last stage take this many times a middle stage's times")
    p.add_argument("--iters", type=int, default=5, help="measured iterations (median), >= 5")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per row and round")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds over all rows, --iters each (median over every measured "
                        "iteration): load from elsewhere then falls on every row alike")
    p.add_argument("--schedules", default=DEFAULT_SCHEDULES,
                   help="comma-separated name[:key=value...] (torch-* for pipelining's)")
    p.add_argument("--allreduce-ms", type=float, default=0.0,
                   help="emulated time of one stage's gradient reduction (0: as gloo takes it)")
    p.add_argument("--layers-per-stage", type=int, default=4,
                   help="emulated layers per stage (their gradients become final in turn)")
    p.add_argument("--ddp-bucket-size", type=int, default=24,
                   help="elements per gradient bucket (an emulated layer has 20)")
    p.add_argument("--grad-reduce", default="stage",
                   help=f"comma-separated modes for our rows: {','.join(GRAD_REDUCE_MODES)}")
    p.add_argument("--all-to-all-ms", type=float, default=0.0,
                   help="emulated MoE all-to-all time per stage and direction (an F and a B each "
                        "pay it; dispatch + combine of every layer): our rows then run emulated "
                        "MoE stages (EmulatedMoEStage) whose all-to-alls a paired action "
                        "overlaps with the other half's compute")
    p.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="EP: the emulated all-to-alls exchange real (tiny) messages over the "
                        "expert-parallel groups, checking that every EP rank issues them in "
                        "one order")
    p.add_argument("--trace", action="store_true",
                   help="after each of our rows' timed iterations, trace one more and print "
                        "where the time between compute actions goes (pipeline/trace.py)")
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    args = p.parse_args(argv)
    args.grad_reduce = [m for m in args.grad_reduce.split(",") if m]
    unknown = set(args.grad_reduce) - set(GRAD_REDUCE_MODES)
    if unknown or not args.grad_reduce:
        p.error(f"--grad-reduce: choose from {','.join(GRAD_REDUCE_MODES)}, got "
                f"{sorted(unknown) or 'nothing'}")
    if args.all_to_all_ms < 0 or args.expert_model_parallel_size < 1:
        p.error("--all-to-all-ms must be >= 0 and --expert-model-parallel-size >= 1")
    if args.trace and (args.all_to_all_ms > 0 or args.expert_model_parallel_size > 1):
        p.error("--trace does not apply to emulated MoE rows (--all-to-all-ms, "
                "--expert-model-parallel-size)")
    if args.allreduce_ms < 0 or args.layers_per_stage < 1 or args.ddp_bucket_size < 1:
        p.error("--allreduce-ms must be >= 0, --layers-per-stage and --ddp-bucket-size >= 1")
    if args.iters < 5:
        p.error(f"--iters must be >= 5, got {args.iters}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.end_stage_factor < 1:
        p.error(f"--end-stage-factor must be >= 1, got {args.end_stage_factor}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def format_table(rows: list[Row], latency: float) -> str:
    """Markdown table of the rows: measured over simulated time, throughput relative to 1F1B and
    to torch's best schedule at the same N; then, per N, our best against torch's best. With
    traced rows also the simulation with the run's :class:`HostCosts`."""
    base = {(r.num_microbatches, r.options.get("grad_reduce")): r.measured_s
            for r in rows if r.schedule == "1f1b" and not r.options.get(OVERLAP_OPTION)}
    torch_best = best_rows(rows, torch_rows=True)
    lines = [f"p2p latency (ping-pong, one way): {latency * 1e6:.0f} us", "",
             "| schedule | options | D | N | measured s | simulated s | measured/simulated "
             "| throughput vs 1F1B | vs torch's best |", "|---|---|---|---|---|---|---|---|---|"]
    host = host_costs(rows)
    if host is not None:
        lines[0] += (f"; host costs of the traced iterations: {host.per_action_s * 1e3:.3f} ms "
                     f"per action ({host.action_s * 1e3:.3f} before it, "
                     f"{host.overrun_s * 1e3:.3f} beyond its nominal time), "
                     f"{host.message_s * 1e3:.3f} ms per message")
        lines[2] = lines[2].replace("| throughput", "| simulated + host s | measured/(simulated "
                                    "+ host) | throughput")
        lines[3] += "---|---|"
    for r in rows:
        opts = " ".join(f"{k}={v}" for k, v in r.options.items())
        sim = f"{r.simulated_s:.3f}" if r.simulated_s is not None else "-"
        ratio = f"{r.measured_s / r.simulated_s:.3f}" if r.simulated_s is not None else "-"
        rel = base.get((r.num_microbatches, r.options.get("grad_reduce")))
        thr = f"{rel / r.measured_s:.3f}" if rel else "-"
        best = torch_best.get(r.num_microbatches)
        vs_torch = f"{best.measured_s / r.measured_s:.3f}" if best else "-"
        with_host = ""
        if host is not None:
            sim_host = host.simulate(r)
            with_host = (f" {sim_host:.3f} | {r.measured_s / sim_host:.3f} |" if sim_host
                         else " - | - |")
        lines.append(f"| {r.schedule} | {opts} | {r.pipeline_size} | {r.num_microbatches} | "
                     f"{r.measured_s:.3f} | {sim} | {ratio} |{with_host} {thr} | {vs_torch} |")
    return "\n".join(lines + summary(rows) + hidden_reduction(rows) + overlap_ratios(rows)
                     + gap_table(rows))


OVERLAP_OPTION = "overlap_moe_expert_parallel_comm"


def overlap_ratios(rows: list[Row]) -> list[str]:
    """Per schedule and N with and without ``overlap_moe_expert_parallel_comm``: measured
    iteration time with overlap / without, the simulator's ratio, and each row's
    measured/simulated."""
    plain = {(r.schedule, tuple(sorted((k, str(v)) for k, v in r.options.items())),
              r.num_microbatches): r for r in rows if not r.options.get(OVERLAP_OPTION)}
    lines = []
    for r in rows:
        if not r.options.get(OVERLAP_OPTION):
            continue
        rest = tuple(sorted((k, str(v)) for k, v in r.options.items() if k != OVERLAP_OPTION))
        base = plain.get((r.schedule, rest, r.num_microbatches))
        if base is None or not r.simulated_s or not base.simulated_s:
            continue
        lines.append(
            f"overlap {r.schedule} N={r.num_microbatches}: measured {r.measured_s:.3f} s with / "
            f"{base.measured_s:.3f} s without = {r.measured_s / base.measured_s:.3f} "
            f"(simulated {r.simulated_s / base.simulated_s:.3f}); measured/simulated "
            f"{r.measured_s / r.simulated_s:.3f} with, {base.measured_s / base.simulated_s:.3f} "
            f"without; exposed all-to-all (simulated, worst rank) "
            f"{r.extra.get('exposed_all_to_all_s', 0):.3f} s with, "
            f"{base.extra.get('exposed_all_to_all_s', 0):.3f} s without")
        with_host, without_host = simulated_with_pair_host(r), simulated_with_pair_host(base)
        if with_host and without_host:
            queued = (" (what actions that each wait for their device would add: these rows "
                      "ran on queued devices)" if r.extra.get("device_timed") else "")
            lines.append(
                f"  with the host costs calibrated in this run{queued}: simulated "
                f"{with_host:.3f} s with "
                f"/ {without_host:.3f} s without = {with_host / without_host:.3f}; "
                f"measured/(simulated + host) {r.measured_s / with_host:.3f} with, "
                f"{base.measured_s / without_host:.3f} without")
    for r in rows:
        host = pair_host_costs(r)
        if host is not None:
            lines.append(
                f"host costs {_label(r)} N={r.num_microbatches} (low median of "
                f"{len(r.extra['pair_host'])} calibrations): {host.action_s * 1e3:.3f} ms per "
                f"unpaired F/B, {host.hand_over_s * 1e3:.3f} ms per hand-over in a pair "
                f"(first: F then B {host.unpaired[0] * 1e3:.1f} ms for "
                f"{host.unpaired[1] * 1e3:.1f}, an F&B pair {host.pair[0] * 1e3:.1f} ms for "
                f"{host.pair[1] * 1e3:.1f})")
    return [""] + lines if lines else []


def gap_table(rows: list[Row]) -> list[str]:
    """Where the time between compute actions went in the traced iterations (``--trace``)."""
    traced = [r for r in rows if "gaps" in r.extra]
    if not traced:
        return []
    lines = ["", "Between compute actions, over every rank of the traced iterations (ms, median "
             "/ mean): a critical hop is a wait for a message posted after the receiver's "
             "previous compute ended (flight: send posted -> wait returns; then wait returns -> "
             "compute starts); a local gap is compute ends -> next compute starts, the input "
             "there already.", "",
             "| schedule | options | N | critical hops | flight | wake -> compute "
             "| compute -> send | local gaps | local gap |", "|---" * 9 + "|"]
    for r in traced:
        s = r.extra["gaps"].summary()
        cell = {k: f"{v['median_ms']:.3f} / {v['mean_ms']:.3f}" for k, v in s.items()}
        opts = " ".join(f"{k}={v}" for k, v in r.options.items())
        lines.append(f"| {r.schedule} | {opts} | {r.num_microbatches} | {s['hops']['count']} | "
                     f"{cell['hops']} | {cell['wake_to_start']} | {cell['end_to_send']} | "
                     f"{s['local_gaps']['count']} | {cell['local_gaps']} |")
    return lines


def _label(row: Row) -> str:
    opts = " ".join(f"{k}={v}" for k, v in row.options.items())
    return f"{row.schedule} {opts}".strip()


def best_rows(rows: list[Row], torch_rows: bool) -> dict[int, Row]:
    """Per N, the fastest of torch's rows (``torch_rows``) or of ours."""
    best: dict[int, Row] = {}
    for r in rows:
        if r.schedule.startswith("torch-") == torch_rows:
            if r.num_microbatches not in best or r.measured_s < best[r.num_microbatches].measured_s:
                best[r.num_microbatches] = r
    return best


def summary(rows: list[Row]) -> list[str]:
    """Per N: our fastest row against torch's fastest, and the largest measured/simulated."""
    ours, theirs = best_rows(rows, torch_rows=False), best_rows(rows, torch_rows=True)
    lines = []
    for n in sorted(ours):
        text = f"N={n}: our best {_label(ours[n])} {ours[n].measured_s:.3f} s"
        if n in theirs:
            text += (f", torch's best {_label(theirs[n])} {theirs[n].measured_s:.3f} s: "
                     f"{theirs[n].measured_s / ours[n].measured_s:.3f}x its throughput")
        simulated = [r for r in rows if r.num_microbatches == n and r.simulated_s]
        if simulated:
            worst = max(simulated, key=lambda r: r.measured_s / r.simulated_s)
            text += (f"; largest measured/simulated {worst.measured_s / worst.simulated_s:.3f} "
                     f"({_label(worst)})")
        lines.append(text)
    return [""] + lines if lines else []


def hidden_reduction(rows: list[Row]) -> list[str]:
    """Per schedule and N: the share of the emulated reduction time (``end`` minus ``none``)
    that ``stage`` and ``overlap`` hide."""
    by_key: dict[tuple, dict[str, float]] = {}
    for r in rows:
        mode = r.options.get("grad_reduce")
        if mode is not None:
            rest = tuple(sorted((k, str(v)) for k, v in r.options.items() if k != "grad_reduce"))
            by_key.setdefault((r.schedule, rest, r.num_microbatches), {})[mode] = r.measured_s
    lines = []
    for (schedule, rest, n), modes in by_key.items():
        if "none" not in modes or "end" not in modes or modes["end"] <= modes["none"]:
            continue
        exposed = modes["end"] - modes["none"]
        parts = [f"{m}: {(modes['end'] - modes[m]) / exposed:.0%}"
                 for m in ("stage", "overlap") if m in modes]
        opts = " ".join(f"{k}={v}" for k, v in rest)
        lines.append(f"reduction hidden, {schedule} {opts} N={n} (reduction at the end costs "
                     f"{exposed:.3f} s): {', '.join(parts)}")
    return [""] + lines if lines else []


def write_json(path: str, rows: list[Row]) -> None:
    """Write ``[{"schedule", "pipes", "concat", "D", "W", "N", "measured_s", "simulated_s"}]`` (plus
    the options, ``simulated_compute_s``, the makespan without communication, and ``times_s``,
    every measured iteration; with ``--trace`` the ``gaps`` summary, the run's ``host_costs``
    and ``simulated_host_s``, the simulation with them) atomically."""
    host = host_costs(rows)
    data = [{"schedule": r.schedule, "pipes": r.extra.get("pipes"), "concat": r.extra.get("concat"),
             "D": r.pipeline_size, "W": r.extra.get("W", 1), "N": r.num_microbatches,
             "measured_s": r.measured_s,
             "simulated_s": r.simulated_s, "options": r.options,
             "simulated_compute_s": r.extra.get("simulated_compute_s"), "times_s": r.times,
             **{k: r.extra[k] for k in ("rebuild", "predicted_gain", "schedule_used",
                                        "device_timed") if k in r.extra},
             **({"gaps": r.extra["gaps"].summary()} if "gaps" in r.extra else {}),
             **({"simulated_pair_host_s": simulated_with_pair_host(r),
                 "pair_host_costs": dataclasses.asdict(pair_host_costs(r))}
                if "pair_host" in r.extra else {}),
             **({"simulated_host_s": host.simulate(r), "host_costs": dataclasses.asdict(host)}
                if host is not None else {})} for r in rows]
    atomic_write(path, lambda f: json.dump(data, f, indent=1), mode="w")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; rank 0 prints the table (and writes --json)."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    d = args.pipeline_model_parallel_size or world
    layout = ParallelLayout.from_world(world, pipeline=d)
    if layout.data % args.expert_model_parallel_size:
        raise ConfigError(f"--expert-model-parallel-size {args.expert_model_parallel_size} must "
                          f"divide the data-parallel size {layout.data} (world / D)")
    initialize_distributed(ParallelConfig(
        pipeline_model_parallel_size=d, data_parallel_size=layout.data, distributed_backend="gloo"
    ))
    costs = EmulatedCosts(args.forward_ms / 1e3, args.backward_ms / 1e3, args.weight_ms / 1e3)
    latency = measure_p2p_latency()
    rows: dict[tuple, Row] = {}
    rank = dist.get_rank()
    for round_ in range(args.rounds):
        for spec in [s for s in args.schedules.split(",") if s]:
            name, options = parse_spec(spec)
            for n in args.num_microbatches:
                try:
                    if name.startswith("torch-"):
                        if world != d:
                            raise ConfigError("torch-* rows need world size == D "
                                              "(no data parallelism)")
                        found = [bench_torch(name, d, n, costs, args)]
                    else:
                        found = [bench_ours(name, options, d, n, costs, args, latency, mode)
                                 for mode in args.grad_reduce]
                except (ValueError, ConfigError) as exc:  # not defined for this (D, N)
                    if rank == 0 and round_ == 0:
                        print(f"skipped {spec} N={n}: {exc}", file=sys.stderr, flush=True)
                    continue
                for row in found:
                    key = row.key()
                    rows[key] = rows[key].merged(row) if key in rows else row
                    if rank == 0:
                        print(f"round {round_ + 1}: {spec} N={n} "
                              f"{row.options.get('grad_reduce', '')}: measured "
                              f"{row.measured_s:.3f} s", file=sys.stderr, flush=True)
    if rank == 0:
        print(format_table(list(rows.values()), latency))
        if args.json:
            write_json(args.json, list(rows.values()))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_tool(main)
