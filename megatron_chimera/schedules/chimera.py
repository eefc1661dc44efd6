"""Chimera: bidirectional pipelines (Li & Hoefler, SC'21) as per-rank action lists.

Placement (``chimera_placement``)
---------------------------------
``2f`` pipes over ``D`` ranks (f divides D/2): down pipe ``j`` (pipe id ``j``) puts stage ``s``
on rank ``(s + j*D/f) mod D``, up pipe ``j`` (pipe id ``f + j``) on rank
``(D-1-s + j*D/f) mod D``. Pipe ``p`` owns the ``N/(2f)`` global micro-batches
``[p*N/(2f), (p+1)*N/(2f))``; its local micro-batch ``i`` is the ``i``-th of that block.

Basic unit (N = D) -- the slot formula
--------------------------------------
Count one slot per forward and one per backward. In *every* pipe the rank holding stage ``s``
runs the pipe's local micro-batch ``i`` (``0 <= i < D/(2f)``) forward at slot ``s + 2i`` and
backward at slot ``2D - 1 - s + 2i``; a rank's order is its operations sorted by slot. For
``f = 1`` this is docs/CHIMERA.md's formula. For ``f > 1`` the same formula holds unchanged (our
generalisation): on one rank the stages of two down (or two up) pipes differ by a non-zero
multiple of ``D/f`` while each pipe's forwards (and backwards) span only ``D/f - 1`` slots; down
and up forwards have opposite slot parity; a down forward meets an up backward (or vice versa)
of equal parity only if ``s_down + s_up = 2D - 1 - 2m`` with ``0 < 2m <= D/f - 2``, impossible
because ``s_down + s_up = -1 (mod D/f)``. So no two operations of a rank share a slot (the
tests check it exhaustively), every dependency sits exactly one slot earlier, and with
forward = backward cost a unit takes ``2D + D/f - 2`` slots: bubble ratio
``(D-2f)/(2fN+D-2f)`` at ``N = D`` (and for N > D with ``direct`` or ``slot-merge``, whose
makespan is ``2N + D/f - 2``).

N < D (a partial unit, N a multiple of 2f) -- ours
-------------------------------------------------
The same slot formula with each pipe's local micro-batches ``i < N/(2f)``: the basic unit's
order with the other micro-batches removed. Every argument above holds for a subset (no shared
slot, each dependency one slot earlier), so the order is valid; with forward = backward it takes
``2D + 2N/(2f) - 2`` slots. This is what a few long sequences per iteration need (e.g. two
sequences at D = 4: one per pipe), the unsliced baseline of ``--pipeline-sequence-slices``.

N > D: ``k = N/D`` units, unit ``u`` holding local micro-batches ``[u*D/(2f), (u+1)*D/(2f))``
---------------------------------------------------------------------------------------------
* ``direct`` (paper §3.5, reference code): unit ``u`` is the basic unit shifted by ``2D`` slots.
  The sorted order equals the reference's phase form, where unit u's leading ``a x F_X`` becomes
  ``a x (B_X, F_X)`` absorbing unit u-1's ``a x B_X`` tail. Peak in flight ``D/2+1+min(w,D-1-w)``;
  with backward = 2 x forward the unit junctions leave bubbles: makespan ``3N + (k+1)(D-2)``.
* ``forward-doubling`` (paper §3.5, reference code's published order; two pipes only, N a
  multiple of 2D): each step of 2D micro-batches runs, on the rank with ``a, b, X, Y`` as in
  docs/CHIMERA.md, ``a x (F_X F_X)`` (first step) or ``a x (B_X F_X F_X)``, then
  ``b x (F_Y F_Y F_X F_X)``, ``a x (F_Y F_Y B_Y)``, ``(b + D/2) x (B_X B_Y)``, and finally the
  ``a x B_X`` tail. Up to 2D activations in flight; makespan ``3N + 1.5(D-2)`` at B = 2F.
* ``slot-merge`` (ours, the default for N > D): unit ``u`` is the basic unit shifted by only
  ``D`` slots (instead of ``2D``), so successive units interleave by slot number; operations of
  two units that land on the same slot run backward first (which frees an activation before the
  next forward allocates one). Each rank still alternates between the units' forwards and the
  previous units' backwards, but the junction bubbles of ``direct`` disappear: with
  backward = 2 x forward the makespan is ``3N + 2D - 4`` (the basic unit's ``5D - 4`` plus
  ``3D`` per extra unit; D=8, N=32: 108 vs 126 direct and 117 for 1F1B), with forward = backward
  it is ``2N + D/f - 2`` (no intermediate bubbles), and no rank ever holds more than ``D``
  activations. Both figures are what the simulator measures; the tests pin them.

* ``backward-halving`` (paper §3.5, :func:`chimera_backward_halving`): halve the micro-batch so
  that a backward costs what a forward does, and order the 2N half-size micro-batches by forward
  doubling: a forward slot runs two half micro-batches (one full one's forward), a backward slot
  one. Up to 2D half-size activations (D full ones) in flight. The anchor table
  (:mod:`.anchor_table`) simulates it with half the costs and half the activation per
  micro-batch; the executor runs it exactly (tests/distributed/test_runtime.py: each micro-batch
  cut in two, against the single-process run of the whole ones). Training runs one
  ``--micro-batch-size``, so it is ``--chimera-concat forward-doubling`` at half that size;
  ``--chimera-concat backward-halving`` is refused with that advice (:data:`HALVING_REFUSED`).
"""

