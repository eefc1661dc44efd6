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
