"""Peak host memory of this process over a phase (a save, a load), from Linux's own counters.

:class:`PeakHostMemory` resets the process's resident-set high-water mark (``VmHWM``, by writing
``5`` to ``/proc/self/clear_refs``) when it starts and reads it when asked: the most the resident
memory rose above its level at the start, over every thread of the process. Where ``/proc`` has
no such files the figure is None.
"""

from __future__ import annotations

import time

_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int | None:
    try:
        with open(_STATUS) as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakHostMemory:
    """The rise of this process's peak resident memory since it was created."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")  # VmHWM := VmRSS
            self._start_kib = _status_kib("VmRSS")
        except OSError:
            self._start_kib = None

    def added_bytes(self) -> int | None:
        """Peak resident bytes above the level at the start (None: not measurable here)."""
        peak = _status_kib("VmHWM") if self._start_kib is not None else None
        if peak is None:
            return None
        return max(0, peak - self._start_kib) * 1024