from __future__ import annotations

from megatron_chimera.schedules.actions import BACKWARD, FORWARD, Action, Schedule

CONCAT_DIRECT = "direct"
CONCAT_FORWARD_DOUBLING = "forward-doubling"
CONCAT_SLOT_MERGE = "slot-merge"
CONCAT_NAMES = (CONCAT_DIRECT, CONCAT_FORWARD_DOUBLING, CONCAT_SLOT_MERGE)
DEFAULT_CONCAT = CONCAT_SLOT_MERGE
CONCAT_BACKWARD_HALVING = "backward-halving"  # accepted by the flag only to say what to run
CONCAT_CHOICES = (*CONCAT_NAMES, CONCAT_BACKWARD_HALVING)
HALVING_REFUSED = (
    "--chimera-concat backward-halving: training runs every micro-batch at --micro-batch-size, "
    "and backward halving is forward doubling's order on twice the micro-batches at half the "
    "size: run --chimera-concat forward-doubling with half the --micro-batch-size (same global "
    "batch; the executor runs that order exactly)")

_UNIT_SHIFT = {CONCAT_DIRECT: 2, CONCAT_SLOT_MERGE: 1}  # slot shift per unit, in units of D


def chimera_placement(num_ranks: int, num_pipes: int) -> list[list[int]]:
    """``placement[pipe][stage] -> rank`` for f down pipes (ids 0..f-1) and f up pipes (f..2f-1)."""
    f = num_pipes // 2
    shift = num_ranks // f
    down = [[(s + j * shift) % num_ranks for s in range(num_ranks)] for j in range(f)]
    up = [[(num_ranks - 1 - s + j * shift) % num_ranks for s in range(num_ranks)] for j in range(f)]
    return down + up


