"""When the training loop stops before its last iteration, as Megatron-LM's flags say.

* ``--exit-interval N``: after every N-th iteration (a local count: every rank agrees already).
* ``--exit-signal-handler``: after SIGTERM reached any rank (``scancel``, a SLURM preemption,
  torchrun forwarding its own SIGTERM). The handler only records the signal; at the next
  iteration boundary the ranks agree by one all-reduce, save and end with exit status 0. A
  second SIGTERM while saving is recorded the same way (saves are atomic in any case).
* ``--exit-duration-in-mins M``: once the job's wall-clock time passes M minutes, measured from
  the earliest start of any rank (agreed by an all-reduce) and agreed at the iteration boundary
  by the same all-reduce as the signal.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from types import FrameType

import torch
import torch.distributed as dist

from megatron_chimera.config import TrainingConfig


class SignalFlag:
    """While entered, ``signum`` (SIGTERM) is only recorded in :attr:`received`; leaving
    restores the previous handler. Outside the main thread it catches nothing (Python's rule)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.signum = signum
        self.received = False
        self._previous: object = None
        self._installed = False

    def _record(self, signum: int, frame: FrameType | None) -> None:  # noqa: ARG002
        self.received = True

    def __enter__(self) -> SignalFlag:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.signum, self._record)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(self.signum, self._previous)  # type: ignore[arg-type]
            self._installed = False


@dataclass
class ExitCheck:
    """The early-exit conditions of one run; :meth:`reason` is called by every rank at every
    iteration boundary (a collective when the signal or the duration is watched)."""

    training: TrainingConfig
    start_time: float  # the job's start (earliest over ranks, see :func:`agreed_start_time`)
    signals: SignalFlag | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def collective(self) -> bool:
        """Whether :meth:`reason` all-reduces (signal or duration watched)."""
        return self.signals is not None or self.training.exit_duration_in_mins is not None

    def reason(self, iteration: int) -> str | None:
        """Why to stop after ``iteration`` (the same on every rank), or None to go on."""
        if self.collective:
            minutes = (time.time() - self.start_time) / 60.0
            limit = self.training.exit_duration_in_mins
            flags = torch.tensor([float(self.signals is not None and self.signals.received),
                                  float(limit is not None and minutes > limit)],
                                 device=self.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            signalled, expired = (bool(v) for v in flags.tolist())
            if signalled:
                return f"exiting program after receiving SIGTERM at iteration {iteration}"
            if expired:
                return f"exiting program after {minutes:.2f} minutes at iteration {iteration}"
        interval = self.training.exit_interval
        if interval and iteration % interval == 0:
            return f"exiting program at iteration {iteration}"
        return None


def agreed_start_time(start_time: float, device: torch.device) -> float:
    """The earliest ``start_time`` of any rank (a collective): what the scheduler's clock saw."""
    value = torch.tensor([start_time], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return float(value.item())
