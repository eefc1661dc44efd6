"""Workers die with their launcher: no orphan keeps training after ``kill -9`` of torchrun.

torchrun stops its workers when it is asked to, but a launcher killed with SIGKILL (or by the
out-of-memory killer) cannot, and its workers would train on as orphans holding GPUs. On Linux
:func:`die_with_parent` asks the kernel to send this process SIGKILL when its parent dies
(``prctl(PR_SET_PDEATHSIG)`` through ctypes); elsewhere, or if prctl is unavailable, a daemon
thread polls the parent's pid once a second. Torch-free (base layer).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun in every worker's environment


def launched_by_torchrun() -> bool:
    """True in a worker process started by torchrun (torch.distributed.run)."""
    return TORCHRUN_ENV in os.environ


def _kill_self(sig: int) -> None:
    os.kill(os.getpid(), sig)


def _watch_parent(parent: int, sig: int, poll_seconds: float) -> None:
    while True:
        time.sleep(poll_seconds)
        if os.getppid() != parent:
            _kill_self(sig)


def die_with_parent(sig: int = signal.SIGKILL, poll_seconds: float = 1.0) -> str:
    """Make this process receive ``sig`` when its parent dies; returns the mechanism used
    (``"prctl"`` or ``"watchdog"``). If the parent is already gone, ``sig`` is sent now."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0:
                if os.getppid() != parent:  # died before the request took effect
                    _kill_self(sig)
                return "prctl"
        except (OSError, AttributeError):
            pass
    thread = threading.Thread(target=_watch_parent, args=(parent, sig, poll_seconds),
                              name="parent-death-watchdog", daemon=True)
    thread.start()
    return "watchdog"
