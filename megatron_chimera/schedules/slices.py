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
With a split backward (``zb-h1``, ``chimera-zb``) a rank with nothing else to start runs a
ready W. At D = 8 with 4 sequences and F = B the bubble falls from 1F1B's 64% to 15.8% for
Chimera and 17.9% for 1F1B at k = 8; Chimera-ZB (W = B/2) idles 9.9% at k = 4 and 4.5% at
k = 8 (tests/unit/schedules/test_sequence_slices.py).

The executor runs these orders (``model/sequence_slices.py`` keeps the keys/values of a
sequence's earlier slices; tests/distributed/test_sequence_slices.py); training takes them with
``--pipeline-sequence-slices k`` (docs/LONG_SEQUENCES.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from megatron_chimera.schedules.actions import BACKWARD, FORWARD, KINDS, WEIGHT, Action, Schedule
from megatron_chimera.schedules.chimera import check_chimera_ranks_and_pipes, chimera_placement

SLICED_SCHEDULES = ("1f1b", "zb-h1", "chimera", "chimera-zb")


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
    elif kind == BACKWARD:
        deps.append(Action(FORWARD, pipe, stage, unit) if stage == num_stages - 1
                    else Action(BACKWARD, pipe, stage + 1, unit))
    else:
        deps.append(Action(BACKWARD, pipe, stage, unit))
    times = [0.0]
    for d in deps:
        if d is not None:
            if d not in end:
                return None
            times.append(end[d])
    return max(times)


class _Costs(NamedTuple):
    """Seconds of each kind of action by stage, then slice index."""

    forward: Sequence[Sequence[float]]
    backward: Sequence[Sequence[float]]  # the input-gradient part with a split backward
    weight: Sequence[Sequence[float]]


def _list_orders(placement: list[list[int]], units_per_pipe: int, slices: int, costs: _Costs,
                 cap: int, split_backward: bool) -> list[list[Action]]:
    """Greedy list scheduling of every pipe's units (see the module docstring); with
    ``split_backward`` a rank with nothing else to start runs a ready W (which frees its
    activation)."""
    num_stages, num_ranks = len(placement[0]), len(placement[0])
    kinds = (FORWARD, BACKWARD, WEIGHT) if split_backward else (FORWARD, BACKWARD)
    release = WEIGHT if split_backward else BACKWARD
    pending: list[list[Action]] = [[] for _ in range(num_ranks)]
    for pipe, stages in enumerate(placement):
        for stage, rank in enumerate(stages):
            for i in range(units_per_pipe):
                pending[rank] += [Action(kind, pipe, stage, pipe * units_per_pipe + i)
                                  for kind in kinds]

    def backward_key(a: Action) -> tuple[int, int, int]:
        # lowest stage first (nearest to finishing its unit), then oldest sequence, last slice
        return (a.stage, a.microbatch // slices, -(a.microbatch % slices))

    def forward_key(a: Action) -> tuple[int, int, int]:  # oldest unit of its pipe first
        return (a.microbatch % units_per_pipe, a.pipe, -a.stage)

    duration = {FORWARD: costs.forward, BACKWARD: costs.backward, WEIGHT: costs.weight}
    end: dict[Action, float] = {}
    free = [0.0] * num_ranks
    live = [0] * num_ranks
    orders: list[list[Action]] = [[] for _ in range(num_ranks)]
    releases: list[tuple[float, int]] = []  # (time, rank): an activation is freed
    t = 0.0
    while any(pending):
        for when, rank in [r for r in releases if r[0] <= t]:
            live[rank] -= 1
            releases.remove((when, rank))
        for rank in range(num_ranks):
            if free[rank] > t or not pending[rank]:
                continue
            ready: dict[str, list[Action]] = {kind: [] for kind in KINDS}
            for a in pending[rank]:
                r = _ready_time(a, num_stages, slices, end)
                if r is not None and r <= t:
                    ready[a.kind].append(a)
            if ready[BACKWARD]:
                a = min(ready[BACKWARD], key=backward_key)
            elif ready[FORWARD] and live[rank] < cap:
                a = min(ready[FORWARD], key=forward_key)
            elif ready[WEIGHT]:
                a = min(ready[WEIGHT], key=backward_key)
            else:
                continue
            pending[rank].remove(a)
            orders[rank].append(a)
            end[a] = free[rank] = t + duration[a.kind][a.stage][a.microbatch % slices]
            if a.kind == FORWARD:
                live[rank] += 1
            elif a.kind == release:
                releases.append((end[a], rank))
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
                    weight_fraction: float = 0.5, cap: int | None = None,
                    stage_costs: tuple[Sequence[float], Sequence[float], Sequence[float]]
                    | None = None) -> Schedule:
    """``name`` ``"1f1b"`` / ``"zb-h1"`` (one pipe) or ``"chimera"`` / ``"chimera-zb"`` (two
    pipes) over ``num_ranks`` ranks with ``num_sequences`` sequences per iteration, each cut into
    ``slices`` slices; the orders are built for forward cost ``slice_work``, backward
    ``backward_ratio`` times it, of which ``weight_fraction`` is the W of the split-backward
    schedules (``zb-h1``, ``chimera-zb``). ``cap``: live slice activations per rank (default
    ``num_ranks x slices``: at most the unsliced schedules' D micro-batches of activations).
    ``stage_costs`` (measured: the profile-guided rebuild, ``StageCosts``' forward, backward,
    weight) replaces the ratios: per stage the F, B (input gradient) and W of a whole sequence,
    slice j charged ``slice_work[j]`` of them (as the simulator does)."""
    if slices < 1 or num_sequences < 1 or num_ranks < 1:
        raise ValueError("--pipeline-sequence-slices, the sequences and the ranks must be >= 1")
    if name not in SLICED_SCHEDULES:
        raise ValueError(f"sequence slices are built for {SLICED_SCHEDULES}, not {name!r}")
    split = name in ("zb-h1", "chimera-zb")
    if name.startswith("chimera"):
        check_chimera_ranks_and_pipes(num_ranks, 2, "Chimera")
        if num_sequences % 2:
            raise ValueError(f"sliced Chimera gives each of its 2 pipes whole sequences: "
                             f"{num_sequences} sequences do not split evenly")
        placement = chimera_placement(num_ranks, 2)
    else:
        placement = [list(range(num_ranks))]
    work = slice_work(slices, attention_fraction)
    if stage_costs is None:
        stage_costs = ((1.0,) * num_ranks, (backward_ratio * (1 - weight_fraction),) * num_ranks,
                       (backward_ratio * weight_fraction,) * num_ranks)
    forward, backward, weight = stage_costs
    if not len(forward) == len(backward) == len(weight) == num_ranks:
        raise ValueError(f"sliced schedule: stage costs for {num_ranks} stages, got "
                         f"{len(forward)}, {len(backward)}, {len(weight)}")
    w_of = weight if split else (0.0,) * num_ranks
    b_of = backward if split else tuple(b + w for b, w in zip(backward, weight))
    costs = _Costs(*([[c * w for w in work] for c in per_stage]
                     for per_stage in (forward, b_of, w_of)))
    units = num_sequences * slices
    orders = _list_orders(placement, units // len(placement), slices, costs,
                          cap or num_ranks * slices, split)
    return Schedule(name=f"{name}-sliced", num_ranks=num_ranks, num_stages=num_ranks,
                    num_pipes=len(placement), num_microbatches=units, placement=placement,
                    actions=orders, split_backward=split,
                    meta={"slice_work": work, "attention_fraction": attention_fraction},
                    sequence_slices=slices)
