"""The gradient synchronizer's issue order: eager, global, and deferred where the plan says."""

from __future__ import annotations

import pytest
from torch import nn

from megatron_chimera.distributed import grad_sync as grad_sync_module
from megatron_chimera.distributed.grad_buffer import build_grad_buffers
from megatron_chimera.distributed.grad_sync import Collectives, GradientSynchronizer


class _Recorded(Collectives):
    """Collectives that only record which group each issued reduction went to."""

    def __init__(self) -> None:
        self.issued: list[str] = []

    def all_reduce(self, tensor, group):  # noqa: D102 (a test double)
        self.issued.append(group)
        return _Done()


class _Done:
    def wait(self) -> None:
        """Nothing to wait for."""


@pytest.fixture
def synchronizer(monkeypatch):
    """Stages 0 and 1 on this rank, each reduced over a (stand-in) group of two."""
    monkeypatch.setattr(grad_sync_module, "_group_size", lambda group: 2)
    buffers = build_grad_buffers({0: nn.Linear(2, 2), 1: nn.Linear(2, 2)},
                                 grad_reduce_in_fp32=False)
    recorded = _Recorded()
    sync = GradientSynchronizer(buffers, {0: "stage 0 group", 1: "stage 1 group"}, None,
                                collectives=recorded)
    return sync, recorded.issued


def test_a_stage_is_reduced_as_soon_as_it_is_done_in_descending_order(synchronizer):
    sync, issued = synchronizer
    sync.start_iteration()
    sync.stage_done(0)
    assert issued == []  # stage 1 comes first in the global order
    sync.stage_done(1)
    assert issued == ["stage 1 group", "stage 0 group"]
    sync.finish()
    assert issued == ["stage 1 group", "stage 0 group"]


def test_a_deferred_stage_and_everything_after_it_wait_for_finish(synchronizer):
    """The collective plan defers stage 1 (its reduction could hang a device sync if issued
    when ready): neither it nor stage 0 after it is issued before the iteration's end."""
    sync, issued = synchronizer
    sync.start_iteration(deferred=frozenset({"stage 1"}))
    sync.stage_done(1)
    sync.stage_done(0)
    assert issued == []
    sync.finish()
    assert issued == ["stage 1 group", "stage 0 group"]
    sync.start_iteration()  # the next iteration's plan defers nothing
    sync.stage_done(1)
    assert issued[2:] == ["stage 1 group"]
