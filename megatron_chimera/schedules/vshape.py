"""V-shaped pipelines: ZBV and V-Half (one pipe, one weight copy), BitPipe and BitPipe-ZB (two).

Placement (:func:`v_placement`)
-------------------------------
A V-shaped pipe cuts the model into ``2D`` half-size chunks (stages ``0 .. 2D-1``, each L/(2D)
layers): stage ``s < D`` on rank ``s``, stage ``s >= D`` on rank ``2D-1-s``. The pipe runs down
the ranks and turns back at the last one, so rank ``D-1`` holds stages ``D-1`` and ``D`` and
hands the activation (and the gradient) over locally: the lowering emits no message there, and
the last stage, whose loss starts the backward, sits on rank 0 beside the first. A mirrored
pipe (rank ``r`` -> ``D-1-r``) starts at rank ``D-1`` and turns at rank 0.

* ``zbv`` (zero-bubble V, Qi et al., ICLR'24 §6) and ``v-half`` (controllable-memory V, Qi et
  al., NeurIPS'24): one V pipe, split backward, two chunks per rank: **one weight copy**. ZBV keeps
  1F1B's activation memory (a cap of D in units of one micro-batch's activations on L/D layers,
  a chunk counting 0.5); V-Half about half of it (default cap ``D/2 + 1``).
* ``bitpipe`` (Wu et al., 2024: Chimera's two opposite pipes, each V-shaped) and ``bitpipe-zb``
  (the same placement with a cost-aware B/W split, like Chimera-ZB): four half-size chunks per
  rank -- stages ``r``, ``2D-1-r`` of the down pipe and ``D-1-r``, ``D+r`` of the up pipe -- so
  **two weight copies**, as Chimera.

Orders: the split-backward generators use Chimera-ZB's search (:func:`~.zero_bubble.best_order`:
the event-driven list scheduler over priority variants under the costs, seeded with the
closed-form orders that fit the cap -- ZBV's published pattern, V-Half's compressed periodic
pattern (:mod:`.v_pattern`), BitPipe's unsplit order with W adjacent or filling the waits);
``bitpipe`` is the best greedy unsplit list schedule at F:B = 1:2. BitPipe's two pipes keep only
orders the runtime accepts (:func:`runs_under_nccl_rules`). Costs given as ``(F, B, W)`` are per
L/D layers (a chunk costs half); per-stage costs (measured) have one entry per chunk. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from megatron_chimera.schedules.actions import BACKWARD, FORWARD, WEIGHT, Action, Schedule
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.list_scheduler import CapDeadlock, Priority, list_schedule
from megatron_chimera.schedules.v_pattern import v_half_order
from megatron_chimera.schedules.zero_bubble import (
    DEFAULT_COSTS,
    GUARD_VARIANTS,
    best_order,
    chunk_cap,
    makespan_lower_bound,
    meta_costs,
    no_cyclic_gc,
    split_costs,
)

CHUNKS = 2  # V chunks per rank per pipe
STAGE_SIZE = 1 / CHUNKS  # a chunk's layers in units of L/D


def v_placement(num_ranks: int, mirrored: bool = False) -> list[int]:
    """``placement[stage] -> rank`` of one V pipe over D ranks (2D stages; module docstring)."""
    ranks = [s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(2 * num_ranks)]
    return [num_ranks - 1 - r for r in ranks] if mirrored else ranks


def bitpipe_placement(num_ranks: int) -> list[list[int]]:
    """BitPipe's two opposite V pipes: pipe 0 starts at rank 0, pipe 1 at rank D-1."""
    return [v_placement(num_ranks), v_placement(num_ranks, mirrored=True)]


def _check_sizes(name: str, num_ranks: int, num_microbatches: int, pipes: int) -> None:
    if num_ranks < 2 or (pipes == 2 and num_ranks % 2):
        what = "even and >= 2" if pipes == 2 else ">= 2"
        raise ValueError(f"--pipeline-model-parallel-size must be {what} for {name}, got "
                         f"{num_ranks}")
    if num_microbatches < pipes or num_microbatches % pipes:
        raise ValueError(f"--num-microbatches must be a positive multiple of {pipes} for {name}, "
                         f"got {num_microbatches}")


