"""Runs a paired F&B action (``Schedule.pairs``) so that each half's all-to-all overlaps the
other half's compute (``--overlap-moe-expert-parallel-comm``, issue 41).

The two halves of a pair run on two host threads that share one **baton**: only the holder
computes, so the rank's compute stays serial, as on a device. A half that reaches an
all-to-all (:func:`expert_all_to_all`, called by the stage code: the emulated MoE stages of
:mod:`.emulated`, and the real MoE layer's ``alltoall`` dispatcher through
:mod:`megatron_chimera.model.moe.expert_comm`, whose runner this module installs) issues it
*while holding the baton*, hands the baton to the other half (which computes while the
all-to-all is in flight), and, once the other half hands the baton back, waits for whatever of
its all-to-all is still in flight. Outside a pair the same call issues and waits at once (the
all-to-all is exposed).

**One issue order on every rank of an expert-parallel group.** The baton alternates strictly:
the leading half computes up to its first all-to-all, then the other half up to its first, then
the leader up to its second, and so on; a half that has finished hands the baton over for good.
A **W** half (weight gradients: no all-to-all) hands the baton over between the entries of its
weight-gradient store's flush (:func:`weight_piece_done`; one entry per linear layer), so it
computes one entry while each of its partner's all-to-alls is in flight instead of all of it
in the first. Its entries' collectives (a sequence-parallel input's all-gather, gradient
buckets made ready) thus also keep one order.
The leader is a fixed function of the two actions (the backward of an F&B pair, whose first
step is its combine all-to-all's gradient, DualPipe's order; the F or B of a pair with a W,
which issues no all-to-all; else the first in the list), and the ranks of an EP group run the
same action list (same pipe position), so every rank of the group issues the pair's
all-to-alls -- both halves', in the lowered list order of the pairs -- in one order, whatever
the timing. Each issue happens under the baton, so nothing else of the rank's host code runs
concurrently with it.

**Each half has its own random streams.** The process's generators (CPU, CUDA, the
tensor-parallel tracker's) would otherwise be shared by two halves that alternate mid-layer: a
dropout mask, or the replay of one in a recomputation, would depend on where the other half
drew. The baton carries them: a half that hands it over saves the process's streams as its
own, a half that takes it puts its own back. The first half in list order starts on the rank's
streams, the second on streams forked from them (``tensor_parallel.random.forked_rng_states``),
and after the pair the rank continues from where the first half left them.
:func:`run_in_turn` (no overlap) gives every half the same streams, so a pair draws the same
random numbers overlapped or not.

CPU only: the halves are host threads (autograd runs each backward on its calling thread for
CPU tensors); a CUDA runtime would use a communication stream and events instead.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from megatron_chimera.model.moe.expert_comm import set_all_to_all_runner
from megatron_chimera.tensor_parallel.random import (
    RngStates,
    forked_rng_states,
    get_rng_states,
    set_rng_states,
)
from megatron_chimera.tensor_parallel.weight_grad import set_between_entries

_state = threading.local()

#: a half expecting the baton at a known moment (its all-to-all's end) polls for it from
#: ``POLL_EARLY_S`` before that moment for at most ``POLL_S``, instead of sleeping until woken:
#: a thread woken by the other half's hand-over starts late by the OS's wake-up latency
#: (milliseconds on a loaded 2-core VM), which a device stream would not add
POLL_EARLY_S = 0.0001
POLL_S = 0.001
POLL_SLEEP_S = 0.00002


class Waitable(Protocol):
    """A started communication (``torch.distributed.Work`` or an emulated one, whose
    ``done_at``, a ``perf_counter`` time, says when it ends)."""

    def wait(self) -> Any:
        """Block until it is complete."""


class _Baton:
    """Strict alternation of the compute between the two halves of one pair; it carries each
    half's random streams (``streams[i]``: half i's while it does not compute)."""

    def __init__(self, lead: int, streams: list[RngStates]) -> None:
        self.owner = lead
        self.finished = [False, False]
        self.cond = threading.Condition()
        self.streams = streams
        self.live = 0  # the half whose streams the process's generators hold

    def take(self, me: int, expected_at: float | None = None) -> None:
        """Block until ``me`` holds the baton; with ``expected_at`` (a ``perf_counter`` time
        when the hand-over is likely) poll for it around that moment (:data:`POLL_S`)."""
        if expected_at is not None and self.owner != me:
            with self.cond:
                while (self.owner != me
                       and (left := expected_at - POLL_EARLY_S - time.perf_counter()) > 0):
                    self.cond.wait(left)
            end = time.perf_counter() + POLL_S
            while self.owner != me and time.perf_counter() < end:
                # a real sleep: a sleep(0) loop would hand the GIL back to itself and keep
                # the other half (which is to hand the baton over) waiting up to 5 ms
                time.sleep(POLL_SLEEP_S)
        with self.cond:
            while self.owner != me:
                self.cond.wait()
            if self.live != me:  # this half's random streams back into the generators
                set_rng_states(self.streams[me])
                self.live = me

    def hand_over(self, me: int) -> None:
        """``me`` issued an all-to-all: the other half computes next (unless it has finished)."""
        with self.cond:
            if not self.finished[1 - me]:
                self.streams[me] = get_rng_states()
                self.owner = 1 - me
                self.cond.notify_all()

    def finish(self, me: int) -> None:
        """``me`` is done: the other half holds the baton from now on."""
        with self.cond:
            self.streams[me] = get_rng_states()
            self.finished[me] = True
            self.owner = 1 - me
            self.cond.notify_all()


class _Half:
    def __init__(self, baton: _Baton, index: int) -> None:
        self.baton, self.index = baton, index


def in_pair() -> bool:
    """Whether the calling thread runs one half of a pair."""
    return getattr(_state, "half", None) is not None


def expert_all_to_all(issue: Callable[[], Waitable]) -> None:
    """Issue an all-to-all (``issue()`` starts it and returns its handle) and wait for it: in a
    pair, the other half computes meanwhile (module docstring); else the wait is exposed. In a
    pair the half waits for its turn first, then for its all-to-all (it cannot compute before
    its turn anyway)."""
    half: _Half | None = getattr(_state, "half", None)
    handle = issue()
    if half is None:
        handle.wait()
        return
    half.baton.hand_over(half.index)
    # the baton first, then the handle: under strict alternation this half computes next only
    # after the other half's next piece anyway, and by then its all-to-all has usually ended --
    # one thread wake-up per hand-over instead of two
    half.baton.take(half.index, getattr(handle, "done_at", None))
    handle.wait()


def weight_piece_done() -> None:
    """Called between two entries of a weight-gradient store's flush (a W; installed as
    ``tensor_parallel.weight_grad``'s hook): in a pair whose other half has not finished, hand
    the baton over and wait for it back (the other half computes up to its next all-to-all,
    issues it and hands back), so the W computes one entry per all-to-all of its partner; else
    nothing. The hand-over points are fixed by the two actions (every entry boundary), never
    by timing, so the baton still alternates in one order on every rank."""
    half: _Half | None = getattr(_state, "half", None)
    if half is None:
        return
    half.baton.hand_over(half.index)
    half.baton.take(half.index)


def leading_half(kinds: Sequence[str]) -> int:
    """Which half of a pair of action kinds (``"F"``/``"B"``/``"W"``) computes first: the
    backward of an F&B pair (it starts with communication: its combine's gradient), the F or B
    of a pair with a W (the W, which has no all-to-all, computes to its end once the other half
    has issued its first all-to-all and computes one weight-gradient entry per turn), else
    the first."""
    if kinds[0] == "W" or (kinds[0] != kinds[1] and kinds[1] == "B"):
        return 1
    return 0


#: Python's GIL switch interval while pairs run: a thread that wants the GIL (the half just
#: handed the baton, or whose all-to-all ended) otherwise waits up to the default 5 ms for a
#: thread that holds it (a spin, autograd's Python nodes) to let go
SWITCH_INTERVAL_S = 0.0002


def prepare_threads() -> None:
    """Set this process's GIL switch interval to at most :data:`SWITCH_INTERVAL_S` (the executor
    calls it when its schedule has pairs to overlap)."""
    if sys.getswitchinterval() > SWITCH_INTERVAL_S:
        sys.setswitchinterval(SWITCH_INTERVAL_S)


class _Helper:
    """The process's one helper thread for second halves (started once: starting a thread and
    autograd's per-thread state cost milliseconds per pair)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="pair-half", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job, done = self.jobs.get()
            try:
                job()
            finally:
                done.set()

    def submit(self, job: Callable[[], None]) -> threading.Event:
        """Run ``job`` on the helper thread; the event is set when it has returned."""
        done = threading.Event()
        self.jobs.put((job, done))
        return done


