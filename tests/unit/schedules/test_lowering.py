"""Communication lowered into the schedule IR, checked against NCCL's rules (no processes)."""

from __future__ import annotations

import pytest

from megatron_chimera.schedules import SCHEDULES, build_schedule
from megatron_chimera.schedules.actions import FORWARD
from megatron_chimera.schedules.device_sync_check import (
    CollectiveHang,
    check_sync_anywhere,
    gradient_collectives,
    plan_gradient_collectives,
)
from megatron_chimera.schedules.lowering import (
    RECV,
    SEND,
    Comm,
    LoweredSchedule,
    connection_order,
    lower,
    needed_message,
    produced_message,
)
from megatron_chimera.schedules.validate import ScheduleError, validate_lowered

pytestmark = pytest.mark.timeout(120)

CASES = [
    ("gpipe", 4, 5, {}), ("1f1b", 2, 4, {}), ("1f1b", 4, 9, {}), ("1f1b", 8, 17, {}),
    ("interleaved", 4, 8, {"virtual_pipeline_size": 2}),
    ("interleaved", 2, 8, {"virtual_pipeline_size": 4}),
    ("chimera", 2, 4, {}), ("chimera", 4, 4, {}), ("chimera", 4, 8, {}),
    ("chimera", 4, 8, {"concat": "direct"}), ("chimera", 4, 8, {"concat": "forward-doubling"}),
    ("chimera", 8, 16, {}), ("chimera", 8, 16, {"pipes": 4}), ("chimera", 8, 32, {}),
    ("chimera-zb", 4, 8, {}), ("chimera-zb", 8, 16, {"pipes": 4}), ("chimera-zb", 8, 32, {}),
    ("zb-h1", 4, 8, {}), ("zb-h1", 4, 8, {"activation_cap": 2}),
    ("zb-2p", 4, 12, {}), ("zb-2p", 2, 3, {}),
    ("zbv", 4, 8, {}), ("zbv", 4, 3, {}), ("v-half", 4, 8, {}), ("v-half", 8, 16, {}),
    ("bitpipe", 4, 8, {}), ("bitpipe", 2, 4, {}), ("bitpipe-zb", 4, 8, {}),
    ("bitpipe-zb", 8, 16, {"activation_cap": 5}),
    ("dualpipe", 4, 8, {}), ("dualpipev", 4, 8, {}), ("combined-1f1b", 4, 8, {}),
    ("chimera", 4, 8, {"overlap_moe_expert_parallel_comm": True}),
    ("chimera-zb", 4, 8, {"overlap_moe_expert_parallel_comm": True}),  # W pairs too
    ("interleaved", 4, 8, {"overlap_moe_expert_parallel_comm": True}),
]


def ids(case) -> str:
    name, d, n, options = case
    return f"{name}-D{d}-N{n}" + "".join(f"-{v}" for v in options.values())


@pytest.mark.parametrize("case", CASES, ids=ids)
@pytest.mark.parametrize("forward_only", [False, True])
@pytest.mark.parametrize("lookahead", [0, 2, 8])
def test_lowered_lists_keep_nccls_rules(case, forward_only, lookahead):
    """Every schedule lowers into lists that pass the NCCL checks, whatever the lookahead."""
    name, d, n, options = case
    schedule = build_schedule(name, d, n, **options)
    lowered = lower(schedule, forward_only, lookahead)
    validate_lowered(lowered)
    for rank, ops in enumerate(lowered.lists):
        comms = [op for op in ops if isinstance(op, Comm)]
        sends = [op.message for op in comms if op.op == SEND]
        expected = [produced_message(schedule, a) for a in lowered.compute_lists()[rank]]
        assert sends == [m for m in expected if m is not None and m.dst != rank]
        if forward_only:
            assert all(a.kind == FORWARD for a in lowered.compute_lists()[rank])


def test_every_registered_schedule_is_covered():
    assert {name for name, *_ in CASES} == set(SCHEDULES)


