"""Runs a paired F&B action (``Schedule.pairs``) on one host thread so that each half's
all-to-alls overlap the other half's compute (``--overlap-moe-expert-parallel-comm``).

A half is either a **driver** (a forward: one call of the stage, whose MoE layers reach their
all-to-alls through this runtime, the :class:`PairRuntime` they are handed) or a list of
**pieces** (a generator): a backward cut at each all-to-all by its forward's
:class:`~megatron_chimera.model.moe.expert_comm.BackwardTape` (one ``torch.autograd.backward``
per segment; each piece ends by issuing its gradient all-to-all asynchronously and yields it),
or a W (one weight-gradient entry per piece). Megatron's combined 1F1B and DualPipe interleave
the same way: one thread, communication issued asynchronously (NCCL on its own stream, waited
on the compute stream; gloo's async work on CPU, which runs on gloo's own thread), and the
host launches the other half's compute in between.

**The order.** Pieces and driver alternate strictly: a driver that reaches an all-to-all issues
it, runs the partner's next piece (which ends by issuing the partner's next all-to-all, or is a
W entry), then waits for its own. Two piece lists alternate piece by piece. Which half leads
is a fixed function of the two action kinds (:func:`leading_half`); the ranks of an EP group
run the same action lists with the same stages, so every rank of the group issues the pair's
all-to-alls in one order, whatever the timing. Two drivers (F&F) run one after the other.

**Each half has its own random streams**, named on the rank's ``device``: the first half in
list order starts on the rank's streams, the second on streams forked from them; the runtime
swaps them at every switch, and after the pair the rank continues from the first half's.
:meth:`PairRuntime.run_in_turn` (no overlap) gives the halves the same streams, so a pair draws
the same random numbers overlapped or not. No thread is created, no interpreter setting
changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from megatron_chimera.model.moe.expert_comm import ExpertComm, Waitable
from megatron_chimera.tensor_parallel.random import (
    RngStates,
    forked_rng_states,
    get_rng_states,
    set_rng_states,
)


class Half(NamedTuple):
    """One half of a pair: its compute ``action`` and ``run``; with ``pieces`` ``run()``
    returns an iterator (each step one piece, yielding after issuing an all-to-all or between
    two W entries), else it is a driver that runs to its end."""

    action: Any
    run: Callable[[], Any]
    pieces: bool


class _Running:
    """A half in progress: its iterator (pieces), random streams and whether it ended."""

    __slots__ = ("half", "steps", "streams", "done")

    def __init__(self, half: Half, streams: RngStates) -> None:
        self.half, self.streams, self.steps, self.done = half, streams, None, False


def leading_half(kinds: Sequence[str]) -> int:
    """Which half of a pair of action kinds (``"F"``/``"B"``/``"W"``) computes first: the
    backward of an F&B pair (its first piece ends with its combine's gradient all-to-all), the
    F or B of a pair with a W (a W computes one entry per all-to-all of its partner), else the
    first."""
    if kinds[0] == "W" or (kinds[0] != kinds[1] and kinds[1] == "B"):
        return 1
    return 0


class PairRuntime(ExpertComm):
    """The rank's expert-parallel communication (handed to its MoE layers) and the runner of
    its paired actions. ``device``: the rank's device (its CUDA generator is the one saved and
    restored). ``action``: the compute action running now (labels the all-to-alls)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.action: Any = None
        self._partner: _Running | None = None  # advanced at the running driver's all-to-alls
        self._current: _Running | None = None

    def label(self, name: str) -> str:
        """``<action>:<name>``, e.g. ``F0.1.3:dispatch``."""
        action = self.action
        return f"{action.short() if action is not None else '-'}:{name}"

    def exchange(self, name: str, issue: Callable[[], Waitable]) -> None:
        """Issue the all-to-all; inside a pair run the partner's next piece while it is in
        flight (module docstring); then wait for it."""
        handle = self.start(name, issue)
        partner = self._partner
        if partner is not None and not partner.done:
            self._advance(partner)
        handle.wait()

    # ------------------------------------------------------------------ switching halves
    def _enter(self, running: _Running) -> _Running | None:
        """Make ``running`` the computing half (its streams, action, tape)."""
        previous = self._current
        if previous is not None:
            previous.streams = get_rng_states(self.device)
        set_rng_states(running.streams, self.device)
        self._current, self.action = running, running.half.action
        return previous

    def _leave(self, running: _Running, previous: _Running | None) -> None:
        running.streams = get_rng_states(self.device)
        self._current = previous
        if previous is not None:
            set_rng_states(previous.streams, self.device)
            self.action = previous.half.action

    def _advance(self, running: _Running) -> None:
        """Run the next piece of a pieces half (inside it, its own all-to-alls wait at once)."""
        outer, self._partner = self._partner, None
        tape, self.tape = self.tape, None
        previous = self._enter(running)
        try:
            if running.steps is None:
                running.steps = iter(running.half.run())
            next(running.steps)
        except StopIteration:
            running.done = True
        finally:
            self._leave(running, previous)
            self._partner, self.tape = outer, tape

    def _drive(self, running: _Running, partner: _Running | None) -> None:
        """Run a driver to its end, ``partner``'s pieces at its all-to-alls."""
        previous = self._enter(running)
        self._partner = partner
        try:
            running.half.run()
        finally:
            self._partner = None
            self._leave(running, previous)

    def _finish(self, running: _Running) -> None:
        """Run a half's remaining pieces (or the whole driver) alone."""
        if running.half.pieces:
            while not running.done:
                self._advance(running)
        elif not running.done:
            self._drive(running, None)
            running.done = True

    # ------------------------------------------------------------------ the entry points
    def run_alone(self, half: Half) -> None:
        """An unpaired action on the rank's own streams (its all-to-alls exposed)."""
        self.action = half.action
        try:
            if half.pieces:
                for _ in half.run():
                    pass
            else:
                half.run()
        finally:
            self.action = None

    def run_pair(self, halves: Sequence[Half], lead: int) -> None:
        """Run the two halves interleaved (``lead`` computes first; module docstring)."""
        start = get_rng_states(self.device)
        running = [_Running(halves[0], start),
                   _Running(halves[1], forked_rng_states(start, self.device))]
        first, second = running[lead], running[1 - lead]
        try:
            if first.half.pieces and second.half.pieces:
                while not (first.done and second.done):
                    for r in (first, second):
                        if not r.done:
                            self._advance(r)
            elif first.half.pieces or second.half.pieces:
                pieces, driver = (first, second) if first.half.pieces else (second, first)
                if pieces is first:
                    self._advance(pieces)
                self._drive(driver, pieces)
                driver.done = True
                self._finish(pieces)
            else:  # two drivers: one after the other, in list order
                for r in running:
                    self._finish(r)
        finally:
            self.action = None
        set_rng_states(running[0].streams, self.device)

    def run_in_turn(self, halves: Sequence[Half]) -> None:
        """The two halves one after the other, in list order, each on the streams
        :meth:`run_pair` gives it, their all-to-alls exposed."""
        start = get_rng_states(self.device)
        running = [_Running(halves[0], start),
                   _Running(halves[1], forked_rng_states(start, self.device))]
        try:
            for r in running:
                self._finish(r)
        finally:
            self.action = None
        set_rng_states(running[0].streams, self.device)


def weight_pieces(flush_entries: Callable[[], Iterator[None]]) -> Iterator[None]:
    """A W as pieces: one weight-gradient entry per step."""
    yield from flush_entries()
