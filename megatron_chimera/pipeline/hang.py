"""Hang forensics: who waits for whom when a pipeline iteration stops moving.

A :class:`HangWatch` thread per rank looks at its executor once a second (nothing is added to the
hot path: the executor only exposes the running iteration). While the training loop is in a
watched block (a training step, the gathering of the losses) and nothing has moved for
``threshold`` seconds (60% of ``--distributed-timeout-minutes``, so the report is done before
the backend's own timeout error), or when the rank gets ``SIGUSR1`` (on demand), the rank asks every
rank, through the c10d store, to publish one line: its last completed action and what it is
doing now -- waiting for a message (pipe, stage edge, micro-batch, F/B/W, peer rank), computing an
action, or in a collective (the gradient reductions, the loss gather: it waits for every rank
that did not report). The rank that claims the report joins the lines into a wait-for graph
(rank -> the rank it waits for) and names the rank where the waits end -- one that computes,
or one that did not report (stopped, or stuck outside the interpreter) -- or the cycle. On a
timeout every live rank then exits (the error is the graph line); ``SIGUSR1`` only logs.
The same thread beats the rank's heartbeat in the store (:func:`~.failures.silent_ranks`: the
failure report names a rank that was killed).

On NCCL the host-side picture is not the whole one: a posted NCCL receive or collective does not
block the host, which runs ahead to a later synchronisation. There each rank's line also names
the oldest unfinished operation of torch's NCCL flight recorder (:func:`flight_recorder_line`;
``initialize_distributed`` turns the recorder on) -- the stuck collective or message, its group
and sequence number -- and the watch only reports: NCCL's own watchdog ends the ranks at the
timeout and dumps the recorder per rank (``TORCH_NCCL_DUMP_ON_TIMEOUT``), which ending them at
0.6x the timeout would prevent.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from megatron_chimera.pipeline.failures import (
    HEARTBEAT_S,
    first_failure,
    heartbeat,
    mark_left,
    record_failure,
)

_KEY = "megatron_chimera/hang"
_DIRECTIONS = ("activation", "gradient")
REPORT_WAIT_SECONDS = 8.0  # how long the reporting rank waits for the other ranks' lines
#: how long :meth:`HangWatch.stop` waits for the thread (a report in progress reads the store
#: for up to REPORT_WAIT_SECONDS)
STOP_JOIN_S = 2 * REPORT_WAIT_SECONDS
ASK_EVERY = 5  # a rank that moves looks for another rank's request every 5th poll (store load)


def _states_key(round_: int) -> str:
    """The store key the ranks' lines of a report round are appended to (one line each)."""
    return f"{_KEY}/{round_}/states"


def rank_state(executor: Any, since: float, section: str | None = None) -> dict[str, Any]:
    """This rank's line and the global rank it waits for (None: it waits for nobody);
    ``section``: what the training loop is doing outside the pipeline (its collectives)."""
    run = executor.active
    rank = dist.get_rank() if dist.is_initialized() else executor.pipeline_rank
    head = f"rank {rank} (pipeline rank {executor.pipeline_rank})"
    if run is None:
        what = f"in {section}" if section else "between iterations"
        return {"rank": rank, "waits_for": None, "collective": section is not None,
                "line": f"{head}: {what} for {time.monotonic() - since:.0f} s"}
    done = run.executed[-1].short() if run.executed else "nothing yet"
    head += f": last completed {done}; "
    seconds = f"for {time.monotonic() - since:.0f} s"
    step = run.current
    if step is None:
        return {"rank": rank, "waits_for": None, "collective": True,
                "line": f"{head}in the gradient reductions (pending collectives) {seconds}"}
    message = executor.comm.waiting
    awaiting = getattr(executor.transport, "awaiting", None)  # NCCL semantics: a rendezvous
    if message is None and awaiting is not None:
        peer, why = awaiting
        return {"rank": rank, "waits_for": peer,
                "line": f"{head}{why}: waits {seconds} for rank {peer} (to run {step.short()})"}
    if message is not None:
        peer = executor.topology.to_global_rank(message.src)
        what = (f"waits {seconds} for {message.short()} ({_DIRECTIONS[message.direction]}, pipe "
                f"{message.pipe}, stage edge {message.stage}->{message.stage + 1}, micro-batch "
                f"{message.microbatch}) from rank {peer} to run {step.short()}")
        return {"rank": rank, "waits_for": peer, "line": head + what}
    return {"rank": rank, "waits_for": None, "line": f"{head}runs {step.short()} {seconds}"}


