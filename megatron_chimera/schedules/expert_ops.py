"""The expert-parallel all-to-alls as ops of the lowered schedule (issue 48).

Each rank's MoE all-to-alls -- per MoE layer the dispatch (its per-expert counts, then the
tokens) and the combine in the forward, the combine's and the dispatch's gradients in the
backward -- follow from its lowered list and the layout of its stages, in the order the
one-thread paired runtime (``pipeline/overlap.py``) issues them:

* a forward is a *driver*: its all-to-alls in layer order; inside a pair, after each of them
  the partner runs its next piece;
* a backward is a list of *pieces* when its forward was cut (schedules with pairs): the
  executor's recomputation (if any) and the backward down to the last MoE layer's combine cut
  form the first piece, which ends by issuing that combine's gradient; then one piece per
  gradient all-to-all, down the layers, and a last piece that issues none. A layer inside a
  checkpointed region is not cut: its replayed forward and its gradients' all-to-alls are
  issued inside the piece that runs that region's backward. Uncut (no pairs), a backward is one
  piece;
* a W is pieces without all-to-alls; a pair alternates its halves as the runtime does (two
  drivers, or two backwards of one stage sharing a weight-gradient deferral, one after the
  other; without ``overlap`` every pair runs in turn).

The ranks of one expert-parallel group meet in these collectives on one communicator, so NCCL
matches them by issue order: :func:`check_expert_order` proves that every member issues the
same op at every position (else one rank's dispatch meets another's combine: a hang or wrong
data), and the executor checks in the NCCL-semantics mode that the runtime issued exactly the
lowered ops. Torch-free, like the IR.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from megatron_chimera.errors import ScheduleError
from megatron_chimera.schedules.actions import BACKWARD, FORWARD, Action
from megatron_chimera.schedules.lowering import LoweredSchedule

#: the all-to-alls of one MoE layer (the ``alltoall`` dispatcher's), forward and backward
FORWARD_NAMES = ("dispatch.counts", "dispatch", "combine")
BACKWARD_NAMES = ("combine.bwd", "dispatch.bwd")


class ExpertOp(NamedTuple):
    """One all-to-all of a compute action: its ``name`` (``dispatch``, ``combine.bwd``..)."""

    action: Action
    name: str

    def short(self) -> str:
        """The runtime's label, e.g. ``F0.1.3:dispatch``."""
        return f"{self.action.short()}:{self.name}"


class StageLayout(NamedTuple):
    """A stage's MoE layers in forward order: for each, the checkpointed region it is in
    (None: not checkpointed; layers of one region share its number)."""

    regions: tuple[int | None, ...]


def _forward_ops(action: Action, layout: StageLayout) -> list[ExpertOp]:
    return [ExpertOp(action, n) for _ in layout.regions for n in FORWARD_NAMES]


def _backward_pieces(action: Action, layout: StageLayout, cut: bool,
                     recompute: bool) -> list[list[ExpertOp]]:
    """The ops of each piece of a backward (see the module docstring)."""
    piece = _forward_ops(action, layout) if recompute else []
    pieces: list[list[ExpertOp]] = []
    regions = list(layout.regions)
    i = len(regions) - 1
    while i >= 0:
        region = regions[i]
        if region is None and cut:
            for name in BACKWARD_NAMES:
                piece.append(ExpertOp(action, name))
                pieces.append(piece)
                piece = []
            i -= 1
            continue
        first = i  # a checkpointed region (or an uncut run of layers): replay, then gradients
        while first > 0 and region is not None and regions[first - 1] == region:
            first -= 1
        if region is not None:
            piece += [ExpertOp(action, n) for _ in range(first, i + 1) for n in FORWARD_NAMES]
        piece += [ExpertOp(action, n) for _ in range(first, i + 1) for n in BACKWARD_NAMES]
        i = first - 1
    pieces.append(piece)
    return pieces


class _Half(NamedTuple):
    driver: bool
    pieces: list[list[ExpertOp]]  # a driver: one op per piece (its hooks)


