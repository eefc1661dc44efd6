"""Schedules as plain data.

A pipeline schedule is nothing but (1) the placement of stage replicas on pipeline ranks and
(2) one ordered list of :class:`Action` per pipeline rank. Generators produce it, the validator
checks it, the simulator costs it, the plotter draws it and the executor runs it; nothing else in
the framework knows which schedule is in use.

Conventions
-----------
* ``pipe`` is the pipe index, ``0 .. num_pipes-1``. GPipe/1F1B/interleaved have one pipe; Chimera
  with ``2f`` pipes numbers its down pipes ``0 .. f-1`` and its up pipes ``f .. 2f-1``.
* ``stage`` is the model stage, ``0 .. num_stages-1`` (``num_stages = D`` except for the
  interleaved schedule, where it is ``D * v``: stage ``s`` is virtual chunk ``s // D``).
* ``microbatch`` is the *global* micro-batch index of the iteration, ``0 .. num_microbatches-1``
  (per data-parallel replica). Each micro-batch belongs to exactly one pipe
  (:meth:`Schedule.pipe_of_microbatch`); pipe ``p`` owns the contiguous block
  ``[p * N/P, (p+1) * N/P)``.
* ``kind`` is ``F`` (forward), ``B`` (backward; input-gradient only when the schedule splits the
  backward) or ``W`` (weight-gradient only; present only when ``split_backward`` is true).
* ``pairs[rank]`` (MoE expert-parallel overlap, ``--overlap-moe-expert-parallel-comm``): list
  indices ``i`` where ``actions[rank][i]`` and ``actions[rank][i+1]`` -- e.g. a forward and a
  backward, or a W and a lone F or B, of two *independent* micro-batches (:func:`independent`) --
  run as one paired action: the pair starts when both inputs are there, and each half's
  all-to-all hides behind the other half's compute. Empty for every schedule without overlap
  (the lists themselves never change).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

FORWARD = "F"
BACKWARD = "B"
WEIGHT = "W"
KINDS = (FORWARD, BACKWARD, WEIGHT)
# generator metadata short enough for titles and log lines (the rest stays in ``meta``)
DESCRIBED_META = ("concat", "virtual_pipeline_size", "max_inflight", "activation_cap")


class _ActionFields(NamedTuple):
    kind: str
    pipe: int
    stage: int
    microbatch: int


class Action(_ActionFields):
    """One unit of work on one rank: F/B/W of one micro-batch through one stage replica.

    A tuple (hashing and comparison run in C: generators and walks handle millions of them).
    """

    __slots__ = ()

    def __new__(cls, kind: str, pipe: int, stage: int, microbatch: int) -> Action:
        if kind not in KINDS:
            raise ValueError(f"Action kind must be one of {KINDS}, got {kind!r}")
        return super().__new__(cls, kind, pipe, stage, microbatch)

    def short(self) -> str:
        """Compact label such as ``F0.3.12`` (kind, pipe, stage, micro-batch)."""
        return f"{self.kind}{self.pipe}.{self.stage}.{self.microbatch}"


def _derived(kind: str, pipe: int, stage: int, microbatch: int) -> Action:
    """An Action whose kind is known valid (derived from another): skips the check, since the
    dependency walks create millions of them."""
    return tuple.__new__(Action, (kind, pipe, stage, microbatch))


def input_of(action: Action, num_stages: int) -> Action | None:
    """The action whose output ``action`` consumes: *the* dependency rule of every schedule.

    F of stage s>0 needs F of s-1; B of the last stage needs its own F; B of s<S-1 needs B of s+1;
    W needs its own B. All of the same pipe and micro-batch. None for F of stage 0.
    """
    kind, pipe, stage, mb = action
    if kind == FORWARD:
        return None if stage == 0 else _derived(FORWARD, pipe, stage - 1, mb)
    if kind == BACKWARD:
        if stage == num_stages - 1:
            return _derived(FORWARD, pipe, stage, mb)
        return _derived(BACKWARD, pipe, stage + 1, mb)
    return _derived(BACKWARD, pipe, stage, mb)


def output_to(action: Action, num_stages: int) -> Action | None:
    """The action of *another stage* that consumes ``action``'s output (the inverse of
    :func:`input_of` across stages): F of s feeds F of s+1, B of s feeds B of s-1; None at the
    pipe ends and for W (whose output, a weight gradient, stays on its stage)."""
    kind, pipe, stage, mb = action
    if kind == FORWARD and stage < num_stages - 1:
        return _derived(FORWARD, pipe, stage + 1, mb)
    if kind == BACKWARD and stage > 0:
        return _derived(BACKWARD, pipe, stage - 1, mb)
    return None


def independent(first: Action, second: Action, sequence_slices: int = 1) -> str | None:
    """Why ``first`` and ``second`` may *not* run as one paired action (None: they may).

    The pairing rule in one place: a pair is two actions of *different micro-batches*, at least
    one of them an F or B (input-gradient B, or the whole backward) -- a forward with a backward
    in the steady state (DualPipe's and Megatron's pairs), in Chimera also two forwards of its
    two pipes in the warm-up and two backwards in the cool-down, and a W (weight gradient:
    compute, no all-to-all) with a lone F or B, computed while that half's all-to-all is in
    flight. :func:`input_of` only links actions of one pipe and one micro-batch, so two actions
    of different micro-batches never depend on each other, directly or through a chain: neither
    half waits for the other, and both can start together (a W and the B it needs share a
    micro-batch: never a pair). Two Ws carry no all-to-all to hide: never a pair. With
    ``sequence_slices`` k > 1 the k slices of one sequence are linked by the slice order, so the
    halves must belong to different sequences (micro-batch // k).
    """
    if first.kind == WEIGHT and second.kind == WEIGHT:
        return (f"a pair needs an F or B, got {first.short()} and {second.short()} "
                f"(W carries no all-to-all to hide)")
    if first.microbatch == second.microbatch:
        return (f"{first.short()} and {second.short()} are not independent: both belong to "
                f"micro-batch {first.microbatch} (pipe {first.pipe}), so one may depend on the "
                f"other through the dependency rule (input_of)")
    k = sequence_slices
    if k > 1 and first.microbatch // k == second.microbatch // k:
        return (f"{first.short()} and {second.short()} are not independent: both are slices of "
                f"sequence {first.microbatch // k}, which the slice order links")
    return None


def consumers(action: Action, num_stages: int, split_backward: bool) -> list[Action]:
    """Every action whose input (:func:`input_of`) is ``action``'s output."""
    kind, pipe, stage, mb = action
    if kind == FORWARD:
        nxt = output_to(action, num_stages)
        return [nxt if nxt is not None else _derived(BACKWARD, pipe, stage, mb)]
    if kind == BACKWARD:
        out = [_derived(WEIGHT, pipe, stage, mb)] if split_backward else []
        prev = output_to(action, num_stages)
        return out + ([prev] if prev is not None else [])
    return []


@dataclass
class Schedule:
    """Per-rank action lists plus the placement of (pipe, stage) replicas on pipeline ranks.

    ``placement[pipe][stage]`` is the pipeline rank (``0 .. num_ranks-1``) that holds that replica.
    ``actions[rank]`` is the ordered list that rank executes in one iteration.
    """

    name: str
    num_ranks: int
    num_stages: int
    num_pipes: int
    num_microbatches: int
    placement: list[list[int]]
    actions: list[list[Action]]
    split_backward: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    # per rank, sorted list indices i: actions[rank][i] and [i+1] run as one paired action
    pairs: list[list[int]] = field(default_factory=list)
    # k > 1: each sequence is k consecutive micro-batches (pipeline units) that must run in
    # slice order on each stage (schedules/slices.py)
    sequence_slices: int = 1

    # ------------------------------------------------------------------ derived views
    @property
    def release_kind(self) -> str:
        """The action that ends a micro-batch's work on a stage (its activations and received
        buffers are free after it; its last one per stage makes the gradients final): W with a
        split backward, else B."""
        return WEIGHT if self.split_backward else BACKWARD

    @property
    def num_sequences(self) -> int:
        """Sequences (data micro-batches) per iteration: N units / k slices (N unsliced)."""
        return self.num_microbatches // self.sequence_slices

    @property
    def microbatches_per_pipe(self) -> int:
        """Number of micro-batches each pipe processes (N / P)."""
        return self.num_microbatches // self.num_pipes

    def pipe_of_microbatch(self, microbatch: int) -> int:
        """The pipe that owns global micro-batch ``microbatch``."""
        return microbatch // self.microbatches_per_pipe

    def microbatches_of_pipe(self, pipe: int) -> range:
        """Global micro-batch indices owned by ``pipe``."""
        per = self.microbatches_per_pipe
        return range(pipe * per, (pipe + 1) * per)

    def rank_of(self, pipe: int, stage: int) -> int:
        """Pipeline rank holding stage ``stage`` of pipe ``pipe``."""
        return self.placement[pipe][stage]

    def replicas_of_rank(self, rank: int) -> list[tuple[int, int]]:
        """The (pipe, stage) replicas held by ``rank``, sorted by pipe then stage."""
        return [
            (pipe, stage)
            for pipe in range(self.num_pipes)
            for stage in range(self.num_stages)
            if self.placement[pipe][stage] == rank
        ]

    def stages_of_rank(self, rank: int) -> list[int]:
        """Distinct model stages whose weights ``rank`` holds (one module per stage)."""
        return sorted({stage for _, stage in self.replicas_of_rank(rank)})

    def weight_copies(self) -> list[int]:
        """Stage replicas (copies of a stage's weights) per rank."""
        return [len(self.stages_of_rank(r)) for r in range(self.num_ranks)]

    def prev_rank(self, pipe: int, stage: int) -> int | None:
        """Rank holding the previous stage of ``pipe`` (None at the first stage)."""
        return None if stage == 0 else self.placement[pipe][stage - 1]

    def next_rank(self, pipe: int, stage: int) -> int | None:
        """Rank holding the next stage of ``pipe`` (None at the last stage)."""
        return None if stage == self.num_stages - 1 else self.placement[pipe][stage + 1]

    def pair_starts(self) -> list[frozenset[int]]:
        """Per rank, the list indices where a paired action starts (empty sets: no pairs)."""
        if not self.pairs:
            return [frozenset()] * self.num_ranks
        return [frozenset(p) for p in self.pairs]

    def num_pairs(self) -> int:
        """How many paired actions the schedule has over all ranks."""
        return sum(len(p) for p in self.pairs)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form; actions become ``[kind, pipe, stage, microbatch]`` lists (``pairs``
        only when there are some, so schedules without overlap keep their old form)."""
        data = asdict(self)
        if not self.pairs:
            del data["pairs"]
        data["actions"] = [
            [[a.kind, a.pipe, a.stage, a.microbatch] for a in rank_actions]
            for rank_actions in self.actions
        ]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Schedule:
        """Inverse of :meth:`to_dict`."""
        fields = dict(data)
        fields["actions"] = [[Action(*a) for a in rank_actions] for rank_actions in data["actions"]]
        fields["placement"] = [list(p) for p in data["placement"]]
        fields["pairs"] = [list(p) for p in data.get("pairs", [])]
        return cls(**fields)

    def to_json(self) -> str:
        """JSON text of :meth:`to_dict`."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))

    def describe(self) -> str:
        """One-line summary: name, sizes and variant."""
        extra = " ".join(
            f"{k}={self.meta[k]}" for k in DESCRIBED_META if k in self.meta
        )
        return (
            f"{self.name} D={self.num_ranks} stages={self.num_stages} pipes={self.num_pipes} "
            f"N={self.num_microbatches}{' split-backward' if self.split_backward else ''}"
            f"{(' ' + extra) if extra else ''}"
            f"{f' pairs={self.num_pairs()}' if self.pairs else ''}"
        )


def single_pipe(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    rank_order: Callable[[int], list[Action]],
    split_backward: bool = False,
) -> Schedule:
    """A one-pipe schedule (stage r on rank r) from each rank's order; checks D, N >= 1 first.

    Shared by the single-pipe generators (GPipe, 1F1B, ZB-H1), which differ only in the order.
    """
    if num_ranks < 1:
        raise ValueError(f"--pipeline-model-parallel-size must be >= 1, got {num_ranks}")
    if num_microbatches < 1:
        raise ValueError(f"--num-microbatches must be >= 1, got {num_microbatches}")
    return Schedule(
        name=name,
        num_ranks=num_ranks,
        num_stages=num_ranks,
        num_pipes=1,
        num_microbatches=num_microbatches,
        placement=[list(range(num_ranks))],
        actions=[rank_order(rank) for rank in range(num_ranks)],
        split_backward=split_backward,
    )
