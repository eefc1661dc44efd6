"""health: NaN/Inf in losses or gradients, and the bound on consecutive skipped iterations."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_chimera.errors import UserError
from megatron_chimera.training.arguments import parse_args
from megatron_chimera.training.health import (
    NonFiniteError,
    TrainingStalledError,
    check_loss_and_grad,
    check_skipped,
    local_nonfinite,
)

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 1 --lr 1e-3 --train-iters 2 --mock-data --vocab-size 500").split()


def params(grad: float) -> list[tuple[str, torch.nn.Parameter]]:
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    a.grad, b.grad = torch.ones(3), torch.full((2,), grad)
    return [("a", a), ("b", b)]


def test_finite_everything_passes():
    assert local_nonfinite({0: {"lm loss": 2.0}}, params(1.0), check_grads=True) is None
    check_loss_and_grad(3, {0: {"lm loss": 2.0}}, params(1.0), True, torch.device("cpu"))


def test_nan_loss_names_the_microbatch():
    found = local_nonfinite({0: {"lm loss": 1.0}, 1: {"lm loss": math.nan}}, [], False)
    assert found == "lm loss is nan in micro-batch 1"


@pytest.mark.parametrize("value,word", [(math.nan, "nan"), (math.inf, "inf")])
def test_non_finite_gradient_names_the_parameter(value, word):
    assert local_nonfinite({}, params(value), True) == f"the gradient of b has {word} values"
    assert local_nonfinite({}, params(value), False) is None  # fp16: the loss scaler's business


def test_check_raises_with_iteration_and_rank():
    with pytest.raises(NonFiniteError, match=r"iteration 7: lm loss is inf in micro-batch 0 on "
                                             r"rank 0 \(--check-for-nan-in-loss-and-grad"):
        check_loss_and_grad(7, {0: {"lm loss": math.inf}}, [], True, torch.device("cpu"))
    assert issubclass(NonFiniteError, UserError)


def test_skipped_bound():
    check_skipped(2, 3, 5, 1.0)
    check_skipped(500, 0, 500, 1.0)  # 0: no bound
    with pytest.raises(TrainingStalledError, match=r"iterations 3-5: 3 consecutive iterations "
                                                   r"skipped .*loss scale 1024"):
        check_skipped(3, 3, 5, 1024.0)


def test_flags():
    assert parse_args(BASE).training.check_for_nan_in_loss_and_grad is True
    assert parse_args([*BASE, "--no-check-for-nan-in-loss-and-grad"]).training \
        .check_for_nan_in_loss_and_grad is False
    assert parse_args(BASE).training.max_consecutive_skipped_iterations == 100
    assert parse_args([*BASE, "--max-consecutive-skipped-iterations", "0"]).training \
        .max_consecutive_skipped_iterations == 0


def test_the_grad_norm_stands_in_for_the_search_with_clipping_and_no_scaler():
    from megatron_chimera.config import OptimizerConfig
    from megatron_chimera.training.health import grad_norm_covers_gradients

    assert grad_norm_covers_gradients(OptimizerConfig(clip_grad=1.0))
    assert grad_norm_covers_gradients(OptimizerConfig(clip_grad=1.0, bf16=True))
    assert not grad_norm_covers_gradients(OptimizerConfig(clip_grad=0.0))
    assert not grad_norm_covers_gradients(OptimizerConfig(clip_grad=1.0, fp16=True))


def test_a_nonfinite_grad_norm_is_reported_by_rank_0():
    from megatron_chimera.training.health import raise_nonfinite_grad_norm

    with pytest.raises(NonFiniteError, match=r"iteration 3: the global gradient norm is nan on "
                                             r"rank 0 \(--check-for-nan-in-loss-and-grad"):
        raise_nonfinite_grad_norm(3, float("nan"))
