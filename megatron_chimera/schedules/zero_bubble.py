"""Schedules with a split backward: Chimera-ZB (bidirectional pipes, W fills the bubbles) and ZB-H1.

Both split each backward into B (input gradient, on the critical path) and W (weight gradient,
free to run later on the same rank). An activation stays in flight from its F until its W.

* ``chimera_zb``: Chimera's placement of 2f pipes, ordered by an event-driven greedy list scheduler
  (:mod:`.list_scheduler`) run over a few priority variants; the variant with the shortest makespan
  under the given costs wins (stop early at the lower bound). See docs/CHIMERA_ZB.md.
* ``zb_h1``: the zero-bubble paper's ZB-H1 (Qi et al., ICLR'24): 1F1B whose W passes on rank i are
  delayed by i steps so that they fill the cool-down bubbles; bubble (D-1)(F+B-W) instead of
  1F1B's (D-1)(F+B+W), every rank holds at most D activations (1F1B's peak, on its first rank).
  Given costs, the list scheduler also orders the same placement within the same per-rank
  memory, and the shorter of the two orders under those costs is kept.

Costs are per-stage F, B (input gradient), W and one p2p message time
(:class:`~.costs.StageCosts`), or ``(F, B, W)`` for every stage; the lower bound accounts for
all of them.
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
from megatron_chimera.schedules.chimera import (
    CONCAT_FORWARD_DOUBLING,
    CONCAT_NAMES,
    check_chimera_ranks_and_pipes,
    chimera,
    chimera_placement,
)
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.list_scheduler import (
    CapDeadlock,
    ListResult,
    Priority,
    list_schedule,
    replay,
)
from megatron_chimera.schedules.one_f_one_b import one_f_one_b
from megatron_chimera.schedules.walk import no_cyclic_gc
from megatron_chimera.schedules.weight_fill import fill_weights, peak_live, split_adjacent

DEFAULT_COSTS = (1.0, 1.0, 1.0)


def _check_chimera_zb_sizes(num_ranks: int, num_microbatches: int, pipes: int) -> None:
    check_chimera_ranks_and_pipes(num_ranks, pipes, "chimera-zb")
    if num_microbatches < pipes or num_microbatches % pipes:
        raise ValueError(
            f"--num-microbatches must be a positive multiple of --chimera-pipes = {pipes} for "
            f"chimera-zb, got {num_microbatches}"
        )


CAP_FLAG = "--pipeline-activation-cap"


def chunk_cap(activation_cap: float, stage_size: float, need: int) -> int:
    """The cap on live activations per rank in the schedule's own stages: ``activation_cap``
    is in units of one micro-batch's activations on L/D layers, a stage holds ``stage_size`` of
    them (a half-size V chunk 0.5). ValueError naming the flag below ``need`` stages (what one
    micro-batch keeps alive on a rank of its path)."""
    if not activation_cap > 0:
        raise ValueError(f"{CAP_FLAG} must be > 0, got {activation_cap}")
    cap = int(activation_cap / stage_size + 1e-9)
    if cap < need:
        raise ValueError(f"{CAP_FLAG} must be at least {need * stage_size:g} (one micro-batch's "
                         f"activations on a rank of its path), got {activation_cap:g}")
    return cap


def split_costs(costs: StageCosts | Sequence[float], num_stages: int) -> StageCosts:
    """``costs`` as per-stage StageCosts (ValueError naming ``--chimera-zb-costs``)."""
    try:
        return StageCosts.of(costs, num_stages)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--chimera-zb-costs: split-backward costs must be three positive "
                         f"times F,B,W or per-stage costs: {exc}") from None


def meta_costs(costs: StageCosts) -> list[float] | dict:
    """``schedule.meta["costs"]``: ``[F, B, W]`` for uniform costs without p2p, else the dict."""
    if costs.is_uniform() and not costs.p2p:
        return [costs.forward[0], costs.backward[0], costs.weight[0]]
    return costs.to_dict()


def makespan_lower_bound(
    placement: Sequence[Sequence[int]],
    microbatches_per_pipe: int,
    costs: StageCosts | Sequence[float],
    num_ranks: int,
) -> float:
    """A lower bound on the makespan of any order of these replicas under ``costs``.

    The largest of, per rank, (a) the time its first input can arrive (the F's of all earlier
    stages of a pipe, plus one p2p message per hop between ranks) plus all its work, and (b) that
    time plus its F and B work plus the shortest tail that must follow the rank's last B (the B's
    of the earlier stages of that pipe, their messages, and W of stage 0); and (c) one
    micro-batch's F-B chain through every stage plus its last W.
    """
    num_stages = len(placement[0])
    c = split_costs(costs, num_stages)
    f, b, w, p2p = c.forward, c.backward, c.weight, c.p2p
    first_input = [float("inf")] * num_ranks
    tail = [float("inf")] * num_ranks
    work = [0.0] * num_ranks
    forward_backward = [0.0] * num_ranks
    chain = 0.0
    for ranks in placement:
        hop = [p2p if ranks[s] != ranks[s + 1] else 0.0 for s in range(num_stages - 1)]
        head = 0.0
        heads = []
        for s in range(num_stages):
            heads.append(head)
            if s < num_stages - 1:
                head += f[s] + hop[s]
        # after the B of stage s: B's of stages s-1 .. 0 (and their messages), then a W
        after_b = [0.0] * num_stages
        for s in range(1, num_stages):
            after_b[s] = after_b[s - 1] + b[s - 1] + hop[s - 1]
        for s, rank in enumerate(ranks):
            first_input[rank] = min(first_input[rank], heads[s])
            tail[rank] = min(tail[rank], after_b[s] + w[0] if s else w[0])
            work[rank] += microbatches_per_pipe * (f[s] + b[s] + w[s])
            forward_backward[rank] += microbatches_per_pipe * (f[s] + b[s])
        # one micro-batch: forwards to the last stage, backwards down to stage k, then W of k
        down = heads[-1] + f[-1]
        chain = max(chain, max(down + sum(b[k:]) + sum(hop[k:]) + w[k]
                               for k in range(num_stages)))
    per_rank = max(max(first_input[r] + work[r], first_input[r] + forward_backward[r] + tail[r])
                   for r in range(num_ranks) if work[r])
    return max(per_rank, chain)


# (guard, quota bias, quota overbook) tried in phase 1 of the search
GUARD_VARIANTS = (
    [("none", 0.0, 0)]
    + [("quota", bias, 0) for bias in (-2.0, -1.0, 0.0, 1.0, 2.0, 4.0)]
    + [("quota", bias, 1) for bias in (0.0, 1.0, 4.0)]
    + [("quota", bias, -1) for bias in (-2.0, 0.0)]
    + [("reserve", 0.0, 0), ("safe", 0.0, 0)]
)
# one replica per rank: a quota is the whole cap
SINGLE_PIPE_GUARDS = (("none", 0.0, 0), ("reserve", 0.0, 0), ("safe", 0.0, 0))


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


# the list-scheduler runs a search may spend, counted in simulated actions (a run of a schedule
# with A actions costs A; the banker's check of the "safe" guard counts 4x): the whole search at
# D=8, N=32; beyond, the variants in order until the budget is spent (the seeds always run). A
# search that could not try MIN_VARIANTS variants is skipped: one or two rarely beat the seeds.
SEARCH_BUDGET_ACTIONS = 60_000
MIN_VARIANTS = 8
_GUARD_WEIGHT = {"safe": 4}


class _Search:
    """Keeps the shortest order seen; stops at the lower bound or when the budget is spent."""

    def __init__(
        self,
        placement: list[list[int]],
        pipe_microbatches: list[list[int]],
        costs: StageCosts,
        caps: list[int],
        lower_bound: float,
        budget: int,
    ) -> None:
        self.args = (placement, pipe_microbatches, costs)
        self.caps = caps
        self.lower_bound = lower_bound
        self.actions = 3 * len(placement[0]) * sum(len(m) for m in pipe_microbatches)
        self.budget = budget
        self.best: tuple[ListResult, str] | None = None
        self.makespans: dict[Priority, float] = {}  # variants already run

    @property
    def done(self) -> bool:
        return self.best is not None and self.best[0].makespan <= self.lower_bound + 1e-9

    def offer(self, result: ListResult, label: str) -> None:
        """Keep ``result`` if it is the shortest so far (ties: the earlier one)."""
        if self.best is None or result.makespan < self.best[0].makespan - 1e-9:
            self.best = (result, label)

    def seed(self, label: str, unsplit_order: list[list[Action]]) -> None:
        """An unsplit order as a split one: W right after B, and W filling the waits. A split
        order (with W's) is also tried as given, then as the unsplit order of its F's and B's."""
        placement, _, costs = self.args
        if self.done:
            return
        if any(a.kind == WEIGHT for actions in unsplit_order for a in actions):
            self._offer_order(label, unsplit_order)
            unsplit_order = [[a for a in actions if a.kind != WEIGHT] for actions in unsplit_order]
        if not self._offer_order(label, split_adjacent(unsplit_order)):
            return  # W-fill only delays W's: it would need even more live activations
        self.offer(fill_weights(unsplit_order, placement, costs, self.caps),
                   f"seed:{label}+W-fill")

    def _offer_order(self, label: str, order: list[list[Action]]) -> bool:
        """Offer a split order as it is (False, not offered, if it exceeds a cap)."""
        placement, _, costs = self.args
        peaks = [peak_live(actions) for actions in order]
        if any(peak > cap for peak, cap in zip(peaks, self.caps)):
            return False
        start = replay(order, placement, costs)
        durations = costs.durations()
        makespan = max(t + durations[a.kind][a.stage] for a, t in start.items())
        self.offer(ListResult(order, start, makespan, peaks), f"seed:{label}")
        return True

    def evaluate(self, priority: Priority) -> float:
        """Makespan of ``priority`` (inf if it deadlocks, or if the search is over)."""
        if self.done:
            return float("inf")
        # an eager W ignores the soft cap, so those variants schedule alike: run one of them
        key = replace(priority, soft_cap=None) if priority.eager_weight else priority
        if key not in self.makespans:
            cost = self.actions * _GUARD_WEIGHT.get(priority.guard, 1)
            if cost > self.budget:
                return float("inf")
            self.budget -= cost
            self.makespans[key] = self._run(priority)
        return self.makespans[key]

    def _run(self, priority: Priority) -> float:
        try:
            result = list_schedule(*self.args, self.caps, priority)
        except CapDeadlock:
            return float("inf")  # unguarded variant stuck, or a cap too small for quotas
        self.offer(result, _describe(priority))
        return result.makespan


def best_order(
    placement: list[list[int]],
    pipe_microbatches: list[list[int]],
    costs: StageCosts,
    caps: list[int],
    lower_bound: float,
    seeds: Sequence[tuple[str, list[list[Action]]]] = (),
    guards: Sequence[tuple[str, float, int]] = GUARD_VARIANTS,
    budget: int | None = None,
) -> tuple[ListResult, str]:
    """The shortest of: the seeds (unsplit orders, W adjacent or filling the waits), then the
    list scheduler's two-phase search -- every cap guard with default choice rules, then
    refinements of the best two -- within ``budget``; stops at ``lower_bound``."""
    cap = max(caps)
    budget = SEARCH_BUDGET_ACTIONS if budget is None else budget
    search = _Search(placement, pipe_microbatches, costs, caps, lower_bound, budget)
    if search.actions * MIN_VARIANTS > budget:
        search.budget = 0
    for label, order in seeds:
        search.seed(label, order)
    scores = []
    for guard, bias, overbook in guards:
        makespan = min(
            search.evaluate(Priority(b, guard=guard, quota_bias=bias, quota_overbook=overbook))
            for b in ("stage", "microbatch")
        )
        scores.append((makespan, guard, bias, overbook))
    for _, guard, bias, overbook in sorted(scores)[:2]:
        for priority in _refinements(guard, bias, overbook, cap):
            search.evaluate(priority)
    if search.best is None:  # no seed fits the cap and no list run did: one cheap safe run
        search.budget = search.actions
        search.evaluate(Priority(guard="reserve"))
    assert search.best is not None, "the reserve guard cannot deadlock with a cap >= 1"
    return search.best


def _chimera_seeds(num_ranks: int, num_microbatches: int, pipes: int,
                   cap: int) -> list[tuple[str, list[list[Action]]]]:
    """Chimera's unsplit orders on the same placement, one per concatenation that applies
    (forward doubling only with room for its up to 2D live activations)."""
    seeds = []
    concats = (None,) if num_microbatches <= num_ranks else [
        c for c in CONCAT_NAMES if c != CONCAT_FORWARD_DOUBLING or cap >= 2 * num_ranks]
    for concat in concats:
        try:
            unsplit = chimera(num_ranks, num_microbatches, pipes=pipes, concat=concat)
        except ValueError:
            continue  # e.g. forward doubling needs two pipes and N a multiple of 2D
        seeds.append((f"chimera/{concat or 'basic'}", unsplit.actions))
    return seeds


def chimera_zb(
    num_ranks: int,
    num_microbatches: int,
    pipes: int = 2,
    max_inflight: int | None = None,
    costs: StageCosts | Sequence[float] = DEFAULT_COSTS,
    activation_cap: float | None = None,
) -> Schedule:
    """Chimera with split backward: 2f bidirectional pipes whose W actions fill the bubbles.

    At most ``max_inflight`` (default D) activations per rank are alive at once (F to W), and
    at most ``activation_cap`` (``--pipeline-activation-cap``) when given.
    ``costs`` are the per-stage F, B, W (and p2p) times the order is optimised for
    (:class:`~.costs.StageCosts`), or ``(F, B, W)`` for every stage.
    """
    _check_chimera_zb_sizes(num_ranks, num_microbatches, pipes)
    cap = num_ranks if max_inflight is None else max_inflight
    if cap < 1:
        raise ValueError(f"--chimera-max-inflight must be >= 1, got {cap}")
    if activation_cap is not None:
        cap = min(cap, chunk_cap(activation_cap, 1.0, 1))
    stage_costs = split_costs(costs, num_ranks)
    placement = chimera_placement(num_ranks, pipes)
    per_pipe = num_microbatches // pipes
    pipe_microbatches = [list(range(p * per_pipe, (p + 1) * per_pipe)) for p in range(pipes)]
    bound = makespan_lower_bound(placement, per_pipe, stage_costs, num_ranks)
    with no_cyclic_gc():
        seeds = _chimera_seeds(num_ranks, num_microbatches, pipes, cap)
        result, variant = best_order(placement, pipe_microbatches, stage_costs,
                                     [cap] * num_ranks, bound, seeds)
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
            "costs": meta_costs(stage_costs),
            "model_makespan": result.makespan,
            "lower_bound": bound,
            "priority": variant,
        },
    )


