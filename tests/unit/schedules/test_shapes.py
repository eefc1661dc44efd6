"""Micro-batch token counts in the schedule IR: every SEND / RECV carries its size, and the
NCCL checks prove the order with micro-batches of three shapes (no processes)."""

from __future__ import annotations

import pytest

from megatron_chimera.schedules import SCHEDULES, build_schedule
from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.chimera import chimera_backward_halving
from megatron_chimera.schedules.lowering import RECV, SEND, Comm, LoweredSchedule, lower
from megatron_chimera.schedules.shapes import (
    ShapedComm,
    check_shapes,
    check_sized_lists,
    microbatch_tokens,
    shape_lowered,
    validate_shaped,
    with_tokens,
)
from megatron_chimera.schedules.slices import sliced_schedule
from megatron_chimera.schedules.validate import ScheduleError

pytestmark = pytest.mark.timeout(120)

SHAPES = (64, 128, 96)


def _build(case) -> Schedule:
    name, d, n, options = case
    if name == "backward-halving":
        return chimera_backward_halving(d, n)
    if name.startswith("sliced-"):
        return sliced_schedule(name[len("sliced-"):], d, n, 2, attention_fraction=0.4)
    return build_schedule(name, d, n, **options)


CASES = ([(name, d, 2 * d, {}) for name in SCHEDULES for d in (4, 8)]
         + [("chimera", d, 2 * d, {"concat": "forward-doubling"}) for d in (4, 8)]
         + [("chimera", d, d, {}) for d in (4, 8)]  # Chimera's basic unit, N = D
         + [("chimera", 8, 16, {"pipes": 4}), ("backward-halving", 4, 8, {}),
            ("backward-halving", 8, 16, {})]
         + [(f"sliced-{name}", d, 4, {}) for name in ("1f1b", "chimera", "chimera-zb")
            for d in (4, 8)])


def ids(case) -> str:
    name, d, n, options = case
    return f"{name}-D{d}-N{n}" + "".join(f"-{v}" for v in options.values())


def _mixed(schedule: Schedule) -> Schedule:
    return with_tokens(schedule, [SHAPES[m % 3] for m in range(schedule.num_microbatches)])


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_every_schedule_passes_with_three_shapes(case):
    lowered = lower(_mixed(_build(case)))
    shaped = validate_shaped(lowered)
    tokens = microbatch_tokens(lowered.schedule)
    per_channel: dict[tuple[int, int], set[int]] = {}
    for ops in shaped:
        for op in ops:
            assert not isinstance(op, Comm)  # every communication carries its size
            if isinstance(op, ShapedComm):
                assert op.tokens == tokens[op.message.microbatch]
                per_channel.setdefault((op.message.src, op.message.dst), set()).add(op.tokens)
    # the three shapes really travel over the same links
    assert max(len(sizes) for sizes in per_channel.values()) == 3


def test_every_registered_schedule_is_covered():
    assert {name for name, *_ in CASES} >= set(SCHEDULES)


def _swap_two_receive_sizes(shaped):
    """Give two receives of rank 1 from one sender each other's sizes (a buffer of the wrong
    micro-batch's shape)."""
    for ops in shaped[1:]:
        recvs = [i for i, op in enumerate(ops) if isinstance(op, ShapedComm) and op.op == RECV]
        for i in recvs:
            for j in recvs:
                a, b = ops[i], ops[j]
                if a.message.src == b.message.src and a.tokens != b.tokens:
                    ops[i], ops[j] = a._replace(tokens=b.tokens), b._replace(tokens=a.tokens)
                    return a
    raise AssertionError("no two receives of different sizes")


@pytest.mark.parametrize("name", ["1f1b", "chimera", "zbv"])
def test_a_swapped_size_is_refused_naming_the_action(name):
    lowered = lower(_mixed(build_schedule(name, 4, 8)))
    shaped = shape_lowered(lowered)
    check_shapes(lowered, shaped)
    victim = _swap_two_receive_sizes(shaped)
    with pytest.raises(ScheduleError) as error:
        check_shapes(lowered, shaped)
    text = str(error.value)
    assert f"RECV {victim.message.short()}" in text
    assert f"micro-batch {victim.message.microbatch} has {victim.tokens}" in text
    # the consumer of the message is named: the action that would read the wrong buffer
    kind = "F" if victim.message.direction == 0 else "B"
    assert f"for {kind}{victim.message.pipe}." in text


def test_receives_out_of_send_order_are_a_size_mismatch():
    """Two receives from one sender posted in the other order: each has its own size, so only
    the issue-order comparison sees that NCCL would match a 64-token send to a 128-token
    receive."""
    lowered = lower(_mixed(build_schedule("gpipe", 2, 3)))
    ops = lowered.lists[1]
    recvs = [i for i, op in enumerate(ops) if isinstance(op, Comm) and op.op == RECV
             and op.message.direction == 0]
    i, j = recvs[0], recvs[1]
    ops[i], ops[j] = ops[j], ops[i]
    bad = LoweredSchedule(lowered.schedule, lowered.lists, lowered.connections)
    with pytest.raises(ScheduleError, match=r"rank 1 receive 0 from rank 0 \(RECV a0\.0\.1\[128\]"
                                            r"<-0, for F0\.1\.1 .*\) posts 128 tokens but send 0 "
                                            r"\(SEND a0\.0\.0\[64\]->1\) carries 64"):
        check_shapes(bad, shape_lowered(bad))


def test_a_changed_list_is_refused():
    lowered = lower(_mixed(build_schedule("1f1b", 2, 3)))
    shaped = shape_lowered(lowered)
    index = next(i for i, op in enumerate(shaped[0]) if isinstance(op, ShapedComm))
    shaped[0][index] = shaped[0][index]._replace(op=RECV if shaped[0][index].op == SEND
                                                 else SEND)
    with pytest.raises(ScheduleError, match="where the lowered list has"):
        check_shapes(lowered, shaped)


def test_token_counts_are_checked_and_travel_with_the_schedule():
    schedule = build_schedule("chimera", 4, 8)
    with pytest.raises(ScheduleError, match="3 micro-batch token counts for a schedule of 8"):
        with_tokens(schedule, [1, 2, 3])
    with pytest.raises(ScheduleError, match="micro-batch 2 has 0 tokens"):
        with_tokens(schedule, [5, 5, 0, 5, 5, 5, 5, 5])
    with pytest.raises(ScheduleError, match="carries no micro-batch token counts"):
        shape_lowered(lower(schedule))
    shaped = _mixed(schedule)
    assert "microbatch_tokens" not in schedule.meta  # the original is untouched
    again = Schedule.from_json(shaped.to_json())
    assert microbatch_tokens(again) == [SHAPES[m % 3] for m in range(8)]


def test_the_executors_per_iteration_check_takes_the_iterations_tokens():
    lowered = lower(build_schedule("1f1b", 4, 8))
    check_sized_lists(lowered, [3, 7, 5, 3, 7, 5, 3, 7])
    with pytest.raises(ScheduleError, match="7 micro-batch token counts for a schedule of 8"):
        check_sized_lists(lowered, [3] * 7)
