"""The cost grid: orders built from (simulated) measured costs against every alternative.

For each point (B/F, W/B) of :data:`B_OVER_F` x :data:`W_OVER_B` (F = 1 on a middle stage; the
first and last stage ``end_factor`` times heavier), the *true* per-stage costs are known to the
grid, and the framework only sees *measured* ones: the true costs with a deterministic relative
error of up to ``noise`` per entry (what profiling a few iterations gives). Every schedule is
simulated under the true costs:

* ``zb 1:1:1``: Chimera-ZB as built without measured costs;
* ``zb measured``: Chimera-ZB rebuilt from the measured costs;
* ``zb known``: Chimera-ZB built from the true costs (the best the generator finds knowing them);
* ``zb-h1``, ``zb-h1 measured``: ZB-H1's closed form and its order for the measured costs;
* ``1f1b``, ``chimera``: the unsplit schedules (whole backward B + W);
* ``chosen``: what the framework runs after profiling (:func:`~.rebuild.rebuild_for_costs` from
  ``zb 1:1:1`` with the measured costs): the faster split order under the measured costs,
  unless the fallback picks Chimera (unsplit, same placement);
* ``lower bound``: :func:`~.zero_bubble.makespan_lower_bound` of Chimera's placement.

``tools/compare_schedules.py --cost-grid`` prints the table; the tests pin a few points.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_chimera.schedules.chimera import chimera_placement
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.fallback import of_schedule, predict
from megatron_chimera.schedules.measured import rebuild_for_costs
from megatron_chimera.schedules.registry import ChimeraOptions, ChimeraZBOptions, build_schedule
from megatron_chimera.schedules.zero_bubble import makespan_lower_bound

B_OVER_F = (0.5, 1.0, 1.5, 2.0)
W_OVER_B = (0.25, 0.5, 1.0)
COLUMNS = ("zb 1:1:1", "zb measured", "zb known", "zb-h1", "zb-h1 measured", "1f1b", "chimera")


def true_costs(num_stages: int, b_over_f: float, w_over_b: float,
               end_factor: float = 1.0) -> StageCosts:
    """F = 1, B = b_over_f, W = b_over_f * w_over_b per stage; the first and last stage (the
    embedding, the LM head) ``end_factor`` times that."""
    scale = [1.0] * num_stages
    scale[0] = scale[-1] = end_factor
    return StageCosts(tuple(scale), tuple(b_over_f * s for s in scale),
                      tuple(b_over_f * w_over_b * s for s in scale))


def measured_costs(costs: StageCosts, noise: float, seed: int) -> StageCosts:
    """``costs`` with each entry off by a deterministic relative error in [-noise, noise]."""
    rng = random.Random(seed)

    def off(values: Sequence[float]) -> tuple[float, ...]:
        return tuple(v * (1 + rng.uniform(-noise, noise)) for v in values)

    return StageCosts(off(costs.forward), off(costs.backward), off(costs.weight), costs.p2p,
                      costs.all_to_all)


@dataclass
class GridPoint:
    """One point of the grid: makespans under the true costs, bound and the chosen schedule."""

    b_over_f: float
    w_over_b: float
    makespans: dict[str, float]
    lower_bound: float
    chosen: str
    chosen_makespan: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def best_known(self) -> float:
        """The fastest schedule the framework can build knowing the true costs."""
        return min(self.makespans[k] for k in ("zb known", "zb-h1", "1f1b", "chimera"))

    @property
    def gap_to_bound(self) -> float:
        """chosen / lower bound - 1."""
        return self.chosen_makespan / self.lower_bound - 1

    @property
    def gap_to_best_known(self) -> float:
        """chosen / best known - 1."""
        return self.chosen_makespan / self.best_known - 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready row."""
        return {"b_over_f": self.b_over_f, "w_over_b": self.w_over_b,
                "makespans": self.makespans, "lower_bound": self.lower_bound,
                "chosen": self.chosen, "chosen_makespan": self.chosen_makespan,
                "best_known": self.best_known, "gap_to_bound": self.gap_to_bound,
                "gap_to_best_known": self.gap_to_best_known, **self.extra}


def grid_point(num_ranks: int, num_microbatches: int, b_over_f: float, w_over_b: float,
               pipes: int = 2, end_factor: float = 1.0, noise: float = 0.02,
               seed: int = 0) -> GridPoint:
    """Build and simulate every column at one point (module docstring)."""
    truth = true_costs(num_ranks, b_over_f, w_over_b, end_factor)
    seen = measured_costs(truth, noise, seed)
    running = build_schedule("chimera-zb", num_ranks, num_microbatches, pipes=pipes)
    # what the framework does after profiling (knowing only the measured costs)
    report = rebuild_for_costs(running, ChimeraZBOptions(pipes=pipes), seen)
    schedules = {
        "zb 1:1:1": running,
        "zb measured": report.rebuilt.schedule,
        "zb known": build_schedule("chimera-zb", num_ranks, num_microbatches, pipes=pipes,
                                   costs=truth),
        "zb-h1": build_schedule("zb-h1", num_ranks, num_microbatches),
        "zb-h1 measured": build_schedule("zb-h1", num_ranks, num_microbatches, costs=seen),
    }
    makespans = {k: of_schedule(s, truth).makespan for k, s in schedules.items()}
    makespans["1f1b"] = predict("1f1b", None, num_ranks, num_microbatches, truth).makespan
    makespans["chimera"] = predict("chimera", ChimeraOptions(pipes=pipes), num_ranks,
                                   num_microbatches, truth).makespan
    chosen_true = of_schedule(report.schedule, truth).makespan
    bound = makespan_lower_bound(chimera_placement(num_ranks, pipes), num_microbatches // pipes,
                                 truth, num_ranks)
    if report.decision.fell_back:
        label = report.decision.chosen.label
    else:
        label = "zb measured" if report.changed else "zb 1:1:1"
    return GridPoint(b_over_f, w_over_b, makespans, bound, label, chosen_true,
                     {"D": num_ranks, "N": num_microbatches, "pipes": pipes,
                      "end_factor": end_factor, "noise": noise})


def cost_grid(num_ranks: int, num_microbatches: int, pipes: int = 2, end_factor: float = 1.0,
              noise: float = 0.02, seed: int = 0) -> list[GridPoint]:
    """Every point of :data:`B_OVER_F` x :data:`W_OVER_B` (the measurement error seeded per
    point from ``seed``)."""
    return [grid_point(num_ranks, num_microbatches, bf, wb, pipes, end_factor, noise,
                       seed * 1000 + i)
            for i, (bf, wb) in enumerate((bf, wb) for bf in B_OVER_F for wb in W_OVER_B)]


def format_grid(points: Sequence[GridPoint]) -> str:
    """Markdown table: per point every column's makespan, the bound, the chosen schedule and
    its gaps to the bound and to the best known."""
    header = ("| B/F | W/B | lower bound | " + " | ".join(COLUMNS)
              + " | chosen | chosen makespan | vs bound | vs best known |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for p in points:
        cells = " | ".join(f"{p.makespans[c]:.4g}" for c in COLUMNS)
        lines.append(f"| {p.b_over_f:g} | {p.w_over_b:g} | {p.lower_bound:.4g} | {cells} | "
                     f"{p.chosen} | {p.chosen_makespan:.4g} | {p.gap_to_bound:+.1%} | "
                     f"{p.gap_to_best_known:+.1%} |")
    return "\n".join(lines)