def _describe(priority: Priority) -> str:
    return (f"B:{priority.backward},F:{priority.forward},soft_cap:{priority.soft_cap},"
            f"eager_w:{priority.eager_weight},guard:{priority.guard}:{priority.quota_bias:g}"
            f":{priority.quota_overbook}")


def _zb_h1_order(num_ranks: int, num_microbatches: int) -> list[list[Action]]:
    """ZB-H1's closed-form order (see :func:`zb_h1`)."""

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

    return [rank_order(rank) for rank in range(num_ranks)]


def zb_h1(num_ranks: int, num_microbatches: int,
          costs: StageCosts | Sequence[float] | None = None,
          activation_cap: float | None = None) -> Schedule:
    """ZB-H1: 1F1B with B/W split; rank i delays its W's by i steps to fill the cool-down.

    Rank i warms up with D-1-i forwards like 1F1B, then runs (F, B) pairs, adding a W after each
    pair once i B's are pending, then drains (B, W) and the remaining W's. With ``costs``
    (per-stage F, B, W and p2p, or ``(F, B, W)``) the list scheduler also orders the pipe under
    those costs with each rank's peak of live activations capped at the closed form's, and the
    order with the shorter makespan under the costs is kept (the closed form on ties). With
    ``activation_cap`` (``--pipeline-activation-cap``) the caps are at most that, and the closed
    form competes only where it fits.
    """
    order = _zb_h1_order(num_ranks, num_microbatches)
    schedule = single_pipe("zb-h1", num_ranks, num_microbatches, order.__getitem__,
                           split_backward=True)
    caps = [max(1, peak_live(actions)) for actions in order]
    closed_fits = True
    if activation_cap is not None:
        limit = chunk_cap(activation_cap, 1.0, 1)
        closed_fits = max(caps) <= limit
        caps = [min(cap, limit) for cap in caps]
        schedule.meta["activation_cap"] = limit
    if costs is None and closed_fits:
        return schedule
    stage_costs = split_costs(DEFAULT_COSTS if costs is None else costs, num_ranks)
    placement = schedule.placement
    bound = makespan_lower_bound(placement, num_microbatches, stage_costs, num_ranks)
    closed = float("inf")
    if closed_fits:
        start = replay(order, placement, stage_costs)
        closed = max(t + stage_costs.durations()[a.kind][a.stage] for a, t in start.items())
    schedule.meta.update(costs=meta_costs(stage_costs), model_makespan=closed,
                         lower_bound=bound, priority="closed-form")
    if closed <= bound + 1e-9:
        return schedule
    with no_cyclic_gc():
        seeds = [("1f1b", one_f_one_b(num_ranks, num_microbatches).actions)]
        result, variant = best_order(placement, [list(range(num_microbatches))], stage_costs,
                                     caps, bound, seeds, SINGLE_PIPE_GUARDS)
    if result.makespan < closed - 1e-9:
        schedule.actions = result.actions
        schedule.meta.update(model_makespan=result.makespan, priority=variant)
    return schedule
