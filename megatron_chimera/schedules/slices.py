"""Sequence-sliced pipelines (TeraPipe, Seq1F1B): each sequence of an iteration is cut into ``k``
slices that enter the pipeline one after another as separate pipeline units.

Units are the schedule's micro-batches: sequence ``q``'s slice ``j`` is micro-batch
``q * k + j`` (so a pipe owns whole sequences). A stage keeps the keys/values of a sequence's
earlier slices for the later slices' causal attention, which adds one same-stage dependency each
way (:func:`slice_input`): the forward of slice ``j`` follows the forward of slice ``j - 1``, and
the backward of slice ``j`` waits for the backward of slice ``j + 1`` (which returns the gradient
of the cached keys/values). Both ends are on one rank, so the rule is an order inside each rank's
list: :func:`slice_order_errors` (called by ``validate``) refuses an order that breaks it.

Later slices attend to more keys: with a fraction ``a`` of a sequence's work in attention
(quadratic in the tokens) and equal slice lengths, slice ``j`` costs
``(1 - a) / k + a (2j + 1) / k^2`` of the whole sequence (:func:`slice_work`); slice lengths that
balance the compute are shorter toward the end (:func:`balanced_slice_lengths`). The simulator
costs each slice by its work (``meta["slice_work"]``).

:func:`sliced_schedule` builds the per-rank orders of a placement (one pipe: 1F1B; Chimera's
two pipes) by greedy list scheduling on those costs: a free rank starts a ready backward
(lowest stage, then oldest), else a ready forward (oldest first) while its live slice
activations are under the cap; the emitted order is the order of start times, so running it in
order reproduces the timeline (deadlock free by construction; ``validate`` checks it anyway).
At D = 8 with 4 sequences and F = B the bubble falls from 1F1B's 64% to 15.8% for Chimera and
17.9% for 1F1B at k = 8 (tests/unit/schedules/test_sequence_slices.py).

The runtime does not run slices yet (no training flag): a stage would have to keep the
keys/values of a sequence's earlier slices and attend to them, see docs/LONG_SEQUENCES.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megatron_chimera.schedules.actions import BACKWARD, FORWARD, Action, Schedule
from megatron_chimera.schedules.chimera import check_chimera_ranks_and_pipes, chimera_placement


def slice_work(slices: int, attention_fraction: float) -> list[float]:
    """Work of each of ``slices`` equal-length slices of a causal sequence, as fractions of the
    whole sequence's (sums to 1)."""
    a, k = attention_fraction, slices
    return [(1 - a) / k + a * (2 * j + 1) / k**2 for j in range(k)]


def balanced_slice_lengths(seq_length: int, slices: int, attention_fraction: float
                           ) -> list[int]:
    """Token counts of ``slices`` slices of equal work (whole tokens, summing to
    ``seq_length``): slice boundaries ``t`` solve ``(1 - a) t + a t^2 = i / k``."""
    a, k = attention_fraction, slices
    bounds = []
    for i in range(k + 1):
        w = i / k
        t = w if a == 0 else (-(1 - a) + math.sqrt((1 - a) ** 2 + 4 * a * w)) / (2 * a)
        bounds.append(round(t * seq_length))
    return [b - a_ for a_, b in zip(bounds, bounds[1:])]


def slice_input(action: Action, slices: int) -> Action | None:
    """The same-stage action ``action`` must follow (keys/values of its sequence): the forward
    of the previous slice, or the backward of the next; None for a first forward or a last
    backward (and for W, whose input is its own B)."""
    kind, pipe, stage, unit = action
    j = unit % slices
    if kind == FORWARD and j > 0:
        return Action(FORWARD, pipe, stage, unit - 1)
    if kind == BACKWARD and j < slices - 1:
        return Action(BACKWARD, pipe, stage, unit + 1)
    return None


def slice_order_errors(schedule: Schedule) -> list[str]:
    """Where a rank's list runs a slice before the same-stage action it must follow."""
    k = schedule.sequence_slices
    if k == 1:
        return []
    errors = []
    for rank, actions in enumerate(schedule.actions):
        position = {a: i for i, a in enumerate(actions)}
        for i, a in enumerate(actions):
            before = slice_input(a, k)
            if before is not None and position.get(before, len(actions)) > i:
                errors.append(f"rank {rank}, index {i}: {a.short()} runs before "
                              f"{before.short()} (slice order of one sequence on one stage)")
    return errors


def _ready_time(a: Action, num_stages: int, slices: int, end: dict[Action, float]
                ) -> float | None:
    """When ``a``'s inputs (pipeline and slice order) have finished; None if not yet started."""
    kind, pipe, stage, unit = a
    deps = [slice_input(a, slices)]
    if kind == FORWARD:
        deps.append(None if stage == 0 else Action(FORWARD, pipe, stage - 1, unit))
    else:
        deps.append(Action(FORWARD, pipe, stage, unit) if stage == num_stages - 1
                    else Action(BACKWARD, pipe, stage + 1, unit))
    times = [0.0]
    for d in deps:
        if d is not None:
            if d not in end:
                return None
            times.append(end[d])
    return max(times)