def chunk_costs(costs: StageCosts | Sequence[float], num_stages: int) -> StageCosts:
    """Per-chunk costs: ``(F, B, W)`` (or one-stage costs) per L/D layers, halved for a chunk
    (the p2p time kept); per-stage costs recut to the chunks (D stages: each halved; one entry
    per chunk: as given)."""
    if isinstance(costs, StageCosts) and costs.num_stages > 1:
        try:
            return costs.for_stages(num_stages)
        except ValueError:
            raise ValueError(f"--chimera-zb-costs: per-stage costs need {num_stages} entries "
                             f"(one per chunk) or {num_stages // CHUNKS}, got "
                             f"{costs.num_stages}") from None
    whole = split_costs(costs, num_stages)
    return replace(whole.scaled(STAGE_SIZE), p2p=whole.p2p)


def zbv_order(num_ranks: int, num_microbatches: int) -> list[list[Action]]:
    """ZBV's published order (needs N >= 2D - 1): per rank r, with chunk 0 = stage r and chunk
    1 = stage 2D-1-r: 2(D-r)-1 forwards of chunk 0; r times (F1, F0); D-r times (F1, B1, W1);
    then (F0 while any is left, B0, W0, F1, B1, W1) until chunk 1 has caught up; then r times
    (B0, B1) with their W's held back, D-r times (B0, W0), and the held-back W's, chunk 1's
    first."""
    return [_zbv_rank_order(num_ranks, num_microbatches, r) for r in range(num_ranks)]


def _zbv_rank_order(d: int, n: int, r: int) -> list[Action]:
    stage = (r, 2 * d - 1 - r)
    count = {(k, c): 0 for k in (FORWARD, BACKWARD, WEIGHT) for c in (0, 1)}
    order: list[Action] = []

    def run(*steps: tuple[str, int]) -> None:
        for kind, c in steps:
            order.append(Action(kind, 0, stage[c], count[(kind, c)]))
            count[(kind, c)] += 1

    for _ in range(2 * (d - r) - 1):
        run((FORWARD, 0))
    for _ in range(r):
        run((FORWARD, 1), (FORWARD, 0))
    for _ in range(d - r):
        run((FORWARD, 1), (BACKWARD, 1), (WEIGHT, 1))
    while count[(FORWARD, 1)] < count[(FORWARD, 0)] or count[(FORWARD, 0)] < n:
        if count[(FORWARD, 0)] < n:
            run((FORWARD, 0))
        run((BACKWARD, 0), (WEIGHT, 0), (FORWARD, 1), (BACKWARD, 1), (WEIGHT, 1))
    for _ in range(r):
        run((BACKWARD, 0), (BACKWARD, 1))
    for _ in range(d - r):
        run((BACKWARD, 0), (WEIGHT, 0))
    for c in (1, 0):
        while count[(WEIGHT, c)] < count[(BACKWARD, c)]:
            run((WEIGHT, c))
    return order


def _v_split(name: str, placement: list[list[int]], num_microbatches: int,
             activation_cap: float, costs: StageCosts | Sequence[float],
             seeds: Sequence[tuple[str, list[list[Action]]]]) -> Schedule:
    """A split-backward schedule on V-shaped ``placement`` from Chimera-ZB's search."""
    num_ranks, num_stages, pipes = len(set(placement[0])), len(placement[0]), len(placement)
    cap = chunk_cap(activation_cap, STAGE_SIZE, CHUNKS)
    stage_costs = chunk_costs(costs, num_stages)
    per_pipe = num_microbatches // pipes
    pipe_microbatches = [list(range(p * per_pipe, (p + 1) * per_pipe)) for p in range(pipes)]
    bound = makespan_lower_bound(placement, per_pipe, stage_costs, num_ranks)
    with no_cyclic_gc():
        result, variant = best_order(placement, pipe_microbatches, stage_costs,
                                     [cap] * num_ranks, bound, seeds, GUARD_VARIANTS)
    return Schedule(
        name=name, num_ranks=num_ranks, num_stages=num_stages, num_pipes=pipes,
        num_microbatches=num_microbatches, placement=placement, actions=result.actions,
        split_backward=True,
        meta={"activation_cap": cap * STAGE_SIZE,
              "costs": meta_costs(stage_costs), "model_makespan": result.makespan,
              "lower_bound": bound, "priority": variant},
    )