def check_chimera_ranks_and_pipes(num_ranks: int, num_pipes: int, schedule: str) -> None:
    """Raise ValueError naming the flag unless D is even and the pipes are 2f with f | D/2.

    The rules every Chimera placement shares (``schedule`` names the schedule in the message).
    """
    if num_ranks < 2 or num_ranks % 2:
        raise ValueError(
            f"--pipeline-model-parallel-size must be even and >= 2 for {schedule}, got {num_ranks}"
        )
    if num_pipes < 2 or num_pipes % 2 or (num_ranks // 2) % (num_pipes // 2):
        allowed = [2 * f for f in range(1, num_ranks // 2 + 1) if (num_ranks // 2) % f == 0]
        raise ValueError(
            f"--chimera-pipes {num_pipes} does not fit --pipeline-model-parallel-size {num_ranks}: "
            f"use one of {', '.join(map(str, allowed))} (an even number of pipes, half of them "
            f"dividing D/2 = {num_ranks // 2})")


def check_chimera_sizes(
    num_ranks: int, num_microbatches: int, num_pipes: int = 2, concat: str | None = None
) -> str:
    """Raise ValueError naming the flag for sizes Chimera cannot run; return the concat to use."""
    check_chimera_ranks_and_pipes(num_ranks, num_pipes, "Chimera")
    concat = concat or DEFAULT_CONCAT
    if concat == CONCAT_BACKWARD_HALVING:
        raise ValueError(HALVING_REFUSED)
    if concat not in CONCAT_NAMES:
        raise ValueError(f"--chimera-concat: unknown value {concat!r}; choose from {CONCAT_NAMES}")
    multiple = 2 * num_ranks if concat == CONCAT_FORWARD_DOUBLING else num_ranks
    if multiple == num_ranks and 0 < num_microbatches < num_ranks:  # a partial basic unit
        if num_microbatches % num_pipes == 0:
            return concat
        raise ValueError(
            f"--num-microbatches below D = {num_ranks} must be a multiple of --chimera-pipes = "
            f"{num_pipes} for Chimera (every pipe runs as many), got {num_microbatches} "
            f"(adjust --global-batch-size / --micro-batch-size)")
    if num_microbatches < multiple or num_microbatches % multiple:
        raise ValueError(
            f"--num-microbatches must be a positive multiple of {multiple} for Chimera with "
            f"D = {num_ranks}{' and forward doubling' if multiple != num_ranks else ''}, got "
            f"{num_microbatches} (adjust --global-batch-size / --micro-batch-size)"
        )
    if concat == CONCAT_FORWARD_DOUBLING and num_pipes != 2:
        raise ValueError(
            f"--chimera-concat forward-doubling needs --chimera-pipes 2, got {num_pipes}"
        )
    return concat


def unit_slots(
    num_ranks: int, num_pipes: int, per_pipe: int | None = None
) -> list[tuple[int, Action]]:
    """The basic unit (N = D) as (slot, action) pairs; micro-batch ids are pipe-local here.

    ``per_pipe`` (default ``D / 2f``) below that keeps only each pipe's first ``per_pipe``
    micro-batches: a partial unit (N < D)."""
    per_pipe = num_ranks // num_pipes if per_pipe is None else per_pipe
    ops = []
    for pipe in range(num_pipes):
        for stage in range(num_ranks):
            for i in range(per_pipe):
                ops.append((stage + 2 * i, Action(FORWARD, pipe, stage, i)))
                ops.append((2 * num_ranks - 1 - stage + 2 * i, Action(BACKWARD, pipe, stage, i)))
    return ops


def _slot_orders(
    num_ranks: int, num_microbatches: int, num_pipes: int, unit_shift: int
) -> list[list[Action]]:
    """Units shifted by ``unit_shift`` slots each, merged per rank by (slot, backward first)."""
    placement = chimera_placement(num_ranks, num_pipes)
    per_unit = min(num_ranks, num_microbatches) // num_pipes  # N < D: one partial unit
    per_pipe = num_microbatches // num_pipes
    keyed: list[list[tuple[tuple[int, int, int, int], Action]]] = [[] for _ in range(num_ranks)]
    for u in range(max(1, num_microbatches // num_ranks)):
        for slot, a in unit_slots(num_ranks, num_pipes, per_unit):
            mb = a.pipe * per_pipe + u * per_unit + a.microbatch
            key = (slot + u * unit_shift, 0 if a.kind == BACKWARD else 1, u, a.pipe)
            keyed[placement[a.pipe][a.stage]].append((key, Action(a.kind, a.pipe, a.stage, mb)))
    return [[a for _, a in sorted(rank_ops, key=lambda t: t[0])] for rank_ops in keyed]


def _phase_orders(num_ranks: int, num_microbatches: int) -> list[list[Action]]:
    """Forward doubling (two pipes) in the reference code's phase form, see module docstring."""
    h = num_ranks // 2
    per_pipe = num_microbatches // 2
    steps = num_microbatches // (2 * num_ranks)
    orders = []
    for rank in range(num_ranks):
        a = h - rank if rank < h else rank - h + 1
        b = h - a
        x, y = (0, 1) if rank < h else (1, 0)
        fx, fy, bx, by = (FORWARD, x), (FORWARD, y), (BACKWARD, x), (BACKWARD, y)
        seq: list[tuple[str, int]] = []
        for step in range(steps):
            seq += ([fx, fx] if step == 0 else [bx, fx, fx]) * a
            seq += [fy, fy, fx, fx] * b + [fy, fy, by] * a + [bx, by] * (b + h)
        seq += [bx] * a
        count: dict[tuple[str, int], int] = {}
        order = []
        for kind, pipe in seq:
            i = count.get((kind, pipe), 0)
            count[(kind, pipe)] = i + 1
            stage = rank if pipe == 0 else num_ranks - 1 - rank
            order.append(Action(kind, pipe, stage, pipe * per_pipe + i))
        orders.append(order)
    return orders


def chimera_backward_halving(num_ranks: int, num_microbatches: int) -> Schedule:
    """Backward halving (module docstring): N micro-batches as 2N half-size ones in forward
    doubling's order; ``meta["microbatch_fraction"] = 0.5`` tells the simulation's callers to
    halve each action's cost and activation (N a positive multiple of D, two pipes)."""
    check_chimera_ranks_and_pipes(num_ranks, 2, "Chimera")
    if num_microbatches < num_ranks or num_microbatches % num_ranks:
        raise ValueError(f"--num-microbatches must be a positive multiple of {num_ranks} for "
                         f"Chimera with backward halving, got {num_microbatches}")
    schedule = chimera(num_ranks, 2 * num_microbatches, 2, CONCAT_FORWARD_DOUBLING)
    schedule.meta.update(concat="backward-halving", microbatch_fraction=0.5)
    return schedule


def chimera(
    num_ranks: int,
    num_microbatches: int,
    pipes: int = 2,
    concat: str | None = None,
) -> Schedule:
    """Chimera with ``pipes`` = 2f pipes over D ranks and N micro-batches per iteration.

    ``concat`` (``--chimera-concat``) chooses how N > D is built from N/D basic units:
    ``direct``, ``forward-doubling`` or ``slot-merge`` (default); see the module docstring.
    (The split-backward variant is the separate ``chimera-zb`` schedule.)
    """
    concat = check_chimera_sizes(num_ranks, num_microbatches, pipes, concat)
    if concat == CONCAT_FORWARD_DOUBLING:
        actions = _phase_orders(num_ranks, num_microbatches)
    else:
        shift = _UNIT_SHIFT[concat] * num_ranks
        actions = _slot_orders(num_ranks, num_microbatches, pipes, shift)
    return Schedule(
        name="chimera",
        num_ranks=num_ranks,
        num_stages=num_ranks,
        num_pipes=pipes,
        num_microbatches=num_microbatches,
        placement=chimera_placement(num_ranks, pipes),
        actions=actions,
        meta={"concat": concat if num_microbatches > num_ranks else "none"},
    )
