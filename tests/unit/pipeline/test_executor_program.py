"""The executor's compiled program (pipeline/program.py): batches keep the lowered order and
peers, every receive buffer is released exactly once and only after its last reader, and the
gradient synchronizer hears of each stage once."""

from __future__ import annotations

import pytest

from megatron_chimera.pipeline.program import Compute, Paired, Post, compile_program
from megatron_chimera.schedules import build_schedule
from megatron_chimera.schedules.actions import BACKWARD, FORWARD, WEIGHT
from megatron_chimera.schedules.lowering import RECV, SEND, Comm, lower
from tests.helpers.schedules import with_weight_actions

pytestmark = pytest.mark.timeout(60)

CASES = [
    ("1f1b", 4, 8, {}, None),
    ("gpipe", 4, 5, {}, None),
    ("interleaved", 4, 8, {"virtual_pipeline_size": 2}, None),
    ("chimera", 4, 8, {}, None),
    ("chimera", 8, 16, {"pipes": 4}, None),
    ("chimera", 4, 8, {"concat": "direct"}, 3),
    ("zb-h1", 4, 8, {}, None),
    ("chimera-zb", 8, 16, {}, None),
    ("1f1b", 2, 4, {}, 1),
]


def _schedule(name, d, n, options, split_delay):
    schedule = build_schedule(name, d, n, **options)
    return with_weight_actions(schedule, split_delay) if split_delay is not None else schedule


@pytest.mark.parametrize("name,d,n,options,split_delay", CASES)
@pytest.mark.parametrize("forward_only", [False, True])
def test_batches_keep_the_lowered_order_and_one_peer(name, d, n, options, split_delay,
                                                     forward_only):
    """Flattening the program gives the lowered list back; a batch never mixes kinds or peers
    and never spans a compute action."""
    lowered = lower(_schedule(name, d, n, options, split_delay), forward_only)
    for rank in range(d):
        program = compile_program(lowered, rank)
        flat = []
        for step in program.steps:
            if isinstance(step, Post):
                peers = {m.src if step.op == RECV else m.dst for m in step.messages}
                assert len(peers) == 1, step
                flat += [Comm(step.op, m) for m in step.messages]
            else:
                flat.append(step.action)
        assert flat == lowered.lists[rank]


@pytest.mark.parametrize("name,d,n,options,split_delay", CASES)
def test_receive_buffers_are_released_once_after_their_last_reader(name, d, n, options,
                                                                   split_delay):
    """In training every received message is released exactly once, at the last action of its
    (pipe, stage, micro-batch) on this rank -- W when the backward is split (its store may hold
    the input and the output gradient), else B -- which comes after the message's consumer."""
    schedule = _schedule(name, d, n, options, split_delay)
    lowered = lower(schedule)
    last_kind = WEIGHT if schedule.split_backward else BACKWARD
    for rank in range(d):
        program = compile_program(lowered, rank)
        steps = list(program.computes())
        received = [op.message for op in lowered.comms(rank) if op.op == RECV]
        consumed_at = {s.needs: i for i, s in enumerate(steps) if s.needs in set(received)}
        released = [(m, i) for i, s in enumerate(steps) for m in s.releases]
        assert sorted(m for m, _ in released) == sorted(received)
        for message, i in released:
            assert steps[i].action.kind == last_kind
            assert steps[i].key == (message.pipe, message.stage + (message.direction == 0),
                                    message.microbatch)
            assert i >= consumed_at[message]
        for step in steps:
            assert step.label == step.action.short()
            assert step.local == (step.produces is not None and step.produces.dst == rank)


@pytest.mark.parametrize("name,d,n,options,split_delay", CASES[:4])
def test_forward_only_releases_nothing_early(name, d, n, options, split_delay):
    """Evaluation gives its buffers back when the iteration ends (nothing reads them twice, but
    a sent output may still be a view of one)."""
    lowered = lower(_schedule(name, d, n, options, split_delay), forward_only=True)
    for rank in range(d):
        program = compile_program(lowered, rank)
        assert program.forward_only
        assert all(not s.releases and s.final_stage is None for s in program.computes())
        assert all(s.action.kind == FORWARD for s in program.computes())


@pytest.mark.parametrize("name,d,n,options,split_delay", CASES)
def test_each_stage_is_final_once_at_its_last_gradient_action(name, d, n, options, split_delay):
    """The synchronizer hears ``stage_done`` once per stage, after the stage's last B (W)."""
    schedule = _schedule(name, d, n, options, split_delay)
    kind = WEIGHT if schedule.split_backward else BACKWARD
    for rank in range(d):
        steps = list(compile_program(lower(schedule), rank).computes())
        finals = [(i, s.final_stage) for i, s in enumerate(steps) if s.final_stage is not None]
        assert sorted(stage for _, stage in finals) == sorted(schedule.stages_of_rank(rank))
        for i, stage in finals:
            assert steps[i].action.kind == kind and steps[i].action.stage == stage
            assert not any(s.action.kind == kind and s.action.stage == stage
                           for s in steps[i + 1:])


def test_sends_follow_their_producer_alone():
    """A SEND batch holds the one message of the action just before it."""
    lowered = lower(build_schedule("chimera", 4, 8))
    for rank in range(4):
        steps = compile_program(lowered, rank).steps
        for before, step in zip(steps, steps[1:]):
            if isinstance(step, Post) and step.op == SEND:
                assert isinstance(before, Compute) and step.messages == (before.produces,)


@pytest.mark.parametrize("name,d,n,options", [
    ("chimera", 4, 8, {"overlap_moe_expert_parallel_comm": True}),
    ("chimera-zb", 4, 8, {"overlap_moe_expert_parallel_comm": True}),
    ("dualpipe", 4, 8, {}),
    ("combined-1f1b", 4, 8, {}),
])
def test_a_pair_compiles_into_one_step(name, d, n, options):
    """Each pair of ``Schedule.pairs`` is one Paired step of its two neighbouring actions, and
    the computes (pairs' halves included) are the rank's list in order."""
    schedule = build_schedule(name, d, n, **options)
    lowered = lower(schedule)
    for rank in range(d):
        program = compile_program(lowered, rank)
        paired = [s for s in program.steps if isinstance(s, Paired)]
        assert len(paired) == len(schedule.pairs[rank]) > 0
        actions = schedule.actions[rank]
        assert [(s.first.action, s.second.action) for s in paired] == [
            (actions[i], actions[i + 1]) for i in schedule.pairs[rank]]
        assert [c.action for c in program.computes()] == list(actions)
