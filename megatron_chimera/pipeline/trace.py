"""Where a pipeline iteration's time goes between its compute actions: one traced iteration.

The simulator costs a schedule as compute plus a latency per message; whatever an iteration takes
beyond that is spent between the actions. A :class:`Timeline` per rank records, on the one
``time.perf_counter`` clock every process of a machine shares, when each compute starts and ends
(the emulated stages report it, :mod:`.emulated`), when each send is posted and when each wait for
a message starts and returns (:class:`TracingTransport`, wrapped around the executor's transport).
:func:`gap_breakdown` then splits the time between consecutive computes of a rank into

* **critical hops**: the rank waited for a message that the sender posted only after the rank's
  previous compute had ended -- the message's flight, *send posted -> the wait returns*, and the
  receiver's work after it, *wait returns -> compute starts* (of several such messages, the one
  whose wait returned last);
* **local gaps**: the input was there (or the action needs none) -- *compute ends -> the next
  compute starts*, the executor's own work between two actions (plus, on a crowded machine,
  waiting for a core);
* and, on the sending side, *compute ends -> send posted*.

It also keeps each compute action's own time (*start -> end*), so that a caller who knows the
nominal times can tell what the actions themselves overran.

Recording is a list append and a clock read per event; the executor's hot path is untouched
(the transport is wrapped only for the traced iteration).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from megatron_chimera.schedules.lowering import SEND, Message

START, END, SENT, WAITED = "start", "end", "sent", "waited"
# (START | END, t) | (SENT, message, t_posting, t_posted) | (WAITED, message, t_called, t_returned)
Event = tuple


class Timeline:
    """The timestamped events of one rank in one traced iteration."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def compute_starts(self) -> None:
        """A compute action's own time begins now."""
        self.events.append((START, time.perf_counter()))

    def compute_ends(self) -> None:
        """The running compute action's own time is over now."""
        self.events.append((END, time.perf_counter()))


class TracingTransport:
    """A transport that records into ``timeline`` when each send is posted and when each wait
    for a message is called and returns; everything else is ``inner``'s (connections included,
    so a traced executor on the same inner transport connects nothing again)."""

    def __init__(self, inner: Any, timeline: Timeline) -> None:
        self.inner = inner
        self.timeline = timeline

    def post(self, op: str, messages: Sequence[Message], tensors: Sequence[Any]) -> list[Any]:
        """Post through ``inner``; a send is recorded as posted just before it goes out (and,
        after it, when the post call returned)."""
        now = time.perf_counter()
        works = self.inner.post(op, messages, tensors)
        if op == SEND:
            done = time.perf_counter()
            self.timeline.events.extend((SENT, m, now, done) for m in messages)
        return works

    def wait(self, work: Any, message: Message) -> None:
        """Wait through ``inner``, recording when the wait was called and when it returned."""
        called = time.perf_counter()
        self.inner.wait(work, message)
        self.timeline.events.append((WAITED, message, called, time.perf_counter()))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"count": 0, "median_ms": 0.0, "mean_ms": 0.0}
    return {"count": len(values), "median_ms": statistics.median(values) * 1e3,
            "mean_ms": statistics.fmean(values) * 1e3}


@dataclass
class GapBreakdown:
    """Seconds between compute actions, by cause, over every rank of one traced iteration."""

    hops: list[float] = field(default_factory=list)  # send posted -> the waiting receiver resumes
    wake_to_start: list[float] = field(default_factory=list)  # resumed -> its compute starts
    end_to_send: list[float] = field(default_factory=list)  # compute ends -> its send posted
    local_gaps: list[float] = field(default_factory=list)  # compute ends -> next starts
    computes: list[float] = field(default_factory=list)  # compute starts -> ends

    def merged(self, other: GapBreakdown) -> GapBreakdown:
        """Both breakdowns' gaps together (traced iterations of the same configuration)."""
        return GapBreakdown(*(getattr(self, f.name) + getattr(other, f.name)
                              for f in fields(self)))

    def summary(self) -> dict[str, dict[str, float]]:
        """Count, median and mean (ms) of each kind."""
        return {f.name: _stats(getattr(self, f.name)) for f in fields(self)}


def gap_breakdown(timelines: Sequence[Sequence[Event]]) -> GapBreakdown:
    """Split the time between consecutive computes of every rank's timeline (see the module
    docstring). A wait is a critical hop when its message was posted after the receiver's
    previous compute ended (both on the same clock); the first compute of a rank has no gap
    before it."""
    posted: dict[Message, float] = {}
    for events in timelines:
        posted.update((e[1], e[2]) for e in events if e[0] == SENT)
    out = GapBreakdown()
    for events in timelines:
        last_end: float | None = None
        started: float | None = None
        hop: tuple[float, float] | None = None  # (flight, when the wait returned)
        for event in events:
            kind = event[0]
            if kind == END:
                if started is not None:
                    out.computes.append(event[1] - started)
                last_end, hop, started = event[1], None, None
            elif kind == SENT and last_end is not None:
                out.end_to_send.append(event[2] - last_end)
            elif kind == WAITED and last_end is not None:
                sent = posted.get(event[1])
                if sent is not None and sent > last_end and (hop is None or event[3] > hop[1]):
                    hop = (event[3] - sent, event[3])  # the last message waited for decides
            elif kind == START:
                started = event[1]
                if last_end is None:  # a rank's first compute: no gap before it
                    continue
                if hop is not None:
                    out.hops.append(hop[0])
                    out.wake_to_start.append(event[1] - hop[1])
                else:
                    out.local_gaps.append(event[1] - last_end)
                last_end, hop = None, None
    return out
