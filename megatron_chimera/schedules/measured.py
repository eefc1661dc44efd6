"""A measured timeline (the Chrome / Perfetto trace of ``--pipeline-trace``) read back as the
simulator's :class:`~.simulate.SimResult`, so the plotters draw it like a simulated one, and the
per-stage costs it measured, so the same schedule can be simulated beside it.

One row per pipeline rank: the ranks of data-parallel replica 0 and tensor rank 0 (the others
run the same list); times in milliseconds from the traced iteration's first compute.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from megatron_chimera.schedules.actions import BACKWARD, FORWARD, WEIGHT, Schedule
from megatron_chimera.schedules.simulate import CostModel, Event, SimResult


def trace_schedule(trace: dict[str, Any]) -> Schedule:
    """The schedule the trace's iterations ran (recorded in ``otherData``)."""
    return Schedule.from_dict(trace["otherData"]["schedule"])


def _pipeline_rows(trace: dict[str, Any]) -> dict[int, int]:
    """Global rank -> pipeline rank, for the ranks of replica 0 and tensor rank 0."""
    rows = {}
    for rank, meta in trace["otherData"]["ranks"].items():
        if meta["data_parallel_rank"] == 0 and meta["tensor_rank"] == 0:
            rows[int(rank)] = meta["pipeline_rank"]
    return rows


def compute_events(trace: dict[str, Any], iteration: int | None = None) -> list[Event]:
    """The compute actions of one traced iteration (default: the first) as simulator events,
    one row per pipeline rank, in ms from the iteration's first compute."""
    if iteration is None:
        iteration = trace["otherData"]["iterations"][0]
    rows = _pipeline_rows(trace)
    raw = [e for e in trace["traceEvents"] if e.get("cat") == "compute" and e["pid"] in rows
           and e["args"]["iteration"] == iteration]
    origin = min((e["ts"] for e in raw), default=0.0)
    events = [Event(rows[e["pid"]], e["args"]["kind"], e["args"]["pipe"], e["args"]["stage"],
                    e["args"]["microbatch"], (e["ts"] - origin) / 1e3,
                    (e["ts"] + e["dur"] - origin) / 1e3) for e in raw]
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
    for e in trace["traceEvents"]:
        if e.get("cat") == "compute" and e["pid"] in rows:
            samples[(e["args"]["kind"], e["args"]["stage"])].append(e["dur"] / 1e3)

    def median(kind: str) -> tuple[float, ...]:
        return tuple(statistics.median(samples[(kind, s)]) if samples[(kind, s)] else 0.0
                     for s in range(schedule.num_stages))

    forward, backward, weight = median(FORWARD), median(BACKWARD), median(WEIGHT)
    if not schedule.split_backward:
        return CostModel(forward, backward)
    return CostModel(forward, tuple(b + w for b, w in zip(backward, weight)), weight)
