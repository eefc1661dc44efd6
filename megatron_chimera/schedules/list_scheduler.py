"""Event-driven greedy list scheduling of split-backward (F, B, W) pipelines.

Given a placement of (pipe, stage) replicas on ranks, the micro-batches of every pipe, per-stage
F/B/W costs with a point-to-point message time (:class:`~.costs.StageCosts`, or three numbers for
every stage) and a per-rank cap on in-flight activations, :func:`list_schedule` simulates the
iteration: whenever a rank is free it starts one of its *ready* actions (input arrived: the
producer finished, plus one message time when it ran on another rank), chosen by a
:class:`Priority`. The per-rank order it emits is the order of start times, so executing it in
order reproduces the simulated timeline (no deadlock under blocking receives, by construction).

Only ranks whose state changed (they became free, or an input arrived) are examined at an event
time, plus, under a guard that looks at other ranks, the free ranks whose forwards it blocked:
the same choices as examining every rank at every event time, in O(actions) examinations.

Dependencies are the schedules' one rule (:func:`~.actions.input_of`, walked forwards with
:func:`~.actions.consumers`). In addition every (pipe, stage) runs its forwards in micro-batch
order, so point-to-point channels stay FIFO.
An activation is in flight from the start of its F to the end of its W.

``split_backward=False`` schedules an unsplit pipeline the same way (no W; B is the whole
backward, costed as the costs' B, and releases the activation).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_chimera.schedules.actions import BACKWARD, FORWARD, WEIGHT, Action, consumers
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.walk import run_in_order, stalled

GUARDS = ("none", "safe", "reserve", "quota")


@dataclass(frozen=True)
class Priority:
    """Choice rules of the list scheduler at a free rank (a point of the generators' search).

    ``backward``: order of ready B's, ``"stage"`` (lowest stage first: closest to finishing its
    micro-batch) or ``"microbatch"`` (oldest first). ``forward``: order of ready F's,
    ``"balance"`` (pipe with the fewest forwards started on this rank first) or ``"stage"``
    (highest stage first: nearest to producing a B). ``soft_cap``: from this many live
    activations on, a ready W goes before a ready F (``None``: only the cap forces W).
    ``eager_weight``: W before F whenever a W is ready. ``guard`` decides when an F may start
    under the cap: ``"none"`` (room on this rank; may deadlock), ``"safe"`` (banker's check:
    the started micro-batches can still all finish within the caps; never deadlocks) or
    ``"reserve"`` (a micro-batch enters only with room reserved on its whole path) or
    ``"quota"`` (each rank's cap split over its replicas in proportion to D - stage +
    ``quota_bias``; the shares sum to the cap plus ``quota_overbook``, and overbooked shares
    also pass the banker's check).
    """

    backward: str = "stage"
    forward: str = "balance"
    soft_cap: int | None = None
    eager_weight: bool = False
    guard: str = "none"
    quota_bias: float = 0.0
    quota_overbook: int = 0


@dataclass
class ListResult:
    """Per-rank action order, the simulated start times and the makespan of one list schedule."""

    actions: list[list[Action]]
    start: dict[Action, float]
    makespan: float
    peak_inflight: list[int]


class CapDeadlock(RuntimeError):
    """The in-flight cap left every rank waiting: no action can start any more."""


class _ListScheduler:
    """State of one greedy list-scheduling run (see :func:`list_schedule`)."""

    def __init__(
        self,
        placement: Sequence[Sequence[int]],
        pipe_microbatches: Sequence[Sequence[int]],
        costs: StageCosts | Sequence[float],
        caps: Sequence[int],
        priority: Priority,
        split_backward: bool = True,
    ) -> None:
        if priority.guard not in GUARDS:
            raise ValueError(f"unknown guard {priority.guard!r}; choose from {GUARDS}")
        self.placement = [list(p) for p in placement]
        self.pipe_microbatches = [list(m) for m in pipe_microbatches]
        self.num_pipes = len(self.placement)
        self.num_stages = len(self.placement[0])
        self.caps = list(caps)
        self.num_ranks = len(self.caps)
        self.costs = StageCosts.of(costs, self.num_stages)
        self.cost = self.costs.durations()  # kind -> per-stage time
        self.priority = priority
        self.split_backward = split_backward
        self.release = WEIGHT if split_backward else BACKWARD  # frees an activation
        # a guard that reads other ranks' state may unblock a forward when anything changes
        self.global_guard = priority.guard in ("safe", "reserve") or (
            priority.guard == "quota" and priority.quota_overbook != 0)
        self.ready = [{FORWARD: [], BACKWARD: [], WEIGHT: []} for _ in range(self.num_ranks)]
        self.dirty: set[int] = set(range(self.num_ranks))  # ranks to examine at the next time
        self.arrivals: list[tuple[float, int, Action]] = []  # (time, tie-break, consumer)
        self._arrival_seq = 0
        stages = [(p, s) for p in range(self.num_pipes) for s in range(self.num_stages)]
        self.next_index = dict.fromkeys(stages, 0)  # next micro-batch (index in pipe) to release
        self.arrived = dict.fromkeys(stages, 0)  # micro-batches whose input reached (pipe, stage)
        self.waiting = dict.fromkeys(stages, False)  # an F of (pipe, stage) is ready, not started
        self.forwards_started = [[0] * self.num_pipes for _ in range(self.num_ranks)]
        self.live = [0] * self.num_ranks
        self.peak = [0] * self.num_ranks
        # banker's check: per pipe, started micro-batches (oldest first) -> held slots per rank
        self.active: list[dict[int, Counter]] = [{} for _ in range(self.num_pipes)]
        # per pipe, micro-batch -> stages whose forward has started
        self.stages_started: list[dict[int, int]] = [{} for _ in range(self.num_pipes)]
        self.weights_done: dict[tuple[int, int], int] = {}
        self.reserved = [0] * self.num_ranks
        self.path_counts = [Counter(ranks) for ranks in self.placement]
        self.quota = self._quotas() if priority.guard == "quota" else {}
        self.replica_live: Counter = Counter()
        for pipe in range(self.num_pipes):
            self.arrived[(pipe, 0)] = len(self.pipe_microbatches[pipe])
            self._release_forward(pipe, 0)

    # ---------------------------------------------------------------- dependencies
    def _release_forward(self, pipe: int, stage: int) -> None:
        """Make the next F of (pipe, stage) ready: one at a time, in micro-batch order (FIFO)."""
        idx = self.next_index[(pipe, stage)]
        if self.waiting[(pipe, stage)] or idx >= self.arrived[(pipe, stage)]:
            return
        if idx < len(self.pipe_microbatches[pipe]):
            self.next_index[(pipe, stage)] = idx + 1
            self.waiting[(pipe, stage)] = True
            mb = self.pipe_microbatches[pipe][idx]
            rank = self.placement[pipe][stage]
            self.ready[rank][FORWARD].append(Action(FORWARD, pipe, stage, mb))
            self.dirty.add(rank)

    def _arrive(self, nxt: Action) -> None:
        """The input of ``nxt`` has reached its rank."""
        if nxt.kind == FORWARD:  # forwards enter their stage one at a time, in order
            self.arrived[(nxt.pipe, nxt.stage)] += 1
            self._release_forward(nxt.pipe, nxt.stage)
        else:
            rank = self.placement[nxt.pipe][nxt.stage]
            self.ready[rank][nxt.kind].append(nxt)
            self.dirty.add(rank)

    def _finish(self, a: Action, t: float) -> None:
        rank = self.placement[a.pipe][a.stage]
        self.dirty.add(rank)
        for nxt in consumers(a, self.num_stages, self.split_backward):
            if self.costs.p2p and self.placement[nxt.pipe][nxt.stage] != rank:
                self._arrival_seq += 1
                heapq.heappush(self.arrivals, (t + self.costs.p2p, self._arrival_seq, nxt))
            else:
                self._arrive(nxt)
        if a.kind != self.release:
            return
        self.live[rank] -= 1
        self.replica_live[(a.pipe, a.stage)] -= 1
        self.reserved[rank] -= 1
        key = (a.pipe, a.microbatch)
        self.active[a.pipe][a.microbatch][rank] -= 1
        self.weights_done[key] += 1
        if self.weights_done[key] == self.num_stages:
            del self.active[a.pipe][a.microbatch]

    def _start(self, rank: int, a: Action) -> None:
        self.ready[rank][a.kind].remove(a)
        if a.kind != FORWARD:
            return
        self.waiting[(a.pipe, a.stage)] = False
        self._release_forward(a.pipe, a.stage)  # the next micro-batch of this (pipe, stage)
        key = (a.pipe, a.microbatch)
        if a.stage == 0:
            self.active[a.pipe][a.microbatch] = Counter()
            self.weights_done[key] = 0
            if self.priority.guard == "reserve":
                for r, n in self.path_counts[a.pipe].items():
                    self.reserved[r] += n
        if self.priority.guard != "reserve":
            self.reserved[rank] += 1
        self.active[a.pipe][a.microbatch][rank] += 1
        self.stages_started[a.pipe][a.microbatch] = a.stage + 1
        self.live[rank] += 1
        self.replica_live[(a.pipe, a.stage)] += 1
        self.peak[rank] = max(self.peak[rank], self.live[rank])
        self.forwards_started[rank][a.pipe] += 1

    # ---------------------------------------------------------------- cap guards
    def _quotas(self) -> dict[tuple[int, int], int]:
        """Split each rank's cap over its replicas, about in proportion to D - stage + bias.

        A replica at stage s needs about D - s live activations to keep 1F1B's pace; a fixed
        share per replica makes the pipes independent, hence deadlock free (every share >= 1).
        """
        quota = {}
        for rank in range(self.num_ranks):
            replicas = [
                (p, s)
                for p in range(self.num_pipes)
                for s in range(self.num_stages)
                if self.placement[p][s] == rank
            ]
            total = self.caps[rank] + self.priority.quota_overbook
            if self.caps[rank] < len(replicas):
                raise CapDeadlock(f"cap {self.caps[rank]} < {len(replicas)} replicas on {rank}")
            weights = [self.num_stages - s + self.priority.quota_bias for _, s in replicas]
            share = [max(1, int(total * w / sum(weights))) for w in weights]
            while sum(share) < total:  # hand out the rest by largest deficit
                i = max(range(len(share)), key=lambda j: weights[j] / share[j])
                share[i] += 1
            while sum(share) > total:
                i = max(range(len(share)), key=lambda j: share[j])
                share[i] -= 1
            quota.update(zip(replicas, share))
        return quota

    def _is_safe_after(self, rank: int, a: Action) -> bool:
        """Banker's check: after starting ``a`` can every started micro-batch still finish?

        Per pipe, its started micro-batches retire oldest first; one whose forwards have reached
        stage ``started`` can retire once the free slots cover ``ranks[started:]``. Free slots
        only grow while micro-batches retire, so each pipe scans its path down from the last
        stage once, counting the slots its micro-batches still need, as far as they have to.
        """
        return _BankerCheck(self, rank, a).safe()

    def _may_start_forward(self, rank: int, a: Action) -> bool:
        guard = self.priority.guard
        if guard == "reserve":
            if a.stage > 0:
                return True
            need = self.path_counts[a.pipe]
            return all(self.reserved[r] + n <= self.caps[r] for r, n in need.items())
        if self.live[rank] >= self.caps[rank]:
            return False
        if guard == "quota":
            if self.replica_live[(a.pipe, a.stage)] >= self.quota[(a.pipe, a.stage)]:
                return False
            return self.priority.quota_overbook == 0 or self._is_safe_after(rank, a)
        return guard == "none" or self._is_safe_after(rank, a)

    # ---------------------------------------------------------------- choice
    def choose(self, rank: int) -> Action | None:
        """The action a free rank starts now, or None to stay idle."""
        cand = self.ready[rank]
        prio = self.priority
        if cand[BACKWARD]:
            if prio.backward == "stage":
                return min(cand[BACKWARD], key=lambda a: (a.stage, a.microbatch))
            return min(cand[BACKWARD], key=lambda a: (a.microbatch, a.stage))
        prefer_weight = bool(cand[WEIGHT]) and (
            prio.eager_weight or (prio.soft_cap is not None and self.live[rank] >= prio.soft_cap)
        )
        if cand[FORWARD] and not prefer_weight:
            if prio.forward == "balance":
                started = self.forwards_started[rank]
                key = lambda a: (started[a.pipe], -a.stage, a.microbatch)
            else:
                key = lambda a: (-a.stage, a.microbatch)
            for a in sorted(cand[FORWARD], key=key):
                if self._may_start_forward(rank, a):
                    return a
        if cand[WEIGHT]:
            return min(cand[WEIGHT], key=lambda a: (a.microbatch, a.stage))
        return None

    def run(self) -> ListResult:
        """Simulate until every action has run; raise :class:`CapDeadlock` if stuck."""
        kinds = 3 if self.split_backward else 2
        total = kinds * self.num_stages * sum(len(m) for m in self.pipe_microbatches)
        free_at = [0.0] * self.num_ranks
        started = 0
        order: list[list[Action]] = [[] for _ in range(self.num_ranks)]
        events: list[tuple[float, int, Action]] = []  # (finish time, tie-break, action)
        blocked: set[int] = set()  # free ranks whose ready forwards a global guard held back
        arrivals = self.arrivals
        t = 0.0
        while started < total:
            while events and events[0][0] <= t:
                end, _, a = heapq.heappop(events)
                self._finish(a, end)
            while arrivals and arrivals[0][0] <= t:
                self._arrive(heapq.heappop(arrivals)[2])
            candidates = self.dirty | blocked if self.global_guard else self.dirty
            self.dirty = set()
            for rank in sorted(candidates):
                if free_at[rank] > t:
                    continue  # busy: examined again when its action finishes
                a = self.choose(rank)
                if a is None:
                    if self.ready[rank][FORWARD]:
                        blocked.add(rank)
                    continue
                blocked.discard(rank)
                self._start(rank, a)
                started += 1
                order[rank].append(a)
                free_at[rank] = t + self.cost[a.kind][a.stage]
                heapq.heappush(events, (free_at[rank], started, a))
            if started == total:
                break
            if not events and not arrivals:
                raise CapDeadlock(
                    f"no action can start at t={t}: in flight {self.live}, caps {self.caps}"
                )
            t = min(q[0][0] for q in (events, arrivals) if q)
        # a guard may have kept a rank idle beside a ready F; executed in order, that F starts
        # as soon as it can, so cost the emitted order the way the executor will run it
        start = replay(order, self.placement, self.costs)
        makespan = max(t + self.cost[a.kind][a.stage] for a, t in start.items())
        return ListResult(order, start, makespan, self.peak)


def replay(
    order: Sequence[Sequence[Action]],
    placement: Sequence[Sequence[int]],
    costs: StageCosts,
) -> dict[Action, float]:
    """Start times when every rank runs its list in order, each action as soon as its input has
    arrived (one p2p message time after its producer ended on another rank)."""
    end: dict[Action, float] = {}
    start: dict[Action, float] = {}
    free_at = [0.0] * len(order)
    duration = costs.durations()
    p2p = costs.p2p

    def run(rank: int, a: Action, dep: Action | None) -> None:
        ready = 0.0
        if dep is not None:
            ready = end[dep]
            if p2p and placement[dep.pipe][dep.stage] != rank:
                ready += p2p
        start[a] = max(free_at[rank], ready)
        free_at[rank] = end[a] = start[a] + duration[a.kind][a.stage]

    heads = run_in_order(order, len(placement[0]), run)
    if stalled(order, heads):
        raise CapDeadlock("the emitted order deadlocks when executed in order")
    return start


def list_schedule(
    placement: Sequence[Sequence[int]],
    pipe_microbatches: Sequence[Sequence[int]],
    costs: StageCosts | Sequence[float],
    caps: Sequence[int],
    priority: Priority,
    split_backward: bool = True,
) -> ListResult:
    """Greedy non-delay list schedule of all F/B/W actions; raises :class:`CapDeadlock`.

    ``placement[pipe][stage] -> rank``; ``pipe_microbatches[pipe]`` lists the pipe's global
    micro-batch ids in injection order; ``costs`` are per-stage F, B, W times and the p2p
    message time (:class:`~.costs.StageCosts`) or (F, B, W) for every stage; ``caps[rank]``
    bounds the activations alive on a rank at once. ``split_backward=False``: F and whole B
    only (B costs the costs' B).
    """
    return _ListScheduler(placement, pipe_microbatches, costs, caps, priority,
                          split_backward).run()


class _BankerCheck:
    """One banker's check of :meth:`_ListScheduler._is_safe_after`: the free slots per rank and,
    per pipe, its started micro-batches oldest first (the stage each has started, the slots it
    holds), then how far each pipe has retired, covered and returned its slots."""

    def __init__(self, scheduler: _ListScheduler, rank: int, a: Action) -> None:
        self.placement, self.rank, self.pipe = scheduler.placement, rank, a.pipe
        free = [cap - live for cap, live in zip(scheduler.caps, scheduler.live)]
        free[rank] -= 1
        starts = [list(map(started.__getitem__, active))
                  for started, active in zip(scheduler.stages_started, scheduler.active)]
        helds = [list(active.values()) for active in scheduler.active]
        if a.stage == 0:  # ``a``'s micro-batch also holds the slot ``a`` takes on ``rank``
            starts[a.pipe].append(1)
            helds[a.pipe].append({})
            own_index = len(starts[a.pipe]) - 1
        else:
            own_index = list(scheduler.active[a.pipe]).index(a.microbatch)
            starts[a.pipe][own_index] = a.stage + 1
        self.free, self.starts, self.helds, self.own_index = free, starts, helds, own_index
        pipes = scheduler.num_pipes
        self.heads = [0] * pipes  # per pipe, how many of its micro-batches can retire
        self.returned = [0] * pipes  # retired micro-batches whose slots are in ``free``
        self.scan = [scheduler.num_stages - 1] * pipes  # highest stage not yet covered
        self.covered = [[0] * scheduler.num_ranks for _ in range(pipes)]  # slots per rank

    def safe(self) -> bool:
        """Whether every started micro-batch (``a``'s included) can retire."""
        progress = True
        while progress:
            progress = False
            for pipe, queue in enumerate(self.starts):
                if self.heads[pipe] != len(queue):
                    progress = self._advance(pipe, queue) or progress
        return all(h == len(q) for h, q in zip(self.heads, self.starts))

    def _advance(self, pipe: int, queue: list[int]) -> bool:
        """Cover ``pipe``'s path down to its least advanced micro-batch with free slots and
        retire its micro-batches oldest first up to the first blocked one, returning their
        slots as they retire; whether any retired."""
        ranks, need = self.placement[pipe], self.covered[pipe]
        k, h = self.scan[pipe], self.heads[pipe]
        free, progress = self.free, False
        target = min(queue[h:])  # cover the path down to the least advanced
        while True:
            while k >= target and need[ranks[k]] < free[ranks[k]]:
                need[ranks[k]] += 1
                k -= 1
            if k < target:  # every one left can retire
                progress, h = True, len(queue)
                break
            while queue[h] > k:  # retire oldest first up to the first blocked one
                progress, h = True, h + 1
            self.heads[pipe] = h
            if self.heads == self.returned:
                break
            self._return_retired()
        self.heads[pipe], self.scan[pipe] = h, k
        return progress

    def _return_retired(self) -> None:
        """Give back the slots of every micro-batch retired since the last return (``a``'s own
        slot on its rank included)."""
        for q, held_slots in enumerate(self.helds):
            for held in held_slots[self.returned[q]:self.heads[q]]:
                for r, n in held.items():
                    self.free[r] += n
        if self.returned[self.pipe] <= self.own_index < self.heads[self.pipe]:
            self.free[self.rank] += 1
        self.returned = self.heads.copy()
