"""pipeline/trace.py: a traced iteration's gaps between compute actions, split by cause."""

from __future__ import annotations

import pytest

from megatron_chimera.pipeline.trace import (
    END,
    SENT,
    START,
    WAITED,
    Timeline,
    TracingTransport,
    gap_breakdown,
)
from megatron_chimera.schedules.lowering import ACTIVATION, GRADIENT, RECV, SEND, Message

A = Message(ACTIVATION, 0, 0, 0, 0, 1)  # rank 0 -> 1
G = Message(GRADIENT, 0, 0, 0, 1, 0)  # rank 1 -> 0
A1 = Message(ACTIVATION, 0, 1, 0, 0, 1)


def test_a_message_sent_after_the_receivers_compute_is_a_critical_hop():
    """Rank 1 waits from 1.0 for A, which rank 0 posts at 1.5 (0.1 after its compute ends);
    the wait returns at 1.8 and rank 1 computes from 1.85: a hop of 0.3, then 0.05."""
    rank0 = [(START, 0.4), (END, 1.4), (SENT, A, 1.5), (START, 1.6), (END, 2.0)]
    rank1 = [(START, 0.0), (END, 0.9), (WAITED, A, 1.0, 1.8), (START, 1.85), (END, 2.5)]
    gaps = gap_breakdown([rank0, rank1])
    assert gaps.hops == [pytest.approx(0.3)]
    assert gaps.wake_to_start == [pytest.approx(0.05)]
    assert gaps.end_to_send == [pytest.approx(0.1)]
    assert gaps.local_gaps == [pytest.approx(0.2)]  # rank 0: 1.4 -> 1.6, nothing waited for


def test_a_message_sent_during_the_receivers_compute_leaves_a_local_gap():
    """The message was posted before the receiver's compute ended: the whole time is the
    receiver's own."""
    rank0 = [(START, 0.0), (END, 0.5), (SENT, A, 0.6)]
    rank1 = [(START, 0.0), (END, 1.0), (WAITED, A, 1.1, 1.12), (START, 1.2), (END, 2.0)]
    gaps = gap_breakdown([rank0, rank1])
    assert gaps.hops == [] and gaps.wake_to_start == []
    assert gaps.local_gaps == [pytest.approx(0.2)]


def test_the_last_message_waited_for_decides():
    """Two messages before one compute, both posted after the receiver's compute ended: the one
    whose wait returned last is the hop that delayed it (its flight from its own send)."""
    rank0 = [(START, 0.0), (END, 1.0), (SENT, A, 1.2), (SENT, A1, 1.3)]
    rank1 = [(START, 0.0), (END, 1.0), (WAITED, A, 1.1, 1.5), (WAITED, A1, 1.5, 1.9),
             (START, 2.0), (END, 3.0)]
    gaps = gap_breakdown([rank0, rank1])
    assert gaps.hops == [pytest.approx(0.6)] and gaps.wake_to_start == [pytest.approx(0.1)]


def test_the_first_compute_has_no_gap_and_summary_counts():
    """Nothing before a rank's first compute counts; the summary gives count, median, mean."""
    gaps = gap_breakdown([[(WAITED, G, 0.0, 0.5), (START, 0.6), (END, 1.0), (START, 1.1),
                           (END, 2.0), (START, 2.4), (END, 3.0)]])
    assert gaps.hops == [] and gaps.local_gaps == [pytest.approx(0.1), pytest.approx(0.4)]
    summary = gaps.summary()
    assert summary["local_gaps"]["count"] == 2
    assert summary["local_gaps"]["median_ms"] == pytest.approx(250.0)
    assert summary["hops"] == {"count": 0, "median_ms": 0.0, "mean_ms": 0.0}
    assert list(summary) == ["hops", "wake_to_start", "end_to_send", "local_gaps", "computes"]
    assert gaps.computes == [pytest.approx(0.4), pytest.approx(0.9), pytest.approx(0.6)]
    both = gaps.merged(gap_breakdown([[(START, 0.0), (END, 1.0), (START, 1.3), (END, 2.0)]]))
    assert both.local_gaps == [pytest.approx(0.1), pytest.approx(0.4), pytest.approx(0.3)]
    assert both.hops == [] and gaps.local_gaps == [pytest.approx(0.1), pytest.approx(0.4)]


class _Inner:
    """A transport stand-in: records calls, has an attribute the wrapper must pass through."""

    has_sync_points = False

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def post(self, op, messages, tensors):
        self.calls.append(("post", op, tuple(messages)))
        return ["work"] * len(messages)

    def wait(self, work, message):
        self.calls.append(("wait", message))


