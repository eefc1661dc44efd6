"""First-failure reporting across ranks through the c10d store.

When a rank fails mid-iteration its peers' communication fails next, with messages (``Connection
closed by peer``) that say nothing about the cause. Every failing rank records its message in the
default store; the first one recorded wins, and each rank's :class:`PipelineFailure` names it.
"""

from __future__ import annotations

import contextlib
import time

import torch.distributed as dist

_FAILURE_KEY = "megatron_chimera/first_failure"
_FAILURE_COUNT = "megatron_chimera/failure_count"


class PipelineFailure(RuntimeError):
    """A rank failed during a pipeline iteration; the message names the rank that failed first."""


def _default_store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (e.g. not initialised): nothing to report to
        return None


def record_failure(message: str) -> None:
    """Record ``message`` as the job's first failure unless another rank was first."""
    store = _default_store()
    if store is None:
        return
    with contextlib.suppress(Exception):
        if store.add(_FAILURE_COUNT, 1) == 1:
            store.set(_FAILURE_KEY, message)


def first_failure(wait_seconds: float = 2.0) -> str | None:
    """The first failure recorded by any rank (waits briefly for it to appear), or None."""
    store = _default_store()
    if store is None:
        return None
    deadline = time.monotonic() + wait_seconds
    with contextlib.suppress(Exception):
        while True:
            if store.check([_FAILURE_KEY]):
                return store.get(_FAILURE_KEY).decode()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
    return None


def pipeline_failure(message: str) -> PipelineFailure:
    """Record ``message`` and return the failure to raise: the first rank's message, then ours."""
    record_failure(message)
    first = first_failure()
    if first is None or first == message:
        return PipelineFailure(message)
    return PipelineFailure(f"{first}; then {message}")


# --------------------------------------------------------------------------- who died
# Every rank's hang watch (:class:`~megatron_chimera.pipeline.hang.HangWatch`) adds 1 to its
# heartbeat counter every HEARTBEAT_S seconds; a rank that ends through the failure report or
# ends training marks itself as left. A killed rank (``kill -9``, the kernel's OOM killer, a
# crash outside Python) does neither: its counter stops.
_HEARTBEAT = "megatron_chimera/heartbeat"
_LEFT = "megatron_chimera/left"
HEARTBEAT_S = 2.0
# how long a rank watches the counters before naming the silent ones: more than two beats
SILENCE_S = 2.5 * HEARTBEAT_S


def heartbeat(store: dist.Store, rank: int) -> None:
    """One beat of ``rank``."""
    store.add(f"{_HEARTBEAT}/{rank}", 1)


def mark_left(rank: int, store: dist.Store | None = None) -> None:
    """``rank`` ends on purpose (a reported failure, the end of training): not a death."""
    store = store if store is not None else _default_store()
    if store is not None:
        with contextlib.suppress(Exception):
            store.set(f"{_LEFT}/{rank}", "1")


def silent_ranks(world_size: int, rank: int, store: dist.Store | None = None,
                 wait_s: float = SILENCE_S) -> list[int]:
    """The ranks that stopped heartbeating without leaving: dead (or frozen with the GIL held).

    Watches every other rank's counter for ``wait_s``: a rank whose counter moves, or that
    marks itself as left, is alive; one whose counter had started and stays still is named.
    Ranks that never beat (the failure came before their watch started) are not named. Returns
    [] without a store (e.g. it lived in the dead rank)."""
    store = store if store is not None else _default_store()
    if store is None:
        return []
    try:
        start = {r: store.add(f"{_HEARTBEAT}/{r}", 0) for r in range(world_size) if r != rank}
        silent = {r for r, beats in start.items() if beats > 0}
        deadline = time.monotonic() + wait_s
        while silent and time.monotonic() < deadline:
            time.sleep(0.2)
            for r in sorted(silent):
                if (store.check([f"{_LEFT}/{r}"])
                        or store.add(f"{_HEARTBEAT}/{r}", 0) != start[r]):
                    silent.discard(r)
    except Exception:  # noqa: BLE001 - the store went away: nobody to ask
        return []
    return sorted(silent)
