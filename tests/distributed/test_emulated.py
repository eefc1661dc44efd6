"""Emulated-compute stages: each action waits the configured time (single process).

``time.sleep`` is replaced by a recorder, so the tests check which waits each action requests
without depending on the machine's load.
"""

from __future__ import annotations

import pytest
import torch

from megatron_chimera.model.linear import defer_weight_grad
from megatron_chimera.pipeline import emulated
from megatron_chimera.pipeline.emulated import (
    EmulatedCosts,
    EmulatedStage,
    EmulatedTorchStage,
    SleepingWeightGradStore,
)

pytestmark = pytest.mark.timeout(30)
COSTS = EmulatedCosts(forward_s=0.02, backward_s=0.06, weight_s=0.04)


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """The durations the emulated modules asked to sleep, in order."""
    recorded: list[float] = []
    monkeypatch.setattr(emulated.time, "sleep", recorded.append)
    return recorded


def test_forward_and_full_backward_wait_their_times(sleeps):
    """F waits forward_s; an ordinary backward waits the whole backward_s."""
    stage = EmulatedStage(COSTS, pre_process=True, post_process=True)
    out = stage(torch.randn(3, 2, 4))
    assert sleeps == [COSTS.forward_s]
    out.mean().backward()
    assert sleeps == [COSTS.forward_s, COSTS.backward_s]
    assert stage.linear.weight.grad is not None


def test_split_backward_waits_input_then_weight_time(sleeps):
    """Under defer_weight_grad B waits backward - weight; the store's flush (W) waits weight_s."""
    stage = EmulatedStage(COSTS, pre_process=True, post_process=True)
    store = SleepingWeightGradStore()
    out = stage(torch.randn(3, 2, 4))
    with defer_weight_grad(stage, store):
        out.mean().backward()
    assert sleeps[1:] == [pytest.approx(COSTS.input_grad_s)]
    assert stage.linear.weight.grad is None and len(store) == 1
    store.flush()
    assert sleeps[2:] == [COSTS.weight_s]
    assert stage.linear.weight.grad is not None


def test_torch_stage_separates_input_and_weight_gradients(sleeps):
    """Input gradient alone waits input_grad_s; the weight branch alone waits weight_s."""
    stage = EmulatedTorchStage(COSTS, is_first=False)
    x = torch.randn(2, 3, 4, requires_grad=True)
    out = stage(x)
    torch.autograd.grad(out.sum(), x, retain_graph=True)
    assert sleeps[1:] == [pytest.approx(COSTS.input_grad_s)]
    torch.autograd.grad(out.sum(), stage.weight)
    assert sleeps[2:] == [COSTS.weight_s]


def test_first_torch_stage_backward_still_waits(sleeps):
    """Stage 0's input needs no gradient; its full backward still waits the whole backward."""
    stage = EmulatedTorchStage(COSTS, is_first=True)
    stage(torch.randn(2, 3, 4)).sum().backward()
    assert sorted(sleeps[1:]) == pytest.approx(sorted([COSTS.input_grad_s, COSTS.weight_s]))


def test_weight_time_cannot_exceed_backward():
    """W is part of the backward: a larger --weight-ms is rejected by name."""
    with pytest.raises(ValueError, match="--weight-ms"):
        EmulatedCosts(0.01, 0.01, 0.02)
