"""Context parallelism chosen per micro-batch, simulated (the runtime keeps one CP size).

A context-parallel group of ``c`` ranks per pipeline stage runs each micro-batch (packed up to
``c`` times the per-rank token capacity) either with its documents split over all ``c`` ranks
(ring attention, the per-document zigzag), or -- when its documents can be dealt whole to the
``c`` ranks within the capacity (:func:`choose_context_parallel`) -- at CP = 1: each rank runs
its own documents, no ring, no padding (each rank a data-parallel lane for that micro-batch, its
gradients reduced with the context group's as always). The groups are the same for every
micro-batch, built once; the pipeline schedule is unchanged.

A micro-batch (:class:`Unit`) costs, per stage, the slowest of its lanes
(:func:`unit_stage_times`, every lane priced by :func:`~.length_mix.microbatch_stage_times`);
:func:`simulate_units` runs a pipeline schedule over the units, dearest first, with the
simulator's per-micro-batch costs. Comparing
with every micro-batch at CP = ``c`` (``tools/benchmark_dynamic_cp.py``) shows what choosing CP
per micro-batch saves: the ring messages that short documents' attention cannot hide, and the
per-document padding to ``2c``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_chimera.schedules.registry import build_schedule
from megatron_chimera.schedules.simulate import CostModel, SimResult, simulate
from megatron_chimera.tuning.analytic_costs import StagePiece
from megatron_chimera.tuning.hardware import LinkProfile
from megatron_chimera.tuning.length_mix import microbatch_stage_times, spread_documents
from megatron_chimera.tuning.perf_model import AnalyticCompute, StageTimes


@dataclass(frozen=True)
class Unit:
    """One micro-batch of a CP group as it runs: its documents split over all
    ``context_parallel`` ranks (one lane), or dealt whole to the ranks at CP = 1 (one lane of
    documents per rank)."""

    lanes: tuple[tuple[int, ...], ...]
    context_parallel: int

    @property
    def tokens(self) -> int:
        """Tokens of the micro-batch."""
        return sum(sum(lane) for lane in self.lanes)


def choose_context_parallel(lengths: Sequence[int], group: int, capacity: int) -> Unit:
    """CP = 1 when the documents, dealt to the ``group`` ranks (:func:`spread_documents`), fit
    every rank's ``capacity`` tokens; else the whole group (ValueError when even the group
    cannot hold the micro-batch)."""
    if sum(lengths) > group * capacity:
        raise ValueError(f"a micro-batch of {sum(lengths)} tokens exceeds {group} ranks x "
                         f"{capacity} tokens")
    lanes = tuple(lane for lane in spread_documents(lengths, group) if lane)
    if group == 1 or max(sum(lane) for lane in lanes) <= capacity:
        return Unit(lanes, 1)
    return Unit((tuple(lengths),), group)


def first_fit(lengths: Sequence[int], budget: int) -> list[tuple[int, ...]]:
    """Documents in stream order, each into the first micro-batch with room (a new one when none
    has): every micro-batch at most ``budget`` tokens, in the order opened."""
    bins: list[list[int]] = []
    room: list[int] = []
    for n in lengths:
        if n > budget:
            raise ValueError(f"a document of {n} tokens exceeds the budget of {budget}")
        i = next((j for j, r in enumerate(room) if r >= n), None)
        if i is None:
            bins.append([])
            room.append(budget)
            i = len(bins) - 1
        bins[i].append(n)
        room[i] -= n
    return [tuple(b) for b in bins]


def fixed_units(lengths: Sequence[int], group: int, capacity: int) -> list[Unit]:
    """Fixed context parallelism: documents packed (:func:`first_fit`) into micro-batches of
    ``group x capacity`` tokens, every one split over the whole group."""
    return [Unit((m,), group) for m in first_fit(lengths, group * capacity)]


def per_microbatch_units(lengths: Sequence[int], group: int, capacity: int,
                         cost: Callable[[Unit], float] | None = None) -> list[Unit]:
    """Context parallelism chosen per micro-batch: documents longer than one rank's
    ``capacity`` packed into micro-batches of ``group x capacity`` tokens split over the group;
    the others packed into lanes of ``capacity`` tokens, ``group`` consecutive lanes one
    micro-batch at CP = 1 -- or, where ``cost`` (seconds of a unit) says it is cheaper, the
    same documents split over the group; micro-batches in the order of their first document."""
    long = [(i, n) for i, n in enumerate(lengths) if n > capacity]
    short = [(i, n) for i, n in enumerate(lengths) if n <= capacity]
    units: list[tuple[int, Unit]] = []
    for docs, budget in ((long, group * capacity), (short, capacity)):
        order: dict[int, int] = {}  # bin -> first document's index
        bins: list[list[int]] = []
        room: list[int] = []
        for i, n in docs:
            j = next((k for k, r in enumerate(room) if r >= n), None)
            if j is None:
                bins.append([])
                room.append(budget)
                j = len(bins) - 1
                order[j] = i
            bins[j].append(n)
            room[j] -= n
        if budget > capacity:
            units += [(order[j], Unit((tuple(b),), group)) for j, b in enumerate(bins)]
        else:
            for k in range(0, len(bins), group):
                lanes = tuple(tuple(b) for b in bins[k:k + group])
                unit = Unit(lanes, 1)
                whole = Unit((tuple(n for lane in lanes for n in lane),), group)
                if cost is not None and cost(whole) < cost(unit):
                    unit = whole
                units.append((order[k], unit))
    return [u for _, u in sorted(units, key=lambda x: x[0])]


def unit_stage_times(compute: AnalyticCompute, piece: StagePiece, unit: Unit,
                     link: LinkProfile | None) -> StageTimes:
    """Seconds of ``unit`` through ``piece``: its slowest lane, per kind."""
    times = [microbatch_stage_times(compute, piece, lane, unit.context_parallel, link)
             for lane in unit.lanes]
    return StageTimes(max(t.forward for t in times), max(t.backward for t in times),
                      max(t.weight for t in times))


def unit_seconds(compute: AnalyticCompute, pieces: Sequence[StagePiece],
                 link: LinkProfile | None) -> Callable[[Unit], float]:
    """A unit's forward and backward seconds summed over ``pieces`` (the choice's cost)."""
    def seconds(unit: Unit) -> float:
        return sum(t.forward + t.backward
                   for t in (unit_stage_times(compute, p, unit, link) for p in pieces))
    return seconds


def simulate_units(compute: AnalyticCompute, pieces: Sequence[StagePiece], units: Sequence[Unit],
                   schedule: str, link: LinkProfile | None, by_cost: bool = True,
                   **options) -> SimResult:
    """The simulated iteration of ``schedule`` (``len(pieces)`` stages) over ``units``: stage
    costs of the first, every unit scaled by its own (F, B, W) totals. ``by_cost``: the
    iteration's micro-batches run dearest first (their order does not change the summed
    gradients), so micro-batches of like cost meet in the pipeline instead of each window of
    ``D`` waiting for its dearest; else in the given order."""
    per = [[unit_stage_times(compute, p, u, link) for p in pieces] for u in units]
    if by_cost:
        order = sorted(range(len(units)), key=lambda i: (-sum(t.forward + t.backward
                                                              for t in per[i]), i))
        per, units = [per[i] for i in order], [units[i] for i in order]
    built = build_schedule(schedule, len(pieces), len(units), **options)
    split = built.split_backward

    def totals(times: list[StageTimes]) -> tuple[float, float, float]:
        weight = sum(t.weight for t in times)
        backward = sum(t.backward for t in times) - (weight if split else 0.0)
        return sum(t.forward for t in times), backward, weight

    ref = totals(per[0])
    work = tuple(tuple(v / r for v, r in zip(totals(t), ref, strict=True)) for t in per)
    tokens = tuple(u.tokens / units[0].tokens for u in units)
    costs = CostModel(forward_cost=tuple(t.forward for t in per[0]),
                      backward_cost=tuple(t.backward for t in per[0]),
                      weight_cost=tuple(t.weight for t in per[0]) if split else 0.0,
                      microbatch_work=work, microbatch_tokens=tokens)  # type: ignore[arg-type]
    return simulate(built, costs)