def _list_orders(placement: list[list[int]], num_ranks: int, units_per_pipe: int, slices: int,
                 forward: Sequence[float], backward: Sequence[float], cap: int
                 ) -> list[list[Action]]:
    """Greedy list scheduling of every pipe's units (see the module docstring)."""
    num_stages = len(placement[0])
    pending: list[list[Action]] = [[] for _ in range(num_ranks)]
    for pipe, stages in enumerate(placement):
        for stage, rank in enumerate(stages):
            for i in range(units_per_pipe):
                unit = pipe * units_per_pipe + i
                pending[rank] += [Action(FORWARD, pipe, stage, unit),
                                  Action(BACKWARD, pipe, stage, unit)]

    def backward_key(a: Action) -> tuple[int, int, int]:
        # lowest stage first (nearest to finishing its unit), then oldest sequence, last slice
        return (a.stage, a.microbatch // slices, -(a.microbatch % slices))

    def forward_key(a: Action) -> tuple[int, int, int]:  # oldest unit of its pipe first
        return (a.microbatch % units_per_pipe, a.pipe, -a.stage)

    end: dict[Action, float] = {}
    free = [0.0] * num_ranks
    live = [0] * num_ranks
    orders: list[list[Action]] = [[] for _ in range(num_ranks)]
    releases: list[tuple[float, int]] = []  # (time, rank): a backward frees an activation
    t = 0.0
    while any(pending):
        for rank in range(num_ranks):
            if free[rank] > t or not pending[rank]:
                continue
            ready = [a for a in pending[rank]
                     if (r := _ready_time(a, num_stages, slices, end)) is not None and r <= t]
            backwards = [a for a in ready if a.kind == BACKWARD]
            forwards = [a for a in ready if a.kind == FORWARD] if live[rank] < cap else []
            if not backwards and not forwards:
                continue
            a = min(backwards, key=backward_key) if backwards else min(forwards, key=forward_key)
            cost = (forward if a.kind == FORWARD else backward)[a.microbatch % slices]
            pending[rank].remove(a)
            orders[rank].append(a)
            end[a] = free[rank] = t + cost
            if a.kind == FORWARD:
                live[rank] += 1
            else:
                releases.append((t + cost, rank))
        for when, rank in [r for r in releases if r[0] <= t]:
            live[rank] -= 1
            releases.remove((when, rank))
        later = [f for f in free if f > t] + [r[0] for r in releases if r[0] > t]
        if not later:
            if any(pending):
                raise ValueError(f"sliced schedule: the activation cap {cap} leaves every rank "
                                 "waiting (raise the cap)")
            break
        t = min(later)
    return orders


def sliced_schedule(name: str, num_ranks: int, num_sequences: int, slices: int,
                    attention_fraction: float = 0.0, backward_ratio: float = 1.0,
                    cap: int | None = None) -> Schedule:
    """``name`` ``"1f1b"`` (one pipe) or ``"chimera"`` (two pipes) over ``num_ranks`` ranks with
    ``num_sequences`` sequences per iteration, each cut into ``slices`` slices; the orders are
    built for forward cost ``slice_work`` and backward ``backward_ratio`` times it. ``cap``: live
    slice activations per rank (default ``num_ranks x slices``: at most the unsliced schedules'
    D micro-batches of activations)."""
    if slices < 1 or num_sequences < 1 or num_ranks < 1:
        raise ValueError("--pipeline-sequence-slices, the sequences and the ranks must be >= 1")
    if name == "1f1b":
        placement = [list(range(num_ranks))]
    elif name == "chimera":
        check_chimera_ranks_and_pipes(num_ranks, 2, "Chimera")
        if num_sequences % 2:
            raise ValueError(f"sliced Chimera gives each of its 2 pipes whole sequences: "
                             f"{num_sequences} sequences do not split evenly")
        placement = chimera_placement(num_ranks, 2)
    else:
        raise ValueError(f"sequence slices are built for 1f1b and chimera, not {name!r}")
    work = slice_work(slices, attention_fraction)
    units = num_sequences * slices
    orders = _list_orders(placement, num_ranks, units // len(placement), slices, work,
                          [backward_ratio * w for w in work], cap or num_ranks * slices)
    return Schedule(name=f"{name}-sliced", num_ranks=num_ranks, num_stages=num_ranks,
                    num_pipes=len(placement), num_microbatches=units, placement=placement,
                    actions=orders, meta={"slice_work": work}, sequence_slices=slices)
