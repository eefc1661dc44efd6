"""Schedules with a split backward: Chimera-ZB (bidirectional pipes, W fills the bubbles) and ZB-H1.

Both split each backward into B (input gradient, on the critical path) and W (weight gradient,
free to run later on the same rank). An activation stays in flight from its F until its W.

* ``chimera_zb``: Chimera's placement of 2f pipes, ordered by an event-driven greedy list scheduler
  (:mod:`.list_scheduler`) run over a few priority variants; the variant with the shortest makespan
  under the given relative costs wins (stop early at the lower bound). See docs/CHIMERA_ZB.md.
* ``zb_h1``: the zero-bubble paper's ZB-H1 (Qi et al., ICLR'24): 1F1B whose W passes on rank i are
  delayed by i steps so that they fill the cool-down bubbles; bubble (D-1)(F+B-W) instead of
  1F1B's (D-1)(F+B+W), every rank holds at most D activations (1F1B's peak, on its first rank).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

from megatron_chimera.schedules.actions import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Action,
    Schedule,
    single_pipe,
)
from megatron_chimera.schedules.chimera import check_chimera_ranks_and_pipes, chimera_placement
from megatron_chimera.schedules.list_scheduler import (
    CapDeadlock,
    ListResult,
    Priority,
    list_schedule,
)

DEFAULT_COSTS = (1.0, 1.0, 1.0)


def _check_chimera_zb_sizes(num_ranks: int, num_microbatches: int, pipes: int) -> None:
    check_chimera_ranks_and_pipes(num_ranks, pipes, "chimera-zb")
    if num_microbatches < pipes or num_microbatches % pipes:
        raise ValueError(
            f"--num-microbatches must be a positive multiple of --chimera-pipes = {pipes} for "
            f"chimera-zb, got {num_microbatches}"
        )


def _check_costs(costs: Sequence[float]) -> tuple[float, float, float]:
    if len(costs) != 3 or any(not c > 0 for c in costs):
        raise ValueError(
            f"chimera-zb costs must be three positive relative times (F, B, W), got {costs!r}"
        )
    return float(costs[0]), float(costs[1]), float(costs[2])


def makespan_lower_bound(
    placement: Sequence[Sequence[int]],
    microbatches_per_pipe: int,
    costs: tuple[float, float, float],
    num_ranks: int,
) -> float:
    """Simple lower bound on the makespan with zero communication cost.

    The larger of (a) per rank, the time its first input can arrive (the F's of all earlier
    stages of a pipe) plus all its work, and (b) one micro-batch's F-B chain through every stage
    plus its last W.
    """
    f, b, w = costs
    num_stages = len(placement[0])
    first_input = [float("inf")] * num_ranks
    work = [0.0] * num_ranks
    for pipe_ranks in placement:
        for stage, rank in enumerate(pipe_ranks):
            first_input[rank] = min(first_input[rank], stage * f)
            work[rank] += microbatches_per_pipe * (f + b + w)
    per_rank = max(first_input[r] + work[r] for r in range(num_ranks) if work[r])
    chain = num_stages * (f + b) + w
    return max(per_rank, chain)


# (guard, quota bias, quota overbook) tried in phase 1 of the search
GUARD_VARIANTS = (
    [("none", 0.0, 0)]
    + [("quota", bias, 0) for bias in (-2.0, -1.0, 0.0, 1.0, 2.0, 4.0)]
    + [("quota", bias, 1) for bias in (0.0, 1.0, 4.0)]
    + [("quota", bias, -1) for bias in (-2.0, 0.0)]
    + [("reserve", 0.0, 0), ("safe", 0.0, 0)]
)


def _refinements(guard: str, bias: float, overbook: int, cap: int) -> list[Priority]:
    """Choice-rule variants tried with one cap guard (phase 2 of the search)."""
    soft_caps: list[int | None] = [None]
    for c in (cap - 1, cap - 2, (cap + 1) // 2):
        if c >= 1 and c not in soft_caps:
            soft_caps.append(c)
    return [
        Priority(backward, forward, soft_cap, eager, guard, bias, overbook)
        for backward, forward, soft_cap, eager in itertools.product(
            ("stage", "microbatch"), ("balance", "stage"), soft_caps, (False, True)
        )
    ]


class _Search:
    """Keeps the shortest list schedule seen; stops once one reaches the lower bound."""

    def __init__(
        self,
        placement: list[list[int]],
        pipe_microbatches: list[list[int]],
        costs: tuple[float, float, float],
        cap: int,
        lower_bound: float,
    ) -> None:
        self.args = (placement, pipe_microbatches, costs)
        self.caps = [cap] * len({r for ranks in placement for r in ranks})
        self.lower_bound = lower_bound
        self.best: tuple[ListResult, Priority] | None = None
        self.makespans: dict[Priority, float] = {}  # variants already run

    @property
    def done(self) -> bool:
        return self.best is not None and self.best[0].makespan <= self.lower_bound + 1e-9

    def evaluate(self, priority: Priority) -> float:
        """Makespan of ``priority`` (inf if it deadlocks); remembers the best."""
        if self.done:
            return float("inf")
        # an eager W ignores the soft cap, so those variants schedule alike: run one of them
        key = replace(priority, soft_cap=None) if priority.eager_weight else priority
        if key not in self.makespans:
            self.makespans[key] = self._run(priority)
        return self.makespans[key]

    def _run(self, priority: Priority) -> float:
        try:
            result = list_schedule(*self.args, self.caps, priority)
        except CapDeadlock:
            return float("inf")  # unguarded variant stuck, or a cap too small for quotas
        if self.best is None or result.makespan < self.best[0].makespan - 1e-9:
            self.best = (result, priority)
        return result.makespan


def _best_list_schedule(
    placement: list[list[int]],
    pipe_microbatches: list[list[int]],
    costs: tuple[float, float, float],
    cap: int,
    lower_bound: float,
) -> tuple[ListResult, Priority]:
    """Two-phase search: every cap guard with default choice rules, then refine the best two."""
    search = _Search(placement, pipe_microbatches, costs, cap, lower_bound)
    scores = []
    for guard, bias, overbook in GUARD_VARIANTS:
        makespan = min(
            search.evaluate(Priority(b, guard=guard, quota_bias=bias, quota_overbook=overbook))
            for b in ("stage", "microbatch")
        )
        scores.append((makespan, guard, bias, overbook))
    for _, guard, bias, overbook in sorted(scores)[:2]:
        for priority in _refinements(guard, bias, overbook, cap):
            search.evaluate(priority)
    assert search.best is not None, "the guarded variants cannot deadlock with a cap >= 1"
    return search.best


def chimera_zb(
    num_ranks: int,
    num_microbatches: int,
    pipes: int = 2,
    max_inflight: int | None = None,
    costs: Sequence[float] = DEFAULT_COSTS,
) -> Schedule:
    """Chimera with split backward: 2f bidirectional pipes whose W actions fill the bubbles.

    At most ``max_inflight`` (default D) activations per rank are alive at once (F to W).
    ``costs`` are the relative F, B, W times the order is optimised for.
    """
    _check_chimera_zb_sizes(num_ranks, num_microbatches, pipes)
    cap = num_ranks if max_inflight is None else max_inflight
    if cap < 1:
        raise ValueError(f"--chimera-max-inflight must be >= 1, got {cap}")
    costs3 = _check_costs(costs)
    placement = chimera_placement(num_ranks, pipes)
    per_pipe = num_microbatches // pipes
    pipe_microbatches = [list(range(p * per_pipe, (p + 1) * per_pipe)) for p in range(pipes)]
    bound = makespan_lower_bound(placement, per_pipe, costs3, num_ranks)
    result, priority = _best_list_schedule(placement, pipe_microbatches, costs3, cap, bound)
    return Schedule(
        name="chimera-zb",
        num_ranks=num_ranks,
        num_stages=num_ranks,
        num_pipes=pipes,
        num_microbatches=num_microbatches,
        placement=placement,
        actions=result.actions,
        split_backward=True,
        meta={
            "max_inflight": cap,
            "costs": list(costs3),
            "model_makespan": result.makespan,
            "lower_bound": bound,
            "priority": (
                f"B:{priority.backward},F:{priority.forward},soft_cap:{priority.soft_cap},"
                f"eager_w:{priority.eager_weight},guard:{priority.guard}:{priority.quota_bias:g}"
                f":{priority.quota_overbook}"
            ),
        },
    )


def zb_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with B/W split; rank i delays its W's by i steps to fill the cool-down.

    Rank i warms up with D-1-i forwards like 1F1B, then runs (F, B) pairs, adding a W after each
    pair once i B's are pending, then drains (B, W) and the remaining W's.
    """

    def rank_order(rank: int) -> list[Action]:
        warmup = min(num_ranks - 1 - rank, num_microbatches)
        order = [Action(FORWARD, 0, rank, m) for m in range(warmup)]
        backwards = weights = 0
        for m in range(warmup, num_microbatches):
            order += [Action(FORWARD, 0, rank, m), Action(BACKWARD, 0, rank, backwards)]
            backwards += 1
            if backwards > rank:
                order.append(Action(WEIGHT, 0, rank, weights))
                weights += 1
        for m in range(backwards, num_microbatches):
            order += [Action(BACKWARD, 0, rank, m), Action(WEIGHT, 0, rank, weights)]
            weights += 1
        return order + [Action(WEIGHT, 0, rank, m) for m in range(weights, num_microbatches)]

    return single_pipe("zb-h1", num_ranks, num_microbatches, rank_order, split_backward=True)