def test_tracing_transport_records_sends_and_waits_and_delegates():
    inner, timeline = _Inner(), Timeline()
    transport = TracingTransport(inner, timeline)
    assert transport.post(SEND, [A, A1], [None, None]) == ["work", "work"]
    transport.post(RECV, [G], [None])
    transport.wait("work", G)
    timeline.compute_starts()
    timeline.compute_ends()
    assert transport.has_sync_points is False  # passed through
    assert [c[0] for c in inner.calls] == ["post", "post", "wait"]
    kinds = [(e[0], e[1] if e[0] in (SENT, WAITED) else None) for e in timeline.events]
    assert kinds == [(SENT, A), (SENT, A1), (WAITED, G), (START, None), (END, None)]
    waited = timeline.events[2]
    assert waited[2] <= waited[3] <= timeline.events[3][1] <= timeline.events[4][1]


def test_traced_iterations_follow_one_warm_up():
    from megatron_chimera.pipeline.chrome_trace import traced_iterations

    assert traced_iterations(0, 20) == range(2, 4)
    assert traced_iterations(10, 20) == range(12, 14)  # resumed at iteration 10
    assert traced_iterations(0, 2) == range(1, 3)  # too short for a warm-up
    assert traced_iterations(0, 1) == range(1, 2)


def test_wait_for_graph_names_the_stopped_rank_and_a_cycle():
    from megatron_chimera.pipeline.hang import wait_for_graph

    def state(rank, waits_for, doing="waits for a0.1.2.3"):
        return {"rank": rank, "waits_for": waits_for, "line": f"rank {rank}: {doing}"}

    # rank 2 stopped: 1 and 3 wait for it, 0 waits for 1
    line = wait_for_graph({0: state(0, 1), 1: state(1, 2), 3: state(3, 2)}, 4)
    assert "0->1, 1->2, 3->2" in line
    assert "rank 2 did not report (stopped" in line and "ranks [0, 1, 3] wait for it" in line
    # a rank stuck in compute is named with what it runs
    line = wait_for_graph({0: state(0, 1), 1: state(1, None, "runs B0.1.2 for 70 s")}, 2)
    assert "rank 1 is not waiting for a message: runs B0.1.2 for 70 s; ranks [0]" in line
    # ranks in a collective wait for the silent rank
    line = wait_for_graph({0: dict(state(0, None, "in the loss gather"), collective=True),
                           1: dict(state(1, None, "in the loss gather"), collective=True)}, 3)
    assert "0->2, 1->2: rank 2 did not report" in line
    line = wait_for_graph({0: state(0, 1), 1: state(1, 0)}, 2)
    assert "cycle 0 -> 1 -> 0 (a deadlock)" in line
    # on demand the lines are taken while the ranks move: a cycle is a deadlock only if it lasts
    line = wait_for_graph({0: state(0, 1), 1: state(1, 0)}, 2, settled=False)
    assert "cycle 0 -> 1 -> 0 (a deadlock if it lasts" in line


def test_a_rank_that_stalls_after_its_peers_left_repeats_their_diagnosis(monkeypatch, capsys):
    """A rank whose stall starts after the peers' timeout round closed (they reported and left)
    logs its own line and their graph, not a new graph where the ranks gone look stopped."""
    from megatron_chimera.pipeline import hang

    class Left(Exception):
        pass

    def leave():
        raise Left

    earlier = "hang (timeout, reported by rank 1): wait-for graph 1->2: rank 2 did not report"
    monkeypatch.setattr(hang, "first_failure", lambda wait_seconds: earlier)
    watch = object.__new__(hang.HangWatch)
    watch.rank, watch.section, watch._leave, watch.threshold_s = 0, "training step", leave, 0.6
    watch._round = lambda join: pytest.fail("a new round after the peers left")
    with pytest.raises(Left):
        watch.report(None, 0.0, "timeout", exit_after=True)
    out = capsys.readouterr().out
    assert " hang report: rank 0: not training" in out
    assert f"hang (timeout, reported by rank 0): after an earlier {earlier}" in out
    # on demand (SIGUSR1) a recorded failure is not looked at: the round runs as usual
    monkeypatch.setattr(hang, "first_failure", lambda wait_seconds: pytest.fail("looked"))
    with pytest.raises(pytest.fail.Exception, match="a new round"):
        watch.report(None, 0.0, "SIGUSR1", exit_after=False)