def summarize_flight_record(record: dict[str, Any]) -> str | None:
    """One line naming the oldest unfinished entry of a flight-recorder dump (torch's JSON form:
    ``entries`` with ``profiling_name``, ``process_group`` [name, description], the collective
    or point-to-point sequence number, ``state`` and ``input_sizes``), or None when all are
    completed."""
    pending = [e for e in record.get("entries", []) if e.get("state") != "completed"]
    if not pending:
        return None
    entry = min(pending, key=lambda e: (e.get("time_created_ns", 0), e.get("record_id", 0)))
    name, desc = (list(entry.get("process_group") or ["?", "undefined"]) + ["undefined"])[:2]
    group = f"{name}:{desc}" if desc not in ("", "undefined") else name
    kind, seq = (("p2p", entry.get("p2p_seq_id")) if entry.get("is_p2p")
                 else ("collective", entry.get("collective_seq_id")))
    return (f"NCCL flight recorder: oldest unfinished {entry.get('profiling_name', '?')} (group "
            f"{group}, {kind} seq {seq}, {entry.get('state', '?')}, input sizes "
            f"{entry.get('input_sizes')}; {len(pending)} unfinished)")


def flight_recorder_line() -> str | None:
    """This process's flight recorder, summarised (:func:`summarize_flight_record`); None
    without a recorder or an unfinished entry."""
    from torch._C import _distributed_c10d as c10d

    dump = (getattr(c10d, "_dump_fr_trace_json", None)
            or getattr(c10d, "_dump_nccl_trace_json", None))
    if dump is None:
        return None
    try:
        return summarize_flight_record(json.loads(dump(True, True)))
    except Exception:  # noqa: BLE001 - forensics must not fail the report
        return None


def wait_for_graph(states: dict[int, dict[str, Any]], world_size: int,
                   settled: bool = True) -> str:
    """One line naming where the waits end: the rank that computes or did not report, or the
    cycle of waits. ``settled``: the lines were taken after nothing moved for the threshold (a
    timeout); on demand (``SIGUSR1``) the ranks may still move between their lines, so a cycle
    is only a deadlock if it lasts."""
    silent = [r for r in range(world_size) if r not in states]
    edges = {r: s["waits_for"] for r, s in states.items()}
    for r, s in states.items():  # a rank in a collective waits for the ranks that are silent
        if s["waits_for"] is None and s.get("collective") and silent:
            edges[r] = silent[0]
    waiting = {r: p for r, p in edges.items() if p is not None}
    graph = ", ".join(f"{r}->{p}" for r, p in sorted(waiting.items())) or "no waits"
    ends: dict[int, list[int]] = {}
    for start in waiting:
        seen, node = [], start
        while node in waiting and node not in seen:
            seen.append(node)
            node = waiting[node]
        if node in seen:
            cycle = seen[seen.index(node):]
            verdict = "a deadlock" if settled else (
                "a deadlock if it lasts: the lines were taken while ranks moved")
            return (f"wait-for graph {graph}: the ranks wait in a cycle "
                    f"{' -> '.join(map(str, cycle + [node]))} ({verdict})")
        ends.setdefault(node, []).append(start)
    parts = []
    for end, starts in sorted(ends.items()):
        if end in silent:
            why = "did not report (stopped, or stuck outside the interpreter)"
        else:
            why = "is not waiting for a message: " + states[end]["line"].split(": ", 1)[-1]
        parts.append(f"rank {end} {why}; ranks {sorted(starts)} wait for it")
    if silent and not parts:
        parts.append(f"ranks {silent} did not report")
    return f"wait-for graph {graph}: " + ("; ".join(parts) or "nobody waits")


