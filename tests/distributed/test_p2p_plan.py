"""Message plans of the p2p layer (no processes): unique tags, matching send/receive orders."""

from __future__ import annotations

import pytest

from megatron_chimera.pipeline.p2p import (
    needed_message,
    produced_message,
    sends_in_order,
)
from megatron_chimera.schedules import build_schedule

pytestmark = pytest.mark.timeout(30)

SCHEDULES = [
    ("1f1b", 4, 8, {}),
    ("gpipe", 4, 5, {}),
    ("interleaved", 4, 8, {"virtual_pipeline_size": 2}),
    ("chimera", 8, 16, {}),
    ("chimera", 8, 16, {"pipes": 4}),
    ("chimera", 4, 8, {"concat": "direct"}),
    ("chimera-zb", 8, 16, {}),
]


@pytest.mark.parametrize(("name", "d", "n", "options"), SCHEDULES)
def test_every_needed_message_is_sent_once_with_a_unique_tag(name, d, n, options):
    """Each receive of the iteration matches exactly one send; tags never collide."""
    schedule = build_schedule(name, d, n, **options)
    sent = [m for r in range(d) for m in sends_in_order(schedule, r)]
    assert len(sent) == len(set(sent))
    tags = [m.tag(schedule.num_pipes, n) for m in sent]
    assert len(tags) == len(set(tags))
    needed = [needed_message(schedule, a) for acts in schedule.actions for a in acts]
    assert sorted(filter(None, needed), key=repr) == sorted(sent, key=repr)
    for rank, actions in enumerate(schedule.actions):
        for action in actions:
            message = produced_message(schedule, action)
            if message is not None:
                assert message.src == rank


def test_forward_only_plan_has_only_activations():
    """Evaluation sends activations only."""
    schedule = build_schedule("chimera", 4, 8)
    assert all(m.direction == 0 for r in range(4) for m in sends_in_order(schedule, r, True))