def _half(action: Action, layouts: Mapping[int, StageLayout], cut: bool,
          recompute: bool) -> _Half:
    layout = layouts.get(action.stage, StageLayout(()))
    if action.kind == FORWARD:
        return _Half(True, [[op] for op in _forward_ops(action, layout)])
    if action.kind == BACKWARD:
        return _Half(False, _backward_pieces(action, layout, cut, recompute))
    return _Half(False, [])  # W: pieces without all-to-alls (their number does not matter)


def _in_turn(halves: Sequence[_Half]) -> list[ExpertOp]:
    return [op for h in halves for piece in h.pieces for op in piece]


def _paired(halves: Sequence[_Half], lead: int) -> list[ExpertOp]:
    first, second = halves[lead], halves[1 - lead]
    if first.driver and second.driver:
        return _in_turn(halves)
    out: list[ExpertOp] = []
    if not first.driver and not second.driver:
        for k in range(max(len(first.pieces), len(second.pieces))):
            for h in (first, second):
                if k < len(h.pieces):
                    out += h.pieces[k]
        return out
    pieces, driver = (first, second) if not first.driver else (second, first)
    queue = list(pieces.pieces)
    if pieces is first and queue:
        out += queue.pop(0)
    for hook in driver.pieces:
        out += hook
        if queue:
            out += queue.pop(0)
    for piece in queue:
        out += piece
    return out


def _leading_half(kinds: Sequence[str]) -> int:
    """``pipeline.overlap.leading_half`` (the IR may not import the runtime)."""
    if kinds[0] == "W" or (kinds[0] != kinds[1] and kinds[1] == "B"):
        return 1
    return 0


def expert_ops(lowered: LoweredSchedule, rank: int, layouts: Mapping[int, StageLayout],
               recompute: bool = False, overlap: bool = True) -> list[ExpertOp]:
    """``rank``'s all-to-alls of one iteration in issue order (module docstring); ``layouts``
    per stage (a stage missing: no MoE layer), ``recompute``: the executor's recomputation,
    ``overlap``: pairs interleaved (False: in turn)."""
    schedule = lowered.schedule
    cut = not lowered.forward_only and any(schedule.pairs)
    actions = lowered.compute_lists()[rank]
    starts = set(lowered.pair_starts()[rank])
    out: list[ExpertOp] = []
    i = 0
    while i < len(actions):
        action = actions[i]
        if lowered.forward_only:
            out += _forward_ops(action, layouts.get(action.stage, StageLayout(())))
            i += 1
            continue
        if i in starts:
            a, b = action, actions[i + 1]
            halves = (_half(a, layouts, cut, recompute), _half(b, layouts, cut, recompute))
            shared = (schedule.split_backward and a.kind == b.kind == BACKWARD
                      and a.stage == b.stage)
            if overlap and not shared:
                out += _paired(halves, _leading_half((a.kind, b.kind)))
            else:
                out += _in_turn(halves)
            i += 2
            continue
        out += _in_turn([_half(action, layouts, cut, recompute)])
        i += 1
    return out


def check_expert_order(ops: Mapping[int, Sequence[ExpertOp]],
                       groups: Sequence[Sequence[int]]) -> None:
    """Raise :class:`ScheduleError` unless the members of every expert-parallel group (keys
    of ``ops``) issue the same all-to-all at every position (same layer op of the same
    compute action: NCCL matches a communicator's collectives by issue order)."""
    for group in groups:
        first = group[0]
        for member in group[1:]:
            mine, theirs = ops[first], ops[member]
            for position, (x, y) in enumerate(zip(mine, theirs)):
                if x.name != y.name or x.action != y.action:
                    raise ScheduleError(
                        f"expert-parallel group {list(group)}: all-to-all {position} is "
                        f"{x.short()} on rank {first} but {y.short()} on rank {member} (NCCL "
                        f"matches them by issue order: they would exchange the wrong tensors)")
            if len(mine) != len(theirs):
                raise ScheduleError(
                    f"expert-parallel group {list(group)}: rank {first} issues {len(mine)} "
                    f"all-to-alls, rank {member} {len(theirs)}")
