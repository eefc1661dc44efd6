"""What was measured, read back into the IR (torch-free, deterministic).

* **The trace format** of ``--pipeline-trace`` (a Chrome / Perfetto trace): :class:`TraceFormat`
  names its keys once; :mod:`megatron_chimera.pipeline.chrome_trace` writes with them and the
  readers here read with them.
* **A measured timeline read back** as the simulator's :class:`~.simulate.SimResult`
  (:func:`measured_result`), so the plotters draw it like a simulated one, and the per-stage costs
  it measured (:func:`measured_costs`), so the same schedule can be simulated beside it. One row
  per pipeline rank: the ranks of data-parallel replica 0 and tensor rank 0 (the others run the
  same list); times in milliseconds from the traced iteration's first compute.
* **Rebuilding a running split-backward schedule for measured costs**
  (:func:`rebuild_for_costs`): the schedule's generator is built again with the measured
  per-stage costs, the new order validated, and the iteration time of the running order and of
  the new one predicted (simulator) under those costs; the faster of the two split orders then
  meets the unsplit alternatives that run on the same placement (:func:`~.fallback.decide`).
  Every rank calls it with the same inputs and gets the same schedule.
  :meth:`RebuildReport.line` is the one log line. The runtime half (timing the actions, the
  profiling window) is :mod:`megatron_chimera.pipeline.profiling`.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

from megatron_chimera.schedules.actions import BACKWARD, FORWARD, WEIGHT, Schedule
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.fallback import Decision, Prediction, decide, of_schedule
from megatron_chimera.schedules.registry import get_spec
from megatron_chimera.schedules.simulate import CostModel, Event, SimResult
from megatron_chimera.schedules.slices import sliced_schedule
from megatron_chimera.schedules.validate import validate


class TraceFormat:
    """The key names of a ``--pipeline-trace`` file (``{"traceEvents": [...], "otherData":
    {...}}``; complete events ``"ph": "X"``, ``pid`` = global rank, times in microseconds)."""

    EVENTS = "traceEvents"
    METADATA = "otherData"  # the run's part: the traced iterations, schedule and ranks
    ITERATIONS = "iterations"  # in METADATA: the traced iteration numbers
    SCHEDULE = "schedule"  # in METADATA: the traced schedule (``Schedule.to_dict``)
    RANKS = "ranks"  # in METADATA: global rank (a string) -> that rank's place
    # a rank's place
    PIPELINE_RANK, DATA_PARALLEL_RANK, TENSOR_RANK = (
        "pipeline_rank", "data_parallel_rank", "tensor_rank")
    # an event
    CATEGORY, ARGS, PID, START, DURATION = "cat", "args", "pid", "ts", "dur"
    # an event's categories
    COMPUTE, P2P, GRADS, OPTIMIZER = "compute", "p2p", "grad-reduction", "optimizer"
    # a compute event's args
    ITERATION, KIND, PIPE, STAGE, MICROBATCH = "iteration", "kind", "pipe", "stage", "microbatch"


T = TraceFormat


def trace_schedule(trace: dict[str, Any]) -> Schedule:
    """The schedule the trace's iterations ran (recorded in ``otherData``)."""
    return Schedule.from_dict(trace[T.METADATA][T.SCHEDULE])


def _pipeline_rows(trace: dict[str, Any]) -> dict[int, int]:
    """Global rank -> pipeline rank, for the ranks of replica 0 and tensor rank 0."""
    rows = {}
    for rank, meta in trace[T.METADATA][T.RANKS].items():
        if meta[T.DATA_PARALLEL_RANK] == 0 and meta[T.TENSOR_RANK] == 0:
            rows[int(rank)] = meta[T.PIPELINE_RANK]
    return rows


def compute_events(trace: dict[str, Any], iteration: int | None = None) -> list[Event]:
    """The compute actions of one traced iteration (default: the first) as simulator events,
    one row per pipeline rank, in ms from the iteration's first compute."""
    if iteration is None:
        iteration = trace[T.METADATA][T.ITERATIONS][0]
    rows = _pipeline_rows(trace)
    raw = [e for e in trace[T.EVENTS] if e.get(T.CATEGORY) == T.COMPUTE and e[T.PID] in rows
           and e[T.ARGS][T.ITERATION] == iteration]
    origin = min((e[T.START] for e in raw), default=0.0)
    events = [Event(rows[e[T.PID]], e[T.ARGS][T.KIND], e[T.ARGS][T.PIPE], e[T.ARGS][T.STAGE],
                    e[T.ARGS][T.MICROBATCH], (e[T.START] - origin) / 1e3,
                    (e[T.START] + e[T.DURATION] - origin) / 1e3) for e in raw]
    return sorted(events, key=lambda e: (e.rank, e.start))


def measured_result(trace: dict[str, Any], iteration: int | None = None) -> SimResult:
    """The measured iteration as a SimResult: its compute events, span, busy time per rank and
    bubble ratio (idle share of ranks x span); no all-reduce bars, no memory figures."""
    schedule = trace_schedule(trace)
    events = compute_events(trace, iteration)
    span = max((e.end for e in events), default=0.0)
    busy = [sum(e.end - e.start for e in events if e.rank == r) for r in range(schedule.num_ranks)]
    bubble = 1.0 - sum(busy) / (schedule.num_ranks * span) if span > 0 else 0.0
    return SimResult(f"{schedule.name} (measured)", events, [], span, span, busy, bubble,
                     [], [])


