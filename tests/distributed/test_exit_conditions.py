"""The early-exit conditions agree across ranks: a SIGTERM to one rank, or one rank's clock past
``--exit-duration-in-mins``, stops every rank after the same iteration."""

from __future__ import annotations

import os
import signal
import time

import pytest

from megatron_chimera.config import TrainingConfig
from megatron_chimera.training.exit_conditions import ExitCheck, SignalFlag, agreed_start_time

from .harness import spawn_world

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _signal_one_rank(rank: int, world_size: int) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with SignalFlag() as signals:
        exits = ExitCheck(TrainingConfig(exit_signal_handler=True), time.time(), signals)
        reasons = []
        for iteration in range(1, 6):
            if rank == world_size - 1 and iteration == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # only recorded: the rank goes on
                time.sleep(0.1)
            reasons.append(exits.reason(iteration))
            if reasons[-1] is not None:
                break
        assert reasons[:2] == [None, None], reasons
        assert reasons[2:] == ["exiting program after receiving SIGTERM at iteration 3"], reasons
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal while "saving": recorded too
        assert signals.received
    assert signal.getsignal(signal.SIGTERM) == before  # the previous handler is back


def _one_clock_expires(rank: int, world_size: int) -> None:
    start = time.time() - (600.0 if rank == 0 else 0.0)  # rank 0 started 10 minutes earlier
    agreed = agreed_start_time(start, __import__("torch").device("cpu"))
    assert abs(agreed - start) < 1.0 if rank == 0 else agreed < start - 590.0
    exits = ExitCheck(TrainingConfig(exit_duration_in_mins=5.0, exit_interval=2), agreed)
    assert exits.reason(7).startswith("exiting program after 10.0"), exits.reason(7)
    # each rank's own clock (start not agreed): rank 0 alone is past the limit; all stop
    local = ExitCheck(TrainingConfig(exit_duration_in_mins=5.0), start)
    assert local.reason(3).endswith("at iteration 3")
    not_yet = ExitCheck(TrainingConfig(exit_duration_in_mins=60.0, exit_interval=2), agreed)
    assert not_yet.reason(3) is None and not_yet.reason(4) == "exiting program at iteration 4"


def test_sigterm_to_one_rank_stops_all_at_the_same_iteration():
    spawn_world(_signal_one_rank, 3)


def test_wall_clock_is_agreed_across_ranks():
    spawn_world(_one_clock_expires, 2)


def test_exit_interval_alone_needs_no_collective():
    exits = ExitCheck(TrainingConfig(exit_interval=3), time.time())
    assert not exits.collective
    assert [exits.reason(i) for i in (1, 2, 3)] == [None, None, "exiting program at iteration 3"]
