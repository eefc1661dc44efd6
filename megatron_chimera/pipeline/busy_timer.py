"""Compute-busy time of one rank's iteration, without a host-device sync inside it.

:class:`BusyTimer` sums the seconds of the executor's compute actions: the wall clock on the
CPU, CUDA events on a GPU (read only when the figures are gathered at a log interval). It also
reports each action's seconds to an optional :data:`ActionTimer` (the profiler) and spans to an
optional tracer, and is thread-aware: the two halves of a paired action time on two threads.
It also sums the seconds per action kind (F, B, W: :attr:`BusyTimer.by_kind`; on the CPU the
thread's CPU time), which straggler attribution compares with the schedule's prediction (only
with ``kinds``: ``--log-straggler``).
``MEGATRON_CHIMERA_SLOW_RANK=RANK:FRACTION`` (drills, CPU) stretches every compute action of
that rank by FRACTION of its CPU time, burnt inside it (a slower core).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from megatron_chimera.schedules.actions import Action

#: ``timer(action, seconds)``: called with every compute action's measured seconds
ActionTimer = Callable[[Action, float], None]
SLOW_ENV = "MEGATRON_CHIMERA_SLOW_RANK"


def injected_slowdown(rank: int, env: Mapping[str, str] = os.environ) -> float:
    """The fraction by which ``MEGATRON_CHIMERA_SLOW_RANK=RANK:FRACTION`` stretches this rank's
    compute (0 when unset or another rank); ValueError when malformed."""
    text = env.get(SLOW_ENV, "").strip()
    if not text:
        return 0.0
    try:
        slow_rank, fraction = text.split(":")
        return float(fraction) if int(slow_rank) == rank else 0.0
    except ValueError:
        raise ValueError(f"{SLOW_ENV}={text}: expected RANK:FRACTION, e.g. 3:0.3") from None


class BusyTimer:
    """Sums compute time: wall clock on CPU, CUDA events on GPU (read when gathered, so no
    host-device sync happens during the iteration). ``timer(action)`` is the context manager of
    one compute action (or one piece of it: its spans are summed); with an ``action_timer`` it
    also reports each action's seconds once, when the timer is totalled (the executor does at
    the end of a timed iteration; on GPU the events are read then). Events
    come from ``events`` (the executor's free list) and go back there once read."""

    def __init__(self, device: torch.device, events: list[Any],
                 action_timer: ActionTimer | None = None, tracer: Any = None,
                 slowdown: float = 0.0, kinds: bool = True) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        # seconds per action kind (complete after total()); on the CPU the thread's CPU time, so
        # a rank descheduled on a shared machine is not taken for a slow one
        self.by_kind: dict[str, float] = {}
        self.kinds = kinds
        self._cpu: list[list[float]] = []  # open spans' [thread CPU start, nested CPU seconds]
        self.slowdown = slowdown if not self.cuda else 0.0  # an injected delay (drills, CPU)
        self._thread_cpu = kinds or bool(self.slowdown)  # the CPU spans read the thread's clock
        self.action_timer = action_timer
        self.tracer = tracer  # tracer.compute(action, start, end) on the host clock
        self._free = events
        self._recorded: list[tuple[Any, Any, Action | None]] = []
        self._next: Action | None = None
        # open spans [start, action, nested spans]: a paired action's piece runs inside its
        # partner's span (at the partner's all-to-all) and is not counted twice
        self._open: list[tuple[Any, Action | None, list]] = []
        # an action timed in several spans (a backward's pieces) is reported once, summed
        self._per_action: dict[Action, float] = {}
        # the traced interval of each action: its first span's start to its last span's end
        self._traced: dict[Action, list[float]] = {}
        self._origin: tuple[Any, float] | None = None
        if tracer is not None and self.cuda:  # an event at a known host time (device idle)
            torch.cuda.synchronize()
            origin = self._event()
            origin.record()
            self._origin = (origin, time.perf_counter())

    def _event(self) -> Any:
        return self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)

    def __call__(self, action: Action | None = None) -> BusyTimer:
        self._next = action
        return self

    def __enter__(self) -> BusyTimer:
        if self.cuda:
            start = self._event()
            start.record()
        else:
            start = time.perf_counter()
            if self._thread_cpu:
                self._cpu.append([time.thread_time(), 0.0])
        self._open.append((start, self._next, []))
        return self

    def __exit__(self, *exc: Any) -> None:
        start, action, nested = self._open.pop()
        if self.cuda:
            end = self._event()
            end.record()
            self._recorded.append((start, end, action, nested))
            if self._open:
                self._open[-1][2].append((start, end))
        else:
            if self._thread_cpu:
                cpu_start, cpu_nested = self._cpu.pop()
                if self.slowdown and not self._open:  # burn the extra CPU time: a slower core
                    until = time.thread_time() + self.slowdown * (time.thread_time() - cpu_start)
                    while time.thread_time() < until:
                        pass
                cpu_span = time.thread_time() - cpu_start
                if self._cpu:
                    self._cpu[-1][1] += cpu_span
                if action is not None and self.kinds:
                    self._add_kind(action, cpu_span - cpu_nested)
            end = time.perf_counter()
            elapsed = end - start - sum(e - s for s, e in nested)
            if self._open:
                self._open[-1][2].append((start, end))
            self.seconds += elapsed
            if self.action_timer is not None and action is not None:
                self._per_action[action] = self._per_action.get(action, 0.0) + elapsed
            if self.tracer is not None and action is not None:
                self._trace(action, start, end)

    def total(self) -> float:
        """Busy seconds (synchronises the device on CUDA: call at log intervals)."""
        if self._recorded:
            torch.cuda.synchronize()
            for start, end, action, nested in self._recorded:
                elapsed = (start.elapsed_time(end)
                           - sum(s.elapsed_time(e) for s, e in nested)) / 1000.0
                self.seconds += elapsed
                if action is not None and self.kinds:
                    self._add_kind(action, elapsed)
                if self.action_timer is not None and action is not None:
                    self._per_action[action] = self._per_action.get(action, 0.0) + elapsed
                if self._origin is not None and action is not None:
                    origin, host = self._origin
                    self._trace(action, host + origin.elapsed_time(start) / 1000.0,
                                host + origin.elapsed_time(end) / 1000.0)
                self._free += (start, end)
            self._recorded = []
        if self._per_action:
            for action, seconds in self._per_action.items():
                self.action_timer(action, seconds)
            self._per_action = {}
        for action, (start, end) in self._traced.items():  # one trace event per action
            self.tracer.compute(action, start, end)
        self._traced = {}
        return self.seconds

    def _add_kind(self, action: Action, seconds: float) -> None:
        kind = getattr(action, "kind", str(action))
        self.by_kind[kind] = self.by_kind.get(kind, 0.0) + seconds

    def _trace(self, action: Action, start: float, end: float) -> None:
        span = self._traced.setdefault(action, [start, end])
        span[0], span[1] = min(span[0], start), max(span[1], end)