@pytest.mark.parametrize("case", CASES[:8], ids=ids)
def test_receives_are_posted_early_only_when_safe(case):
    """A larger lookahead never posts a receive later, and never posts it before the sender
    stops depending on this rank (the validator's sync check would fail otherwise)."""
    name, d, n, options = case
    schedule = build_schedule(name, d, n, **options)

    def positions(lookahead: int) -> dict:
        low = lower(schedule, lookahead=lookahead)
        result = {}
        for ops in low.lists:
            computes = 0
            for op in ops:
                if isinstance(op, Comm):
                    if op.op == RECV:
                        result[op.message] = computes
                else:
                    computes += 1
        return result

    near, far = positions(0), positions(4)
    assert near.keys() == far.keys()
    assert all(far[m] <= near[m] for m in near)
    assert any(far[m] < near[m] for m in near)  # some receives really move ahead
    for ops in lower(schedule, lookahead=0).lists:  # lookahead 0: right before the consumer
        for i, op in enumerate(ops):
            if isinstance(op, Comm) and op.op == RECV:
                later = next(x for x in ops[i + 1:] if not isinstance(x, Comm))
                assert needed_message(schedule, later) == op.message


# The finding: posting receives one or two actions early without asking what the sender
# needs from this rank hangs under NCCL for these; interleaved 1F1B happens to survive.
UNSAFE = [("1f1b", 2, 4, {}), ("1f1b", 4, 8, {}), ("1f1b", 8, 16, {}), ("gpipe", 4, 8, {}),
          ("chimera", 4, 8, {}), ("chimera", 8, 16, {"pipes": 4}), ("chimera-zb", 4, 8, {}),
          ("zb-h1", 4, 8, {})]


@pytest.mark.parametrize("case", UNSAFE, ids=ids)
def test_blind_early_posting_is_caught(case):
    name, d, n, options = case
    lowered = lower(build_schedule(name, d, n, **options), lookahead=2, safe_posting=False)
    with pytest.raises(ScheduleError, match="device-wide sync on rank .* would hang"):
        validate_lowered(lowered)


def test_the_smallest_hang_is_named():
    """1F1B, D=2: rank 0 prefetches B0's gradient before F0 has sent the activation rank 1
    needs to produce it."""
    lowered = lower(build_schedule("1f1b", 2, 4), lookahead=2, safe_posting=False)
    with pytest.raises(ScheduleError) as info:
        validate_lowered(lowered)
    assert "rank 0 before F0.0.0" in str(info.value)
    assert "RECV g0.0.0<-1" in str(info.value)


def test_interleaved_survives_blind_posting_by_luck():
    lowered = lower(build_schedule("interleaved", 4, 8, virtual_pipeline_size=2), lookahead=2,
                    safe_posting=False)
    validate_lowered(lowered)


def _swap_first_two_receives(lowered: LoweredSchedule, rank: int) -> None:
    ops = lowered.lists[rank]
    i, j = [k for k, op in enumerate(ops) if isinstance(op, Comm) and op.op == RECV][:2]
    ops[i], ops[j] = ops[j], ops[i]


def test_fifo_violation_and_missing_pieces_are_caught():
    schedule = build_schedule("gpipe", 2, 4)
    lowered = lower(schedule, lookahead=4)
    _swap_first_two_receives(lowered, 1)
    with pytest.raises(ScheduleError, match="another order than it sends"):
        validate_lowered(lowered)
    lowered = lower(schedule)
    lowered.connections = []
    with pytest.raises(ScheduleError, match="not connected"):
        validate_lowered(lowered)
    lowered = lower(schedule)
    ops = lowered.lists[1]
    first_recv = next(k for k, op in enumerate(ops) if isinstance(op, Comm))
    ops.append(ops.pop(first_recv))  # the receive after its consumer
    with pytest.raises(ScheduleError, match="before the RECV of its input"):
        validate_lowered(lowered)


def test_connections_cover_both_directions_in_one_global_order():
    schedule = build_schedule("chimera", 4, 8)
    train, evaluation = lower(schedule), lower(schedule, forward_only=True)
    order = connection_order(train, evaluation)
    assert set(evaluation.connections) <= set(train.connections) == set(order)
    assert order == sorted(order, key=lambda d: (min(d), max(d), d[0]))
    assert {(0, 1), (1, 0), (1, 2), (2, 1), (2, 3), (3, 2)} == set(order)


def test_local_messages_get_no_communication():
    """Interleaved on one rank: every stage lives there, messages are handed over locally."""
    lowered = lower(build_schedule("interleaved", 1, 2, virtual_pipeline_size=2))
    assert not any(isinstance(op, Comm) for op in lowered.lists[0])
    assert lowered.connections == []
    validate_lowered(lowered)


