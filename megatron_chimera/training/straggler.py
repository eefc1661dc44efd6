"""Straggler attribution from the busy times the log already gathers (no extra collective).

Every rank's compute-busy seconds per iteration reach the logging rank with the losses. A rank's
*relative compute* is its busy time over what the schedule predicts for its pipeline position
(the simulator's busy time of that position, F and B priced by the stage's layers), normalised by
the median of its peers: the other ranks that hold the same stages (the replicas of its position
over data, tensor and context parallelism, and in Chimera the mirrored position), so what the
cost model leaves out at a stage (an embedding, the output layer and loss) cancels; a rank
without such peers is compared with the ranks of equal predicted work, else with every rank. Per
log interval each rank's median relative compute is taken (robust to one noisy iteration); a
rank above ``1 + threshold`` for ``patience`` intervals in a row is named once, with its
slowdown, until it recovers. The line attributes it per action kind (F, B, W): each kind's
measured-over-predicted time on that rank, relative to its peers' for the same kind, so a
slowdown confined to one kind of action shows there.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class StragglerDetector:
    """Names ranks whose compute runs persistently slower than predicted relative to peers."""

    expected: Sequence[float]  # per global rank: predicted busy time (any unit)
    threshold: float = 0.15  # relative slowdown that counts
    patience: int = 3  # log intervals in a row
    minmax_count: int = 1  # slowest/fastest ranks shown in the log line
    expected_kinds: Sequence[Mapping[str, float]] = ()  # per rank: predicted time per kind
    positions: Sequence[Hashable] = ()  # per rank: the stages it holds (peers hold the same)
    _streak: list[int] = field(default_factory=list)
    _named: set[int] = field(default_factory=set)
    last: list[float] = field(default_factory=list)  # the last interval's relative compute
    _groups: list[list[int]] = field(default_factory=list)

    def observe(self, busy_per_iteration: Sequence[Sequence[float]],
                kinds_per_iteration: Sequence[Sequence[Mapping[str, float]]] = ()
                ) -> str | None:
        """Account one log interval (every iteration's busy seconds per rank, and optionally
        per rank per action kind); returns a log line when a rank becomes a straggler (None
        otherwise)."""
        ranks = len(self.expected)
        if kinds_per_iteration and all(len(row) == ranks for row in kinds_per_iteration):
            # the per-kind times (CPU time on CPU ranks) are the compute to compare
            busy_per_iteration = [[sum(k.values()) for k in row] for row in kinds_per_iteration]
        rows = [row for row in busy_per_iteration if len(row) == ranks and sum(row) > 0]
        if not rows:
            return None
        per_iteration = [self._relative(row) for row in rows]
        self.last = [statistics.median(it[r] for it in per_iteration) for r in range(ranks)]
        if not self._streak:
            self._streak = [0] * ranks
        new = []
        for rank, value in enumerate(self.last):
            slow = value > 1.0 + self.threshold
            self._streak[rank] = self._streak[rank] + 1 if slow else 0
            if not slow:
                self._named.discard(rank)
            elif self._streak[rank] >= self.patience and rank not in self._named:
                self._named.add(rank)
                new.append(rank)
        if not new:
            return None
        order = sorted(range(ranks), key=lambda r: self.last[r])
        k = max(1, min(self.minmax_count, ranks))
        named = ", ".join(f"rank {r} ({self.last[r] - 1:+.0%}"
                          f"{self._by_kind(r, kinds_per_iteration)})" for r in new)
        slowest = ", ".join(f"{r}: {self.last[r]:.2f}" for r in reversed(order[-k:]))
        fastest = ", ".join(f"{r}: {self.last[r]:.2f}" for r in order[:k])
        return (f" straggler: {named} slower than its peers for {self._streak[new[0]]} log "
                f"intervals (compute relative to the schedule's prediction, in all and per "
                f"action kind; slowest {slowest}; fastest {fastest})")

    def _by_kind(self, rank: int, kinds: Sequence[Sequence[Mapping[str, float]]]) -> str:
        """``; per action F +31%, B +29%``: the rank's relative slowdown per action kind over the
        interval (empty without per-kind figures)."""
        ranks = len(self.expected)
        rows = [row for row in kinds if len(row) == ranks]
        if not rows or len(self.expected_kinds) != ranks:
            return ""
        parts = []
        for kind in sorted(self.expected_kinds[rank]):
            peers = [r for r in self._peers(rank) if self.expected_kinds[r].get(kind, 0) > 0]
            if not peers:
                continue
            values = []
            for row in rows:
                ratio = row[rank].get(kind, 0.0) / self.expected_kinds[rank][kind]
                middle = statistics.median(row[r].get(kind, 0.0) / self.expected_kinds[r][kind]
                                           for r in peers)
                if middle > 0:
                    values.append(ratio / middle)
            if values:
                parts.append(f"{kind} {statistics.median(values) - 1:+.0%}")
        return "; per action " + ", ".join(parts) if parts else ""

    def _relative(self, busy: Sequence[float]) -> list[float]:
        ratios = [b / e if e > 0 else 1.0 for b, e in zip(busy, self.expected)]
        return [ratios[r] / (statistics.median(ratios[p] for p in self._peers(r)) or 1.0)
                for r in range(len(ratios))]

    def _peers(self, rank: int) -> list[int]:
        """The ranks ``rank`` is compared with: the others holding the same stages (what the
        cost model misses at a stage, e.g. the output layer and loss, cancels out), else the
        others with the same predicted work, else every rank."""
        if not self._groups:
            ranks = range(len(self.expected))
            work = [round(e, 9) for e in self.expected]
            held = list(self.positions) if len(self.positions) == len(work) else work
            self._groups = [[p for p in ranks if p != r and (held[p], work[p]) == (held[r], w)]
                            or [p for p in ranks if p != r and work[p] == w] or list(ranks)
                            for r, w in enumerate(work)]
        return self._groups[rank]


def stages_held(schedule, pipeline_rank_of: Sequence[int]) -> list[tuple[int, ...]]:
    """Per global rank, the stages of the replicas its pipeline position holds (sorted, one
    entry per replica): ranks with equal tuples run the same modules on the same shapes."""
    return [tuple(sorted(stage for _, stage in schedule.replicas_of_rank(p)))
            for p in pipeline_rank_of]


def expected_busy_per_rank(schedule, layers: Sequence[float], pipeline_rank_of: Sequence[int]
                           ) -> list[float]:
    """The simulator's busy time of each global rank's pipeline position (F = layers, B = 2 x
    layers of each stage); ``pipeline_rank_of[r]`` is global rank r's pipeline rank."""
    return [sum(kinds.values()) for kinds in
            expected_busy_by_kind(schedule, layers, pipeline_rank_of)]


def expected_busy_by_kind(schedule, layers: Sequence[float], pipeline_rank_of: Sequence[int]
                          ) -> list[dict[str, float]]:
    """Per global rank, the simulator's busy time of its pipeline position per action kind."""
    from megatron_chimera.schedules.simulate import CostModel, simulate

    weight = [n for n in layers] if schedule.split_backward else 0.0
    backward = [n for n in layers] if schedule.split_backward else [2 * n for n in layers]
    result = simulate(schedule, CostModel(forward_cost=list(layers), backward_cost=backward,
                                          weight_cost=weight))
    busy: list[dict[str, float]] = [{} for _ in range(schedule.num_ranks)]
    for event in result.events:
        busy[event.rank][event.kind] = (busy[event.rank].get(event.kind, 0.0)
                                        + event.end - event.start)
    return [dict(busy[p]) for p in pipeline_rank_of]