class HangWatch:
    """The watchdog thread of one rank (see the module docstring)."""

    nccl = False  # the default group is NCCL's: lines name the flight recorder's oldest entry

    def __init__(self, get_executor: Callable[[], Any], threshold_s: float,
                 poll_s: float = 1.0, end_ranks: bool | None = None) -> None:
        self.get_executor, self.threshold_s, self.poll_s = get_executor, threshold_s, poll_s
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # end every rank after a timeout report (None: except on NCCL, whose watchdog ends them
        # at the timeout and dumps its flight recorder)
        self.nccl = dist.get_backend() == "nccl"
        self.end_ranks = not self.nccl if end_ranks is None else end_ranks
        self.store = dist.distributed_c10d._get_default_store()  # noqa: SLF001
        self._seen_round = 0
        self._failed = False  # an error of the watch itself was printed
        self.section: str | None = None  # set by :meth:`watching`: the watch is armed
        self._stop = threading.Event()
        self._signal_read = self._install_sigusr1()
        self._thread = threading.Thread(target=self._loop, name="hang-watch", daemon=True)

    def start(self) -> HangWatch:
        """Start watching."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (end of training): its heartbeats end, and the rank is marked as
        left, not dead. The thread is joined: a daemon thread still dropping its last
        reference to the model while the interpreter finalizes aborts the process
        (``terminate called without an active exception``)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=STOP_JOIN_S)
        mark_left(self.rank, self.store)

    @contextlib.contextmanager
    def watching(self, section: str) -> Iterator[None]:
        """Arm the watch for a block whose waits are all collectives or pipeline messages (not
        local work of unbounded length: checkpoint writes, evaluation)."""
        outer, self.section = self.section, section
        try:
            yield
        finally:
            self.section = outer

    @staticmethod
    def _install_sigusr1() -> int | None:
        """A pipe the C-level signal handler writes to, so the thread sees SIGUSR1 at once even
        while the main thread is blocked in a collective."""
        if threading.current_thread() is not threading.main_thread():
            return None
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        signal.signal(signal.SIGUSR1, lambda *_: None)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        return read

    def _sigusr1(self) -> bool:
        if self._signal_read is None:
            return False
        ready, _, _ = select.select([self._signal_read], [], [], 0)
        if not ready:
            return False
        with contextlib.suppress(BlockingIOError):
            return signal.SIGUSR1 in os.read(self._signal_read, 64)
        return False

    def _loop(self) -> None:
        last, since, polls, beat = None, time.monotonic(), 0, -HEARTBEAT_S
        reported = None  # the stall already reported (a watch that does not end the ranks)
        while True:
            if time.monotonic() - beat >= HEARTBEAT_S:  # who died: see failures.silent_ranks
                beat = time.monotonic()
                with contextlib.suppress(Exception):  # (the store may have left with its host)
                    heartbeat(self.store, self.rank)
            if self._stop.wait(self.poll_s):
                return
            polls += 1
            executor = self.get_executor()
            run = executor.active if executor is not None else None
            section = self.section
            progress = (section, id(run), len(run.executed) if run else 0,
                        id(run.current) if run else 0)
            if progress != last:
                last, since = progress, time.monotonic()
            try:
                if self._sigusr1():
                    self.report(executor, since, "SIGUSR1", exit_after=False)
                elif (section is not None and time.monotonic() - since > self.threshold_s
                      and reported != (progress, since)):
                    reported = (progress, since)
                    self.report(executor, since, "timeout", exit_after=self.end_ranks)
                elif polls % ASK_EVERY == 0 or time.monotonic() - since > 2 * self.poll_s:
                    self._answer(executor, since)
            except Exception as exc:  # noqa: BLE001 - the watch must never end the run itself
                if not self._failed:
                    self._failed = True
                    print(f" hang watch: {type(exc).__name__}: {exc}", flush=True)

    def _answer(self, executor: Any, since: float) -> None:
        """Publish this rank's line when another rank asked for a new round."""
        if not self.store.check([f"{_KEY}/round"]):
            return
        current = int(self.store.get(f"{_KEY}/round"))
        if current > self._seen_round:
            self._publish(executor, since, current)

    def _state(self, executor: Any, since: float) -> dict[str, Any]:
        """This rank's state, logged as its report line."""
        state = rank_state(executor, since, self.section) if executor is not None else {
            "rank": self.rank, "waits_for": None, "line": f"rank {self.rank}: not training"}
        if self.nccl and (recorded := flight_recorder_line()) is not None:
            state["line"] += f"; {recorded}"
        print(f" hang report: {state['line']}", flush=True)
        return state

    def _publish(self, executor: Any, since: float, round_: int) -> None:
        self._seen_round = round_
        self.store.append(_states_key(round_), json.dumps(self._state(executor, since)) + "\n")

    def _round(self, join: bool) -> int:
        """The round to report in: with ``join``, one another rank started less than the
        threshold ago (the same hang), else the next one. Ranks that want a new round at the
        same moment get the same one: only the first to claim the successor of ``current``
        creates it, the others wait for its number (two rounds would each miss the other's
        ranks and name them as silent)."""
        current = self.store.add(f"{_KEY}/round", 0)
        if join and current:
            started = float(self.store.get(f"{_KEY}/{current}/started"))
            if time.time() - started < self.threshold_s:
                return current
        if self.store.add(f"{_KEY}/{current}/successor-claim", 1) > 1:
            return int(self.store.get(f"{_KEY}/{current}/successor"))
        new = self.store.add(f"{_KEY}/round", 1)
        self.store.set(f"{_KEY}/{new}/started", str(time.time()))
        self.store.set(f"{_KEY}/{current}/successor", str(new))
        return new

    def report(self, executor: Any, since: float, cause: str, exit_after: bool) -> None:
        """Start a round, publish, and (if this rank claims it) join the lines; exit after a
        timeout when ``exit_after``."""
        stalled = cause == "timeout"
        # after a timeout the backend's own error comes at threshold / 0.6: finish before it
        wait_s = min(REPORT_WAIT_SECONDS, self.threshold_s / 6) if stalled else \
            REPORT_WAIT_SECONDS
        earlier = first_failure(wait_seconds=0.0) if exit_after else None
        if earlier is not None:
            # a peer already reported (its round closed before this rank stalled) and left:
            # log this rank's line and the peer's diagnosis, not a graph missing the ranks gone;
            # stay a report window (the store may live in this rank: peers may still report)
            self._state(executor, since)
            line = f"hang ({cause}, reported by rank {self.rank}): after an earlier {earlier}"
            print(f" {line}", flush=True)
            time.sleep(wait_s)
            self._leave()
        round_ = self._round(join=stalled)
        if self._seen_round != round_:
            self._publish(executor, since, round_)
        claimed = self.store.add(f"{_KEY}/{round_}/claim", 1) == 1
        states = self._gather(round_, wait_s)
        line = f"hang ({cause}, reported by rank {self.rank}): " + wait_for_graph(
            states, self.world_size, settled=stalled)
        if stalled and not exit_after:
            line += ("; NCCL's watchdog ends the ranks at the timeout and dumps its flight "
                     "recorder (TORCH_NCCL_DEBUG_INFO_TEMP_FILE, default /tmp/nccl_trace_rank_)")
        if claimed or exit_after:
            print(f" {line}", flush=True)
        if exit_after:
            record_failure(line)
            # leave together: the store may live in one of the ranks (rank 0 without torchrun)
            done = f"{_KEY}/{round_}/done"
            with contextlib.suppress(dist.DistError):  # (unless that rank already left)
                self.store.add(done, 1)
                deadline = time.monotonic() + wait_s
                while time.monotonic() < deadline and self.store.add(done, 0) < len(states):
                    time.sleep(0.2)
            self._leave()

    def _gather(self, round_: int, wait_s: float) -> dict[int, dict[str, Any]]:
        """The lines of round ``round_`` by rank, once every rank published or after
        ``wait_s``; if the store goes away meanwhile (its host, rank 0 without torchrun, left
        on a peer's recorded failure), the lines read before."""
        deadline = time.monotonic() + wait_s
        states: dict[int, dict[str, Any]] = {}
        with contextlib.suppress(dist.DistError):
            while True:
                lines = self.store.get(_states_key(round_)).decode().splitlines()
                states = {s["rank"]: s for s in map(json.loads, lines)}
                if len(states) == self.world_size or time.monotonic() >= deadline:
                    break
                time.sleep(0.2)
        return states

    @staticmethod
    def _leave() -> None:
        """End the process now (the main thread may be blocked in a collective)."""
        from megatron_chimera.errors import exit_process

        exit_process(1, immediate=True)
