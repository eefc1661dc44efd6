"""Split-backward orders from unsplit ones: W right after its B, or W filling the waits.

An unsplit schedule (1F1B, Chimera) runs each backward whole. Splitting every backward into B
then W, *adjacent*, gives a split-backward order with exactly the unsplit timeline
(:func:`split_adjacent`). :func:`fill_weights` keeps each rank's F/B order and moves the W's:
whenever the rank's next F or B is not ready yet (its input has not arrived), it runs a pending
W instead of waiting, and it runs a W first when the next F would exceed the cap on live
activations. B's, which feed the critical path, are never delayed by a W that could wait. With
the cap at least the unsplit order's peak this cannot deadlock: when the cap blocks an F, some
live activation has had its B (else the unsplit order would exceed the cap too), so a W is
pending.

These orders seed the split-backward generators (:mod:`.zero_bubble`): a Chimera-ZB order is
never slower than Chimera on the same placement, nor a cost-aware ZB-H1 than 1F1B.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence

from megatron_chimera.schedules.actions import BACKWARD, FORWARD, WEIGHT, Action, consumers
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.list_scheduler import CapDeadlock, ListResult


def split_adjacent(order: Sequence[Sequence[Action]]) -> list[list[Action]]:
    """Each rank's unsplit order with a W right after every B."""
    out = []
    for actions in order:
        rank_order: list[Action] = []
        for a in actions:
            rank_order.append(a)
            if a.kind == BACKWARD:
                rank_order.append(Action(WEIGHT, a.pipe, a.stage, a.microbatch))
        out.append(rank_order)
    return out


def peak_live(order: Sequence[Action]) -> int:
    """Most activations alive at once (F to W) when one rank runs ``order``."""
    live = peak = 0
    for a in order:
        if a.kind == FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.kind == WEIGHT:
            live -= 1
    return peak


def fill_weights(order: Sequence[Sequence[Action]], placement: Sequence[Sequence[int]],
                 costs: StageCosts, caps: Sequence[int]) -> ListResult:
    """Keep every rank's F/B order from ``order``; run the W's in the waits (module docstring).

    Raises :class:`~.list_scheduler.CapDeadlock` if a cap is below what the F/B order needs.
    Start times are the simulation's: a rank is examined whenever it becomes free or an input
    reaches it, so each action starts as soon as in-order execution would start it (the tests
    check this against :func:`~.list_scheduler.replay`).
    """
    num_ranks, num_stages = len(order), len(placement[0])
    duration = costs.durations()
    fb = [[a for a in actions if a.kind != WEIGHT] for actions in order]
    head = [0] * num_ranks
    pending: list[deque[Action]] = [deque() for _ in range(num_ranks)]
    live, peak = [0] * num_ranks, [0] * num_ranks
    arrival: dict[Action, float] = {}
    free_at = [0.0] * num_ranks
    emitted: list[list[Action]] = [[] for _ in range(num_ranks)]
    start: dict[Action, float] = {}
    events: list[tuple[float, int, int, Action | None]] = []  # (time, seq, rank, finished)
    seq = 0
    for rank in range(num_ranks):
        events.append((0.0, rank, rank, None))
    seq = num_ranks
    heapq.heapify(events)
    total = sum(len(actions) for actions in fb) * 2 - sum(
        1 for actions in fb for a in actions if a.kind == FORWARD)
    started = 0
    while events:
        t = events[0][0]
        examine: set[int] = set()
        while events and events[0][0] <= t:
            _, _, rank, done = heapq.heappop(events)
            examine.add(rank)
            if done is None:
                continue
            if done.kind == WEIGHT:
                live[rank] -= 1
            for nxt in consumers(done, num_stages, split_backward=True):
                if nxt.kind == WEIGHT:
                    pending[rank].append(nxt)
                    continue
                to = placement[nxt.pipe][nxt.stage]
                arrival[nxt] = t + (costs.p2p if to != rank else 0.0)
                seq += 1
                heapq.heappush(events, (arrival[nxt], seq, to, None))
        for rank in sorted(examine):
            if free_at[rank] > t:
                continue
            a = _next_action(fb[rank], head[rank], arrival, pending[rank], live[rank],
                             caps[rank], t)
            if a is None:
                continue
            if a.kind == WEIGHT:
                pending[rank].popleft()
            else:
                head[rank] += 1
            if a.kind == FORWARD:
                live[rank] += 1
                peak[rank] = max(peak[rank], live[rank])
            emitted[rank].append(a)
            start[a] = t
            started += 1
            free_at[rank] = t + duration[a.kind][a.stage]
            seq += 1
            heapq.heappush(events, (free_at[rank], seq, rank, a))
    if started != total:
        raise CapDeadlock(f"fill_weights: {total - started} actions could not start under caps "
                          f"{list(caps)}")
    makespan = max(free_at)
    return ListResult(emitted, start, makespan, peak)


def _next_action(fb: list[Action], head: int, arrival: dict[Action, float],
                 pending: deque[Action], live: int, cap: int, t: float) -> Action | None:
    """The rank's next F/B if its input is here (and, for an F, the cap allows it), else the
    oldest pending W, else None (wait)."""
    if head < len(fb):
        a = fb[head]
        # F of stage 0 reads the batch; every other input's arrival time is set by its producer
        here = (a.kind == FORWARD and a.stage == 0) or arrival.get(a, float("inf")) <= t
        if here and (a.kind != FORWARD or live < cap):
            return a
    return pending[0] if pending else None
