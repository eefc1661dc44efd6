"""Learning-rate schedule (in samples, Megatron semantics) and loss-scaler state machines."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_chimera.config import ConfigError, OptimizerConfig
from megatron_chimera.optimizer import (
    ConstantGradScaler,
    DynamicGradScaler,
    OptimizerParamScheduler,
)


def sgd():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)


def scheduler(style: str, warmup: int = 100, decay: int = 1000, max_lr=1.0, min_lr=0.1):
    return OptimizerParamScheduler(sgd(), max_lr, min_lr, warmup, decay, style)


def lr_after(sched: OptimizerParamScheduler, samples: int) -> float:
    sched.num_samples = 0
    return sched.step(samples)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_warmup_is_linear_from_zero(style):
    sched = scheduler(style)
    assert lr_after(sched, 0) == 0.0
    assert lr_after(sched, 25) == pytest.approx(0.25)
    assert lr_after(sched, 100) == pytest.approx(1.0)


def test_decay_values_at_chosen_steps():
    linear, cosine, constant = scheduler("linear"), scheduler("cosine"), scheduler("constant")
    # half-way through the decay window [100, 1000]
    assert lr_after(linear, 550) == pytest.approx(0.1 + 0.5 * 0.9)
    assert lr_after(cosine, 550) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi / 2) + 1))
    assert lr_after(cosine, 325) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi / 4) + 1))
    assert lr_after(linear, 1000) == pytest.approx(0.1)
    assert lr_after(linear, 5000) == pytest.approx(0.1)
    assert lr_after(constant, 5000) == pytest.approx(1.0)


def test_steps_count_samples_and_set_every_group():
    optimizer = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]},
                                 {"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=0.0)
    sched = OptimizerParamScheduler(optimizer, 1.0, 0.0, 0, 1000, "linear")
    for _ in range(4):
        sched.step(64)  # global batch of 64 samples per iteration
    assert sched.num_samples == 256
    assert [g["lr"] for g in optimizer.param_groups] == [pytest.approx(1 - 256 / 1000)] * 2


def test_state_dict_resumes_position():
    sched = scheduler("cosine")
    sched.step(300)
    restored = scheduler("cosine")
    restored.load_state_dict(sched.state_dict())
    assert restored.num_samples == 300
    assert restored.step(10) == sched.step(10)


def test_from_config_warmup_fraction_and_defaults():
    config = OptimizerConfig(lr=2.0, min_lr=0.0, lr_decay_style="linear", lr_warmup_fraction=0.1)
    sched = OptimizerParamScheduler.from_config(sgd(), config, train_samples=2000)
    assert (sched.lr_warmup_samples, sched.lr_decay_samples) == (200, 2000)
    config = OptimizerConfig(lr=2.0, lr_decay_samples=500, lr_warmup_samples=50)
    sched = OptimizerParamScheduler.from_config(sgd(), config, train_samples=2000)
    assert (sched.lr_warmup_samples, sched.lr_decay_samples) == (50, 500)


def test_bad_schedule_flags():
    with pytest.raises(ConfigError, match="--lr-decay-style"):
        scheduler("exponential")
    with pytest.raises(ConfigError, match="--min-lr"):
        scheduler("linear", min_lr=2.0)
    with pytest.raises(ConfigError, match="--lr-warmup-samples"):
        scheduler("linear", warmup=1000, decay=1000)


# ----------------------------------------------------------------------------- grad scalers
def test_dynamic_scaler_defaults_growth_hysteresis_backoff_minimum():
    scaler = DynamicGradScaler()
    assert scaler.scale == 2.0**32
    scaler = DynamicGradScaler(initial_scale=16.0, min_scale=2.0, growth_interval=3,
                               hysteresis=2)
    for _ in range(3):
        scaler.update(found_inf=False)
    assert scaler.scale == 32.0  # grew after 3 clean steps
    scaler.update(found_inf=True)
    assert scaler.scale == 32.0  # first overflow absorbed by hysteresis
    scaler.update(found_inf=False)
    scaler.update(found_inf=True)
    assert scaler.scale == 16.0  # second overflow since growth: back off
    scaler.update(found_inf=True)
    assert scaler.scale == 8.0  # hysteresis stays spent until the next growth
    for _ in range(5):
        scaler.update(found_inf=True)
    assert scaler.scale == 2.0  # never below the minimum
    for _ in range(2):
        scaler.update(found_inf=False)
    scaler.update(found_inf=True)  # an overflow resets the growth window
    for _ in range(2):
        scaler.update(found_inf=False)
    assert scaler.scale == 2.0
    scaler.update(found_inf=False)
    assert scaler.scale == 4.0


def test_dynamic_scaler_state_dict_round_trip():
    scaler = DynamicGradScaler(initial_scale=64.0, growth_interval=5, hysteresis=3)
    for found in (False, True, False, False):
        scaler.update(found)
    other = DynamicGradScaler(initial_scale=1.0, min_scale=1.0, growth_interval=5, hysteresis=3)
    other.load_state_dict(scaler.state_dict())
    for found in (False, False, False, True, True, True):
        scaler.update(found)
        other.update(found)
        assert other.scale == scaler.scale
    assert other.state_dict() == scaler.state_dict()


def test_constant_scaler():
    scaler = ConstantGradScaler(128.0)
    scaler.update(found_inf=True)
    assert scaler.scale == 128.0 and scaler.inv_scale == 1 / 128.0
    with pytest.raises(ValueError, match="--hysteresis"):
        DynamicGradScaler(hysteresis=0)