def measured_costs(trace: dict[str, Any]) -> CostModel:
    """Per-stage median F, B (whole backward: B + W) and W milliseconds over the traced
    iterations: the simulator's costs for the same schedule (no communication)."""
    schedule = trace_schedule(trace)
    rows = _pipeline_rows(trace)
    samples: dict[tuple[str, int], list[float]] = defaultdict(list)
    for e in trace[T.EVENTS]:
        if e.get(T.CATEGORY) == T.COMPUTE and e[T.PID] in rows:
            samples[(e[T.ARGS][T.KIND], e[T.ARGS][T.STAGE])].append(e[T.DURATION] / 1e3)

    def median(kind: str) -> tuple[float, ...]:
        return tuple(statistics.median(samples[(kind, s)]) if samples[(kind, s)] else 0.0
                     for s in range(schedule.num_stages))

    forward, backward, weight = median(FORWARD), median(BACKWARD), median(WEIGHT)
    if not schedule.split_backward:
        return CostModel(forward, backward)
    return CostModel(forward, tuple(b + w for b, w in zip(backward, weight)), weight)


# the order is built for the measured costs rounded to this fraction of the mean F, so that
# measurement noise below it does not steer the generator; predictions use the costs as measured
QUANTUM = 0.05


@dataclass(frozen=True)
class RebuildReport:
    """Measured costs, the running and the rebuilt order's predictions, and the decision."""

    costs: StageCosts
    before: Prediction  # the running order under the measured costs
    rebuilt: Prediction  # the order built for the measured costs
    decision: Decision  # the split order kept, or the unsplit one replacing it
    build_seconds: float

    @property
    def schedule(self) -> Schedule:
        """The schedule to run from now on."""
        assert self.decision.chosen.schedule is not None
        return self.decision.chosen.schedule

    @property
    def changed(self) -> bool:
        """Whether the schedule to run differs from the running one."""
        return self.schedule.actions != self.before.schedule.actions  # type: ignore[union-attr]

    @property
    def predicted_gain(self) -> float:
        """1 - predicted iteration time after / before (0: no change)."""
        return 1.0 - self.decision.chosen.makespan / self.before.makespan

    def line(self, unit: float = 1e-3, suffix: str = "ms") -> str:
        """One log line: measured costs, predicted before/after, and the unsplit figures."""
        chosen = self.decision.chosen
        if self.decision.fell_back:
            what = (f"switching to {chosen.label} (unsplit, predicted faster than the rebuilt "
                    f"{self.decision.split.label} {self.decision.split.makespan / unit:.4g} "
                    f"{suffix})")
        elif self.changed:
            what = f"rebuilt {chosen.label} for them"
        else:
            what = f"kept the running {chosen.label} order (the rebuilt one is not faster)"
        return (f" measured {self.costs.summary(unit, suffix)} | {what}: predicted iteration "
                f"{self.before.makespan / unit:.4g} -> {chosen.makespan / unit:.4g} {suffix} "
                f"(gain {self.predicted_gain:.1%}) | predicted under the measured costs: "
                f"{self.decision.figures(unit, ' ' + suffix)} | generation "
                f"{self.build_seconds:.2f} s")


def rebuild_for_costs(schedule: Schedule, options: Any, costs: StageCosts,
                      policy: str | None = None, quantum: float = QUANTUM) -> RebuildReport:
    """Rebuild ``schedule`` (a registry schedule with split backward, built from ``options``)
    for ``costs`` and decide what to run next (module docstring). Raises
    :class:`~.fallback.FallbackRefused` under ``policy="refuse"`` when an unsplit schedule on
    the same placement is predicted faster."""
    if not schedule.split_backward:
        raise ValueError(f"{schedule.name} does not split the backward: nothing to rebuild")
    if schedule.sequence_slices > 1:
        return _rebuild_sliced(schedule, costs, quantum)
    spec = get_spec(schedule.name)
    options = spec.options_type() if options is None else options
    started = time.perf_counter()
    new = spec.build(schedule.num_ranks, schedule.num_microbatches,
                     replace(options, costs=costs.quantized(quantum)))
    validate(new)
    build_seconds = time.perf_counter() - started
    before = of_schedule(schedule, costs, label=schedule.name)
    rebuilt = of_schedule(new, costs, label=schedule.name)
    split = rebuilt if rebuilt.makespan < before.makespan else before
    decision = decide(split, costs, policy, same_placement=True)
    return RebuildReport(costs, before, rebuilt, decision, build_seconds)


def _rebuild_sliced(schedule: Schedule, costs: StageCosts, quantum: float) -> RebuildReport:
    """A sliced split-backward order (``--pipeline-sequence-slices``) rebuilt by the sliced
    generator for the measured per-stage costs (``costs`` are a whole sequence's; each slice is
    charged its ``slice_work``). The faster of the running and the rebuilt order is kept; there
    is no unsplit fallback (the unsplit alternatives are not sliced orders)."""
    started = time.perf_counter()
    k = schedule.sequence_slices
    new = sliced_schedule(schedule.name.removesuffix("-sliced"), schedule.num_ranks,
                          schedule.num_microbatches // k, k,
                          attention_fraction=schedule.meta.get("attention_fraction", 0.0),
                          stage_costs=_per_stage(costs.quantized(quantum), schedule.num_stages))
    validate(new)
    build_seconds = time.perf_counter() - started
    before = of_schedule(schedule, costs, label=schedule.name)
    rebuilt = of_schedule(new, costs, label=schedule.name)
    split = rebuilt if rebuilt.makespan < before.makespan else before
    return RebuildReport(costs, before, rebuilt, Decision(split, (), split), build_seconds)


def _per_stage(costs: StageCosts, num_stages: int) -> tuple[tuple[float, ...], ...]:
    """``costs`` recut to ``num_stages`` as the sliced generator takes them: (F, B, W)."""
    costs = costs.for_stages(num_stages)
    return costs.forward, costs.backward, costs.weight