def zbv(num_ranks: int, num_microbatches: int, activation_cap: float | None = None,
        costs: StageCosts | Sequence[float] = DEFAULT_COSTS) -> Schedule:
    """Zero-bubble V: one V pipe, split backward, at most ``activation_cap`` (default D, 1F1B's
    memory) activations per rank, ordered for ``costs``."""
    _check_sizes("zbv", num_ranks, num_microbatches, 1)
    cap = num_ranks if activation_cap is None else activation_cap
    seeds = [("zbv", zbv_order(num_ranks, num_microbatches))] if (
        num_microbatches >= 2 * num_ranks - 1) else []
    seeds.append(_v_half_seed(num_ranks, num_microbatches))  # wins under a tight cap
    return _v_split("zbv", [v_placement(num_ranks)], num_microbatches, cap, costs, seeds)


def _v_half_seed(num_ranks: int, num_microbatches: int) -> tuple[str, list[list[Action]]]:
    return "v-half-pattern", v_half_order(num_ranks, num_microbatches, v_placement(num_ranks))


def v_half(num_ranks: int, num_microbatches: int, activation_cap: float | None = None,
           costs: StageCosts | Sequence[float] = DEFAULT_COSTS) -> Schedule:
    """V-Half: one V pipe, split backward, about half of 1F1B's activation memory (default cap
    ``D/2 + 1``), ordered for ``costs``."""
    _check_sizes("v-half", num_ranks, num_microbatches, 1)
    cap = num_ranks // 2 + 1 if activation_cap is None else activation_cap
    seeds = [_v_half_seed(num_ranks, num_microbatches)]
    return _v_split("v-half", [v_placement(num_ranks)], num_microbatches, cap, costs, seeds)


# the unsplit BitPipe order: the best of these greedy runs at F:B = 1:2
_UNSPLIT_PRIORITIES = tuple(
    Priority(backward, forward, guard=guard)
    for guard in ("none", "reserve") for backward in ("stage", "microbatch")
    for forward in ("balance", "stage")
)


def _bitpipe_order(num_ranks: int, num_microbatches: int) -> list[list[Action]]:
    placement = bitpipe_placement(num_ranks)
    per_pipe = num_microbatches // 2
    pipe_microbatches = [list(range(p * per_pipe, (p + 1) * per_pipe)) for p in range(2)]
    costs = StageCosts.uniform(STAGE_SIZE, 2 * STAGE_SIZE, STAGE_SIZE, 2 * num_ranks)
    caps = [CHUNKS * num_ranks] * num_ranks
    best = None
    for priority in _UNSPLIT_PRIORITIES:
        try:
            result = list_schedule(placement, pipe_microbatches, costs, caps, priority,
                                   split_backward=False)
        except CapDeadlock:
            continue
        if best is None or result.makespan < best.makespan - 1e-9:
            best = result
    assert best is not None, "the reserve guard cannot deadlock"
    return best.actions


def bitpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """BitPipe: Chimera's two opposite pipes, each V-shaped (four half-size chunks per rank),
    unsplit backward; at most D activations per rank (L/D-layer units)."""
    _check_sizes("bitpipe", num_ranks, num_microbatches, 2)
    return Schedule(
        name="bitpipe", num_ranks=num_ranks, num_stages=2 * num_ranks, num_pipes=2,
        num_microbatches=num_microbatches, placement=bitpipe_placement(num_ranks),
        actions=_bitpipe_order(num_ranks, num_microbatches),
    )


def bitpipe_zb(num_ranks: int, num_microbatches: int, activation_cap: float | None = None,
               costs: StageCosts | Sequence[float] = DEFAULT_COSTS) -> Schedule:
    """BitPipe with a cost-aware B/W split (as Chimera-ZB): at most ``activation_cap`` (default
    D) activations per rank, ordered for ``costs``; seeded with BitPipe's unsplit order."""
    _check_sizes("bitpipe-zb", num_ranks, num_microbatches, 2)
    cap = num_ranks if activation_cap is None else activation_cap
    seeds = [("bitpipe", _bitpipe_order(num_ranks, num_microbatches))]
    return _v_split("bitpipe-zb", bitpipe_placement(num_ranks), num_microbatches, cap, costs,
                    seeds)
