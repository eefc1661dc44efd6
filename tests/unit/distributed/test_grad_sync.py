"""The gradient synchronizer's issue order: eager, global, and deferred where the plan says."""

from __future__ import annotations

import pytest
import torch
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


def test_a_deferred_stage_waits_for_finish_and_holds_back_nothing_else(synchronizer):
    """The collective plan defers stage 1 (its reduction could hang a device sync if issued
    when ready): it is issued at the iteration's end, after every other collective; stage 0,
    after it in the global order, goes as soon as it is done."""
    sync, issued = synchronizer
    sync.start_iteration(deferred=frozenset({"stage 1"}))
    sync.stage_done(1)
    assert issued == []
    sync.stage_done(0)
    assert issued == ["stage 0 group"]
    sync.finish()
    assert issued == ["stage 0 group", "stage 1 group"]
    sync.start_iteration()  # the next iteration's plan defers nothing
    sync.stage_done(0)
    assert issued[2:] == []  # stage 1 comes first again
    sync.stage_done(1)
    assert issued[2:] == ["stage 1 group", "stage 0 group"]


def test_finish_issues_the_rest_in_order_then_the_deferred(synchronizer):
    """Nothing done before the end: ``finish`` issues the stages in the global order with the
    deferred one last -- the order every rank of a group follows."""
    sync, issued = synchronizer
    sync.start_iteration(deferred=frozenset({"stage 1"}))
    sync.finish()
    assert issued == ["stage 0 group", "stage 1 group"]


class _StageWithEmbedding(nn.Module):
    """A stage holding a copy of the tied word embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(2, 2)
        self.embedding = nn.Parameter(torch.zeros(3, 2))

    def shared_embedding_or_output_weight(self) -> nn.Parameter:
        return self.embedding


def test_the_embedding_waits_for_every_stage_of_the_rank_even_past_a_deferred_one(monkeypatch):
    """Stages 2 (deferred) and 1 and 0 (with the embedding) on this rank: the embedding's
    reduction follows the rank's last final backward (the plan's model), not only the last of
    the stages holding a copy -- once a deferred stage no longer holds back the order, nothing
    else would."""
    monkeypatch.setattr(grad_sync_module, "_group_size", lambda group: 2)
    buffers = build_grad_buffers({0: _StageWithEmbedding(), 1: nn.Linear(2, 2),
                                  2: nn.Linear(2, 2)}, grad_reduce_in_fp32=False)
    recorded = _Recorded()
    sync = GradientSynchronizer(buffers, {s: f"stage {s} group" for s in range(3)},
                                "embedding group", collectives=recorded)
    sync.start_iteration(deferred=frozenset({"stage 2"}))
    sync.stage_done(1)
    sync.stage_done(0)
    assert recorded.issued == ["stage 1 group", "stage 0 group"]  # stage 2 is not done yet
    sync.stage_done(2)
    assert recorded.issued[2:] == ["embedding group"]
    sync.finish()
    assert recorded.issued[3:] == ["stage 2 group"]