@pytest.mark.parametrize("case", CASES, ids=ids)
@pytest.mark.parametrize("overlap", [False, True])
def test_gradient_collectives_cannot_hang_a_device_sync(case, overlap):
    """Issue 32's matrix: every schedule family, W in {1, 2} data-parallel replicas and T in
    {1, 2} tensor ranks modelled explicitly, overlapped reduction on and off (the distributed
    optimizer issues its reduce-scatters at the same points): a device-wide sync on any rank at
    any point never waits on a stage-replica or embedding collective that needs its later work."""
    name, d, n, options = case
    schedule = build_schedule(name, d, n, **options)
    lowered = lower(schedule)
    plan = plan_gradient_collectives(lowered, overlap_grad_reduce=overlap)
    assert any(plan.plans), "every schedule reduces some stage over a group"
    # only BitPipe's two V pipes (a stage's replicas on ranks r and D-1-r) ever need a
    # collective deferred to the end of the iteration
    assert not plan.deferred or name.startswith("bitpipe"), plan.deferred
    for data_parallel, tensor_parallel in ((1, 1), (2, 1), (1, 2), (2, 2)):
        check_sync_anywhere(lowered, None, plan.plans, data_parallel, tensor_parallel)


@pytest.mark.parametrize("overlap", [False, True])
def test_collectives_that_could_hang_a_sync_are_deferred_to_the_end(overlap):
    """BitPipe at N = 3D: a rank's last W of stage 7 comes while the other replica (rank 0)
    still needs this rank's later sends to reach its own, so a device sync right after posting
    the reduction would hang. The plan issues stage 7 at the end of the iteration, and with it
    every stage that would hang in its turn (here all of them); then no sync can hang, for W and
    T replicas too."""
    lowered = lower(build_schedule("bitpipe", 4, 12))
    eager = gradient_collectives(lowered.schedule, overlap_grad_reduce=overlap)
    with pytest.raises(CollectiveHang, match=r"reduce\(stage 7\)") as hang:
        check_sync_anywhere(lowered, None, eager)
    assert hang.value.collectives == {"stage 7"}
    plan = plan_gradient_collectives(lowered, overlap_grad_reduce=overlap)
    assert {"stage 6", "stage 7"} <= plan.deferred
    end = len(lowered.schedule.actions[0])
    assert all(p.index == end for p in plan.plans[0])  # rank 0 holds stage 7: all at its end
    for data_parallel, tensor_parallel in ((1, 1), (2, 2)):
        check_sync_anywhere(lowered, None, plan.plans, data_parallel, tensor_parallel)


def test_a_deferred_collective_holds_back_only_itself():
    """BitPipe-ZB at D = 8: the plan defers stages 9-15; a rank's lower stages are reduced
    when their last W is done, before the end of the list, and the deferred ones come last (in
    the global order); the plan passes the sync check."""
    lowered = lower(build_schedule("bitpipe-zb", 8, 16))
    plan = plan_gradient_collectives(lowered)
    assert plan.deferred and "stage 0" not in plan.deferred
    for rank, planned in enumerate(plan.plans):
        end = len(lowered.schedule.actions[rank])
        names = [p.collective.name for p in planned]
        early = [n for n in names if n not in plan.deferred]
        assert names == early + [n for n in names if n in plan.deferred]  # deferred last
        for p in planned:  # the deferred at the end; the others not held back until then
            assert (p.index == end) == (p.collective.name in plan.deferred), (rank, p)
    check_sync_anywhere(lowered, None, plan.plans)


def test_an_embedding_reduction_issued_inside_the_last_backward_is_refused():
    """The hang the collective check found (and the synchronizer now avoids): on the interleaved
    schedule the last rank's final backward of chunk 3 reduces its buckets during the action;
    issuing the tied embedding's reduction right after them, still inside the action, makes a
    device sync there wait for rank 0 -- which needs this very action's gradient first."""
    schedule = build_schedule("interleaved", 4, 8, virtual_pipeline_size=2)
    lowered = lower(schedule)
    plan = gradient_collectives(schedule, overlap_grad_reduce=True)
    check_sync_anywhere(lowered, None, plan)  # as issued: between actions
    inside = []
    for rank_plan in plan:
        stages = [p for p in rank_plan if p.collective.name != "embedding"]
        tied = [stages[-1]._replace(collective=p.collective) for p in rank_plan
                if p.collective.name == "embedding"]
        inside.append(stages + tied)  # embedding issued with the last stage's buckets
    with pytest.raises(ScheduleError, match=r"device-wide sync on rank 3 .*reduce\(embedding\)"):
        check_sync_anywhere(lowered, None, inside)
