"""Megatron-LM's blocking pipeline exchanges in the simulator (schedules/blocking_p2p.py) and
the period of back-to-back iterations without a synchronising step."""

import pytest

from megatron_chimera.config import ConfigError
from megatron_chimera.schedules.actions import BACKWARD, FORWARD, Action
from megatron_chimera.schedules.blocking_p2p import segments
from megatron_chimera.schedules.registry import build_schedule
from megatron_chimera.schedules.simulate import CostModel, simulate
from megatron_chimera.tuning.training_plan import TrainingPlan

COSTS = dict(forward_cost=1.0, backward_cost=2.0, p2p_alpha=0.5)


def starts(result, rank):
    return [(e.kind + str(e.microbatch), e.start) for e in result.events_of_rank(rank)]


def test_a_blocking_exchange_holds_the_sender_until_its_transfer_is_through():
    """1F1B, 2 ranks, 2 micro-batches, F 1, B 2, message 0.5; by hand. Async: the last rank runs
    F0 B0 F1 B1 from 1.5, F1 at 4.5 (its input left rank 0 at 2), makespan 10. Blocking: its
    exchange after B0 sends B0's gradient and receives F1's input, both posted by rank 0 at 2.5,
    so it completes at 4.5 + 0.5 and F1 starts at 5; rank 0's last B waits for the exchange
    after the last rank's B1 (8 + 0.5): makespan 10.5."""
    schedule = build_schedule("1f1b", 2, 2)
    plain = simulate(schedule, CostModel(**COSTS))
    blocking = simulate(schedule, CostModel(**COSTS, p2p_exchange="blocking"))
    assert starts(plain, 1) == [("F0", 1.5), ("B0", 2.5), ("F1", 4.5), ("B1", 5.5)]
    assert starts(blocking, 1) == [("F0", 1.5), ("B0", 2.5), ("F1", 5.0), ("B1", 6.0)]
    assert starts(blocking, 0) == [("F0", 0.0), ("F1", 1.5), ("B0", 5.0), ("B1", 8.5)]
    assert (plain.makespan, blocking.makespan) == (10.0, 10.5)
    # without message time the exchanges cost nothing: the same timeline
    free = simulate(schedule, CostModel(forward_cost=1.0, backward_cost=2.0,
                                        p2p_exchange="blocking"))
    assert free.events == simulate(schedule, CostModel(forward_cost=1.0,
                                                       backward_cost=2.0)).events


def test_interleaved_steady_state_pairs_an_f_with_the_next_b():
    f, b = Action(FORWARD, 0, 1, 0), Action(BACKWARD, 0, 0, 0)
    f2 = Action(FORWARD, 0, 1, 1)
    assert segments([f, b, f2], paired=True) == [[f, b], [f2]]
    assert segments([f, b, f2], paired=False) == [[f], [b], [f2]]
    schedule = build_schedule("interleaved", 4, 8, virtual_pipeline_size=2)
    plain = simulate(schedule, CostModel(**COSTS)).makespan
    paired = simulate(schedule, CostModel(**COSTS, p2p_exchange="blocking-paired")).makespan
    assert paired > plain  # an F's output waits for the B after it, and every send blocks


def test_the_longest_rank_span_is_the_period_without_a_step_barrier():
    result = simulate(build_schedule("1f1b", 2, 2), CostModel(**COSTS))
    # rank 0 runs from 0 to 10, the last rank from 1.5 to 7.5
    assert result.longest_rank_span == pytest.approx(10.0)
    zb = simulate(build_schedule("zb-2p", 4, 16), CostModel(forward_cost=1.0,
                                                           backward_cost=2.0, weight_cost=1.0))
    assert zb.longest_rank_span < zb.makespan  # the last rank's fill is not in its span


def test_a_runtime_runs_only_its_own_schedules():
    with pytest.raises(ConfigError, match="runtime 'megatron' runs the schedules"):
        TrainingPlan("chimera", 4, 1, 1, 4, runtime="megatron")
    with pytest.raises(ConfigError, match="runtime .nemo. is not one of"):
        TrainingPlan("1f1b", 4, 1, 1, 4, runtime="nemo")
    assert TrainingPlan("interleaved", 4, 1, 1, 8, runtime="megatron").p2p_exchange == \
        "blocking-paired"
    assert TrainingPlan("zb-2p", 4, 1, 1, 8, runtime="zb").steps_overlap


def test_blocking_exchanges_refuse_what_megatrons_runtime_does_not_run():
    schedule = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="p2p_exchange must be one of"):
        simulate(schedule, CostModel(p2p_exchange="eager"))
    with pytest.raises(ValueError, match="plain schedules only"):
        simulate(schedule, CostModel(all_to_all_cost=1.0, p2p_exchange="blocking"))