def test_ranks_timing_out_together_report_in_one_round():
    """Two ranks that both find the last round stale and want a new one at the same moment
    (each read the round counter before either advanced it) get the same new round."""
    import threading

    import torch.distributed as dist

    from megatron_chimera.pipeline import hang

    store = dist.HashStore()
    both_read = threading.Barrier(2)

    class RaceStore:  # each rank reads the counter, then waits for the other to read it too
        def add(self, key, value):
            result = store.add(key, value)
            if key == f"{hang._KEY}/round" and value == 0:
                both_read.wait(timeout=10)
            return result

        def __getattr__(self, name):
            return getattr(store, name)

    store.add(f"{hang._KEY}/round", 1)  # an old round (an on-demand report long ago)
    store.set(f"{hang._KEY}/1/started", "0")
    rounds = []

    def timed_out():
        watch = object.__new__(hang.HangWatch)
        watch.store, watch.threshold_s = RaceStore(), 18.0
        rounds.append(watch._round(join=True))

    threads = [threading.Thread(target=timed_out) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert rounds == [2, 2] and store.add(f"{hang._KEY}/round", 0) == 2


def test_a_report_keeps_the_lines_read_before_the_store_went_away():
    """The store's host (rank 0 without torchrun) may leave mid-report: the reporting rank
    joins the lines it read before instead of failing without a graph."""
    import json

    import torch.distributed as dist

    from megatron_chimera.pipeline import hang

    lines = "".join(json.dumps({"rank": r, "waits_for": 2, "line": f"rank {r}: waits"}) + "\n"
                    for r in (0, 1, 3))
    reads = []

    class LeavingStore:
        def get(self, key):
            reads.append(key)
            if len(reads) > 1:
                raise dist.DistNetworkError("Connection was likely closed")
            return lines.encode()

    watch = object.__new__(hang.HangWatch)
    watch.store, watch.world_size = LeavingStore(), 4
    states = watch._gather(7, wait_s=5.0)
    assert sorted(states) == [0, 1, 3] and reads[0] == hang._states_key(7)
    assert "rank 2 did not report" in hang.wait_for_graph(states, 4)


def test_the_flight_recorder_line_names_the_oldest_unfinished_nccl_operation():
    """On NCCL a rank's hang line names what the flight recorder holds unfinished: the oldest
    entry (by creation time) that is not completed, its group, kind and sequence number."""
    from megatron_chimera.pipeline.hang import flight_recorder_line, summarize_flight_record

    def entry(record, name, state, created, p2p=False):
        return {"record_id": record, "profiling_name": name, "state": state,
                "time_created_ns": created, "process_group": ["3", "stage-replica"],
                "collective_seq_id": 40 + record, "p2p_seq_id": 7 + record, "is_p2p": p2p,
                "input_sizes": [[1024]]}

    record = {"entries": [entry(0, "nccl:all_reduce", "completed", 1),
                          entry(1, "nccl:recv 2<-1", "started", 5, p2p=True),
                          entry(2, "nccl:all_reduce", "scheduled", 9)]}
    line = summarize_flight_record(record)
    assert line == ("NCCL flight recorder: oldest unfinished nccl:recv 2<-1 (group "
                    "3:stage-replica, p2p seq 8, started, input sizes [[1024]]; 2 unfinished)")
    record["entries"][1]["state"] = "completed"
    assert "nccl:all_reduce (group 3:stage-replica, collective seq 42, scheduled" in \
        summarize_flight_record(record)
    assert summarize_flight_record({"entries": record["entries"][:2]}) is None
    assert summarize_flight_record({"version": "2.10"}) is None
    assert flight_recorder_line() is None  # this process holds no NCCL work


def test_stopping_the_hang_watch_joins_its_thread_before_the_rank_leaves():
    """``stop`` waits for the watch thread: a daemon thread still dropping its last reference
    to the model while the interpreter finalizes aborted one run in ten at exit
    ("terminate called without an active exception"). The rank is marked left after."""
    import threading
    import time

    import torch.distributed as dist

    from megatron_chimera.pipeline import failures, hang

    store, order = dist.HashStore(), []
    watch = object.__new__(hang.HangWatch)
    watch.rank, watch.store, watch._stop = 3, store, threading.Event()

    def loop():
        watch._stop.wait()
        time.sleep(0.3)  # the last poll's work, then the thread drops its references
        order.append("thread ended")

    watch._thread = threading.Thread(target=loop, daemon=True)
    watch._thread.start()
    watch.stop()
    assert not watch._thread.is_alive() and order == ["thread ended"]
    assert store.get(f"{failures._LEFT}/3") == b"1"
