"""The entry scripts' ``main`` wrapper: one error line on the rank that found the problem.

When a rank fails, every other rank's next collective fails too (gloo: ``Connection closed by
peer``), so without coordination each rank prints a traceback about the symptom. Here the first
rank to fail claims the failure in the job's c10d store (torchrun's agent store, which outlives
the workers) and prints ``error: <message> [rank r]`` (its traceback too when the error is a bug
or ``--debug-tracebacks`` is given); every later rank prints one quiet line naming that rank:
``rank 3: stopped (rank 1 failed; see its error)``. When the failure is the symptom of a peer's
death (a closed connection, torchrun's SIGTERM), the first rank watches the ranks' heartbeats in
the store (:func:`~megatron_chimera.pipeline.failures.silent_ranks`) and every line names the rank
that stopped beating: ``error: lost contact with another rank: rank 2 died (...)`` and
``rank 3: stopped (rank 2 died (...); see rank 1's error)``. Exit codes are non-zero (2 for a
bad flag, 1 otherwise, 130 for Ctrl-C). Before the process group exists (flag validation) every rank
checks the same flags; local rank 0 prints the ``error:`` line and the others exit quietly with
the same code (under torchrun they wait, bounded, for the agent to end them after local rank 0).

Under torchrun the first rank's line is also written to ``TORCHELASTIC_ERROR_FILE``, so the
launcher's summary names the problem instead of pointing at its documentation. Exiting is
guarded by a watchdog: if interpreter shutdown hangs (a peer stuck in a collective, a loader
worker), the process ends anyway (``errors.exit_process``); from the moment ``main`` returns or
fails, SIGTERM is ignored, so it raises nothing inside the report or an ``atexit`` callback.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

from megatron_chimera.errors import (
    INTERRUPTED_EXIT_CODE,
    StoppedByPeer,
    exit_code_of,
    exit_process,
    one_line,
    print_error,
    tracebacks_requested,
    user_error_in,
)
from megatron_chimera.training.process import die_with_parent, launched_by_torchrun

_CLAIM_KEY = "megatron_chimera/error_claims"
_FIRST_KEY = "megatron_chimera/first_error_rank"
_DEAD_KEY = "megatron_chimera/dead_ranks"  # set by the first rank: the ranks that died, or ""
ECHO_WAIT_S = 20.0  # a quiet rank's longest wait for torchrun to end it after local rank 0


class Terminated(BaseException):
    """SIGTERM arrived (torchrun stopping the workers after another rank failed, or a scheduler)."""


def _rank_and_world() -> tuple[int | None, int]:
    """This process's global rank and the world size (from torch.distributed or torchrun's env)."""
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    rank = os.environ.get("RANK")
    return (int(rank) if rank is not None else None), int(os.environ.get("WORLD_SIZE", "1"))


def _store():
    """The job's c10d store, or None before ``init_process_group``."""
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.distributed_c10d._get_default_store()
    return None


def claim_failure(rank: int, wait_seconds: float = 3.0) -> int | None:
    """Claim this failure as the job's first; returns the rank that failed first (``rank`` when
    this claim won), or None when there is no reachable store."""
    store = _store()
    if store is None:
        return None
    try:
        if store.add(_CLAIM_KEY, 1) == 1:
            store.set(_FIRST_KEY, str(rank))
            return rank
        deadline = time.monotonic() + wait_seconds
        while time.monotonic() < deadline:
            if store.check([_FIRST_KEY]):
                return int(store.get(_FIRST_KEY).decode())
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store died with its host: nobody to ask
        return None
    return None


def _write_torchelastic_error_file(line: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                         "timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError), open(path, "w") as handle:
        json.dump(data, handle)


def _quiet_line(rank: int | None, first: int, what: str = "", dead: list[int] | None = None
                ) -> None:
    me = f"rank {rank}" if rank is not None else "this rank"
    if dead:
        reason = f"{_died(dead)}; see rank {first}'s error"
    else:
        reason = (f"rank {first} {what}" if what else f"rank {first} failed") + "; see its error"
    print(f"{me}: stopped ({reason})", file=sys.stderr, flush=True)


def _died(dead: list[int]) -> str:
    ranks = ", ".join(map(str, dead))
    return (f"rank{'s' if len(dead) > 1 else ''} {ranks} died (stopped heartbeating: killed, out "
            "of host memory, or a crash outside Python; the launcher's exit code says which)")


def _find_dead(rank: int, world: int, look: bool) -> list[int]:
    """On the rank that claimed the failure: the ranks that died (``look``: the failure is the
    symptom of a peer's death), published for the other ranks' lines."""
    from megatron_chimera.pipeline.failures import silent_ranks

    dead = silent_ranks(world, rank) if look else []
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):
            store.set(_DEAD_KEY, ",".join(map(str, dead)))
    return dead