_helper: _Helper | None = None
_helper_lock = threading.Lock()


def _the_helper() -> _Helper:
    global _helper
    with _helper_lock:
        if _helper is None or not _helper.thread.is_alive():
            _helper = _Helper()
        return _helper


def run_pair(halves: Sequence[Callable[[], None]], lead: int) -> None:
    """Run the two callables as the halves of one pair (``lead`` computes first): the leading
    half on the calling thread, the other on the process's helper thread, each on its own
    random streams (module docstring). The first exception (in half order) is raised once both
    halves have ended."""
    start = get_rng_states()
    baton = _Baton(lead, [start, forked_rng_states(start)])
    errors: list[BaseException | None] = [None, None]

    def body(index: int) -> None:
        _state.half = _Half(baton, index)
        try:
            baton.take(index)
            halves[index]()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            errors[index] = exc
        finally:
            _state.half = None
            baton.finish(index)

    done = _the_helper().submit(lambda: body(1 - lead))
    body(lead)
    done.wait()
    set_rng_states(baton.streams[0])
    for exc in errors:
        if exc is not None:
            raise exc


def run_in_turn(halves: Sequence[Callable[[], None]]) -> None:
    """Run the two callables of a pair one after the other, in list order, without overlap
    (their all-to-alls issued and waited for at once), each on the random streams
    :func:`run_pair` gives it: the same random numbers as the overlapped pair."""
    start = get_rng_states()
    halves[0]()
    end = get_rng_states()
    set_rng_states(forked_rng_states(start))
    try:
        halves[1]()
    finally:
        set_rng_states(end)


def set_current_action(action: Any) -> None:
    """The compute action the calling thread runs now (labels its all-to-alls)."""
    _state.action = action


def current_action() -> Any:
    """The compute action the calling thread runs (None outside the executor's actions)."""
    return getattr(_state, "action", None)


#: when a list, the real MoE layer's all-to-alls (``model/moe/expert_comm.py``) append their
#: labels ``<action>:<name>`` to it in issue order (the tests' proof of interleaving)
issued: list[str] | None = None


def _model_all_to_all(name: str, issue: Callable[[], Waitable]) -> None:
    """The runner installed for the MoE layer's all-to-alls: :func:`expert_all_to_all`."""
    if issued is not None:
        action = current_action()
        issued.append(f"{action.short() if action is not None else '-'}:{name}")
    expert_all_to_all(issue)


set_all_to_all_runner(_model_all_to_all)
set_between_entries(weight_piece_done)
