"""Rebuild a running split-backward schedule for measured costs (torch-free, deterministic).

:func:`rebuild_for_costs` builds the schedule's generator again with the measured per-stage
costs, validates the new order, and predicts (simulator) the iteration time of the running order
and of the new one under those costs; the faster of the two split orders then meets the unsplit
alternatives that run on the same placement (:func:`~.fallback.decide`). Every rank calls it with
the same inputs and gets the same schedule. :meth:`RebuildReport.line` is the one log line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.fallback import Decision, Prediction, decide, of_schedule
from megatron_chimera.schedules.registry import get_spec
from megatron_chimera.schedules.validate import validate

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