def _published_dead(wait_seconds: float) -> list[int]:
    """The dead ranks the first rank published (waits for them), or []."""
    store = _store()
    if store is None:
        return []
    deadline = time.monotonic() + wait_seconds
    with contextlib.suppress(Exception):
        while time.monotonic() < deadline:
            if store.check([_DEAD_KEY]):
                return [int(r) for r in store.get(_DEAD_KEY).decode().split(",") if r]
            time.sleep(0.1)
    return []


def is_communication_error(exc: BaseException) -> bool:
    """True for the symptom of another rank's death: a torch.distributed error, the executor's
    PipelineFailure, or a closed/reset connection, anywhere along the cause chain."""
    markers = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
               "failed to recv", "failed to send")
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        kind = type(current)
        names = {c.__name__ for c in kind.__mro__}
        if names & {"DistError", "PipelineFailure"}:
            return True
        if isinstance(current, RuntimeError) and any(m in str(current) for m in markers):
            return True
        current = current.__cause__ or current.__context__
    return False


def report_failure(exc: BaseException) -> int:
    """Print ``exc`` as this rank should (first failure: the error; later ones: a quiet line
    naming the first rank) and return the exit code."""
    debug = tracebacks_requested()
    rank, world = _rank_and_world()
    if rank is not None and world > 1:
        from megatron_chimera.pipeline.failures import mark_left

        mark_left(rank)  # this rank ends on purpose: not one that died
    if isinstance(exc, StoppedByPeer):
        if debug:
            traceback.print_exception(exc, file=sys.stderr)
        _quiet_line(rank, exc.rank, exc.what)
        return 1
    first = claim_failure(rank) if rank is not None and world > 1 else None
    if first is not None and first != rank:
        if debug and not isinstance(exc, Terminated):
            traceback.print_exception(exc, file=sys.stderr)
        from megatron_chimera.pipeline.failures import SILENCE_S

        _quiet_line(rank, first, dead=_published_dead(SILENCE_S + 2.0))
        return 1
    symptom = user_error_in(exc) is None and (isinstance(exc, Terminated)
                                              or is_communication_error(exc))
    dead = _find_dead(rank, world, symptom) if first is not None else []
    if isinstance(exc, Terminated):
        after = f" after {_died(dead)}" if dead else ""
        print(f"rank {rank}: terminated (SIGTERM){after}" if rank is not None else "terminated",
              file=sys.stderr, flush=True)
        return 128 + signal.SIGTERM
    if isinstance(exc, KeyboardInterrupt):
        print("interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT_CODE
    suffix = f" [rank {rank}]" if rank is not None and world > 1 else ""
    if symptom and not debug:
        # another rank died without a word (killed, out of memory): name it (its heartbeat
        # stopped), else the symptom, once
        who = f"{_died(dead)}; " if dead else ""
        line = f"error: lost contact with another rank: {who}{one_line(exc)[:300]}{suffix}"
        print(line, file=sys.stderr, flush=True)
        _write_torchelastic_error_file(line)
        return 1
    shown = user_error_in(exc) or exc
    _write_torchelastic_error_file(f"error: {one_line(shown)}{suffix}")
    if first is None and world > 1 and not debug and _echo_of_local_rank_0(exc):
        _outlive_local_rank_0()
        return exit_code_of(shown)  # the same line is printed once, by local rank 0
    return print_error(exc, suffix, debug=debug)


def _echo_of_local_rank_0(exc: BaseException) -> bool:
    """True on every local rank but 0 for a user error found before the process group exists
    (flag validation): each rank checks the same flags, so local rank 0 speaks for the node."""
    local = os.environ.get("LOCAL_RANK")
    return local not in (None, "0") and user_error_in(exc) is not None and _store() is None


def _outlive_local_rank_0(bound_s: float = ECHO_WAIT_S) -> None:
    """Under torchrun, a quiet rank waits (bounded) for the agent's SIGTERM, which follows local
    rank 0's exit: a quiet rank that exited first could make the agent end rank 0 before its
    ``error:`` line was printed."""
    if not launched_by_torchrun() or threading.current_thread() is not threading.main_thread():
        return
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the agent's SIGTERM ends this rank
    time.sleep(bound_s)


def _raise_terminated(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    raise Terminated()


def _ignore_sigterm() -> None:
    """The process is ending (reporting its failure, or shutting down after ``main``): a
    SIGTERM now (torchrun stopping the workers after a peer died) must not raise
    :class:`Terminated` inside the report or an ``atexit`` callback. A hung shutdown still
    ends: the exit watchdog (``errors.exit_process``), or the launcher's SIGKILL."""
    if threading.current_thread() is threading.main_thread():
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


def run_main(main: Callable[[], None]) -> None:
    """Run an entry script's ``main``; on any failure report it once (see the module docstring)
    and exit non-zero. Under torchrun the process also dies with its launcher
    (:func:`~megatron_chimera.training.process.die_with_parent`)."""
    if launched_by_torchrun():
        die_with_parent()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        main()
    except SystemExit:
        _ignore_sigterm()
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure ends here, reported once
        _ignore_sigterm()
        exit_process(report_failure(exc))
    _ignore_sigterm()
