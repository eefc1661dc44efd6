"""The straggler detector names a 30%-slow rank within 5 log intervals and stays silent on
noise like this 2-core machine's (timings of 8 time-shared ranks)."""

from __future__ import annotations

import random

from megatron_chimera.schedules.registry import build_schedule
from megatron_chimera.training.straggler import (
    StragglerDetector,
    expected_busy_by_kind,
    expected_busy_per_rank,
    stages_held,
)

RANKS, ITERS_PER_INTERVAL = 8, 5
# Chimera D=4 x W=2 (global rank r at pipeline rank r // 2): pipeline ranks 0 and 3 hold stages
# 0 and 3, with the embedding, output layer and loss the cost model does not price
EDGES, EDGE_EXTRA = {0, 1, 6, 7}, 1.12


def noisy(rng: random.Random, expected: list[float], slow: dict[int, float]) -> list[float]:
    # each rank: its predicted time x what the model misses at its stages x a machine-wide
    # factor x its own jitter (sd 8%, with a 5% chance of a 40% hiccup: a time-shared core),
    # x its slowdown
    shared = rng.uniform(0.7, 1.4)
    return [e * (EDGE_EXTRA if r in EDGES else 1.0) * shared * max(0.5, rng.gauss(1.0, 0.08))
            * (1.4 if rng.random() < 0.05 else 1.0) * slow.get(r, 1.0)
            for r, e in enumerate(expected)]


def test_a_30_percent_slow_rank_is_named_within_5_intervals_and_clean_runs_stay_silent():
    schedule = build_schedule("chimera", num_ranks=4, num_microbatches=8)
    pipeline_rank_of = [r // 2 for r in range(RANKS)]
    expected = expected_busy_per_rank(schedule, [1.0] * 4, pipeline_rank_of)
    held = stages_held(schedule, pipeline_rank_of)
    assert held[0] == held[6] == (0, 3) and held[2] == held[5] == (1, 2)
    for seed in range(5):
        rng = random.Random(seed)
        clean = StragglerDetector(expected, positions=held)
        edges = []
        for _ in range(200 // ITERS_PER_INTERVAL):
            interval = [noisy(rng, expected, {}) for _ in range(ITERS_PER_INTERVAL)]
            assert clean.observe(interval) is None, (seed, clean.last)
            edges += [clean.last[r] for r in EDGES]
        # compared with the ranks holding the same stages, the edges' extra work cancels
        # (against every rank of equal predicted work they would read about +12%)
        assert abs(sum(edges) / len(edges) - 1.0) < 0.03, (seed, sum(edges) / len(edges))
        slow = StragglerDetector(expected, positions=held)
        lines = [slow.observe([noisy(rng, expected, {5: 1.3}) for _ in range(ITERS_PER_INTERVAL)])
                 for _ in range(5)]
        named = [line for line in lines if line]
        assert len(named) == 1 and named[0].startswith(" straggler: rank 5 (+"), lines


def test_expected_busy_follows_the_stage_costs():
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
    busy = expected_busy_per_rank(schedule, [1.0, 3.0], [0, 1])
    assert busy == [4 * 3.0, 4 * 9.0]  # 4 micro-batches of F + B (B = 2 F) per stage


def test_the_line_names_the_action_kinds_that_run_slow():
    # two replicas of a 2-stage 1F1B; rank 2's backwards run 50% slow, its forwards do not
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
    kinds = expected_busy_by_kind(schedule, [1.0, 1.0], [0, 1, 0, 1])
    assert kinds[0] == {"F": 4.0, "B": 8.0}
    measured = [{k: v * (1.5 if r == 2 and k == "B" else 1.0) for k, v in kinds[r].items()}
                for r in range(4)]
    detector = StragglerDetector([sum(k.values()) for k in kinds], patience=1,
                                 expected_kinds=kinds)
    line = detector.observe([[sum(m.values()) for m in measured]] * 3, [measured] * 3)
    assert line is not None and line.startswith(" straggler: rank 2 (+33%; per action B +50%, "
                                                "F +0%) slower than its peers"), line


def test_without_log_straggler_the_busy_timer_reads_no_cpu_clock(monkeypatch):
    # the per-kind CPU timing is --log-straggler's cost: off, the thread's clock is never read
    import torch

    from megatron_chimera.pipeline import busy_timer
    from megatron_chimera.schedules.actions import Action

    forward = Action("F", 0, 0, 0)
    timed = busy_timer.BusyTimer(torch.device("cpu"), [])
    with timed(forward):
        pass
    assert timed.total() >= 0 and set(timed.by_kind) == {"F"}

    def no_clock() -> float:
        raise AssertionError("thread_time read with kinds=False")

    monkeypatch.setattr(busy_timer.time, "thread_time", no_clock)
    untimed = busy_timer.BusyTimer(torch.device("cpu"), [], kinds=False)
    with untimed(forward):
        pass
    assert untimed.total() >= 0 and untimed.by_kind == {}
