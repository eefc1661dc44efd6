"""``--pipeline-trace FILE``: the measured per-rank timeline of a few iterations as a Chrome /
Perfetto trace (``{"traceEvents": [...]}``, complete events ``"ph": "X"``, ``pid`` = global rank,
times in microseconds from a common start).

While an iteration is traced the executor reports every compute action (F, B, W) with its start
and end (wall clock on CPU; on CUDA its events, placed on the host clock by an event recorded
right after a device sync), its transport is wrapped (:class:`~.trace.TracingTransport`) so every
send's post and every wait for a received message become events, and the launch of each
stage's gradient reduction and the final wait for them are spans; the training loop adds the
optimizer step. After the last traced iteration rank 0 gathers every rank's events (one
collective) and writes the file (atomically). The ranks' clocks are aligned at a barrier before
the first traced iteration (exact on one machine, which shares one monotonic clock).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_chimera.atomic import atomic_write
from megatron_chimera.pipeline.trace import SENT, WAITED, Timeline, TracingTransport
from megatron_chimera.schedules.actions import Action
from megatron_chimera.schedules.measured import TraceFormat as T

COMPUTE, P2P, GRADS, OPTIMIZER = T.COMPUTE, T.P2P, T.GRADS, T.OPTIMIZER
_DIRECTIONS = ("activation", "gradient")


def traced_iterations(start: int, total: int, count: int = 2) -> range:
    """Which iterations a run from iteration ``start`` (done so far) to ``total`` traces:
    ``count`` of them after one warm-up iteration, fewer when the run is shorter."""
    first = start + 2 if total - start >= count + 1 else start + 1
    return range(first, min(first + count, total + 1))


class PipelineTrace:
    """Records the traced iterations of this rank and writes the trace file (rank 0)."""

    def __init__(self, path: str, iterations: range, rank: int, device: torch.device,
                 metadata: dict[str, Any]) -> None:
        self.path, self.iterations, self.rank, self.device = path, iterations, rank, device
        self.metadata = metadata  # this rank's place (pipeline, data, tensor rank), schedule
        self.events: list[dict[str, Any]] = []
        self.origin: float | None = None
        self.iteration = 0
        self._timeline: Timeline | None = None
        self._executor: Any = None
        self.schedule: Any = None  # the traced schedule (its actions, for the plot)

    def _ts(self, t: float) -> float:
        assert self.origin is not None
        return (t - self.origin) * 1e6

    def span(self, name: str, cat: str, start: float, end: float, **args: Any) -> None:
        """One complete event from ``start`` to ``end`` (host ``perf_counter`` seconds)."""
        self.events.append({"name": name, T.CATEGORY: cat, "ph": "X", T.PID: self.rank,
                            "tid": cat, T.START: self._ts(start),
                            T.DURATION: max(0.0, (end - start) * 1e6),
                            T.ARGS: {T.ITERATION: self.iteration, **args}})

    def compute(self, action: Action, start: float, end: float) -> None:
        """The executor's hook: one compute action ran from ``start`` to ``end``."""
        self.span(f"{action.kind}{action.pipe}.{action.microbatch} s{action.stage}", COMPUTE,
                  start, end, **{T.KIND: action.kind, T.PIPE: action.pipe, T.STAGE: action.stage,
                                 T.MICROBATCH: action.microbatch})

    @contextlib.contextmanager
    def region(self, name: str, cat: str, **args: Any) -> Iterator[None]:
        """A span around a block of host code (only inside a traced iteration)."""
        if self._executor is None:
            yield
            return
        start = time.perf_counter()
        yield
        self.span(name, cat, start, time.perf_counter(), **args)

    def begin(self, executor: Any, iteration: int) -> None:
        """Before ``iteration``: hook ``executor`` when the iteration is traced."""
        if iteration not in self.iterations:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        if self.origin is None:
            if dist.is_initialized():
                dist.barrier()
            self.origin = time.perf_counter()
        self.iteration, self._executor, self._timeline = iteration, executor, Timeline()
        self.schedule = executor.schedule
        executor.tracer = self
        executor.comm.transport = TracingTransport(executor.comm.transport, self._timeline)

    def end(self) -> None:
        """After the optimizer step of a traced iteration: unhook, keep its messages, and after
        the last one gather and write the file. Collective then (every rank calls it)."""
        executor, timeline = self._executor, self._timeline
        if executor is None or timeline is None:
            return
        executor.tracer = None
        executor.comm.transport = executor.comm.transport.inner
        self._executor = self._timeline = None
        self._messages(timeline)
        if self.iteration == self.iterations[-1]:
            self.write()

    def _messages(self, timeline: Timeline) -> None:
        """Each send's post and each wait for a received message as a complete event."""
        for event in timeline.events:
            if event[0] not in (SENT, WAITED):
                continue
            m = event[1]
            sent = event[0] == SENT
            self.span(f"{'send' if sent else 'wait'} {m.short()}", P2P, event[2], event[3],
                      peer_pipeline_rank=m.dst if sent else m.src,
                      direction=_DIRECTIONS[m.direction],
                      **{T.PIPE: m.pipe, T.STAGE: m.stage, T.MICROBATCH: m.microbatch})

    def write(self) -> None:
        """Gather every rank's events on rank 0 and write the trace. Collective."""
        mine = (self.rank, self.metadata, self.events)
        gathered: list[Any] = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
        if dist.is_initialized():
            dist.gather_object(mine, gathered if self.rank == 0 else None, dst=0)
        if self.rank != 0:
            return
        events: list[dict[str, Any]] = []
        for rank, meta, rank_events in gathered:
            events.append({"name": "process_name", "ph": "M", T.PID: rank,
                           T.ARGS: {"name": f"rank {rank} ({meta.get('place', '')})"}})
            events.append({"name": "process_sort_index", "ph": "M", T.PID: rank,
                           T.ARGS: {"sort_index": rank}})
            events += rank_events
        trace = {T.EVENTS: events, "displayTimeUnit": "ms",
                 T.METADATA: {T.ITERATIONS: list(self.iterations),
                              T.SCHEDULE: self.schedule.to_dict(),
                              T.RANKS: {str(r): meta for r, meta, _ in gathered}}}
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        atomic_write(self.path, lambda handle: json.dump(trace, handle), mode="w")
        print(f" wrote the pipeline trace of iterations {list(self.iterations)} to "
              f"{self.path}", flush=True)
