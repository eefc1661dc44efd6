"""Processes as /proc shows them (Linux), for tests that check nothing outlives what it should."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path


def _pids() -> Iterator[int]:
    return (int(entry) for entry in os.listdir("/proc") if entry.isdigit())


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None when
    the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def children_of(pid: int) -> list[int]:
    """Pids whose parent is ``pid``."""
    return [child for child in _pids()
            if (fields := _stat_fields(child)) is not None and int(fields[1]) == pid]


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def processes_mentioning(text: str) -> list[int]:
    """Pids (other than this process) whose command line contains ``text``."""
    found = []
    for pid in _pids():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and pid != os.getpid():
            found.append(pid)
    return found


def kill_launched(launcher: subprocess.Popen, workers: list[int]) -> None:
    """Clean up what a test started: SIGKILL the workers still alive, kill the launcher if it
    still runs, close its stdout."""
    for pid in workers:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    if launcher.poll() is None:
        launcher.kill()
    launcher.stdout.close()
