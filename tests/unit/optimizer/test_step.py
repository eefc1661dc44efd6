"""MegatronOptimizer: fp32 main params, found-inf skip, global-norm clipping, groups, state."""

from __future__ import annotations

import math
import os
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from megatron_chimera.config import ConfigError, OptimizerConfig
from megatron_chimera.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    get_megatron_optimizer,
)


class Tiny(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.dense = nn.Linear(4, 3, dtype=dtype)
        self.norm = nn.LayerNorm(3, dtype=dtype)
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            self.dense.weight.copy_(torch.randn(3, 4, generator=g))
            self.dense.bias.copy_(torch.randn(3, generator=g))


def set_grads(model: nn.Module, value_fn) -> None:
    for i, p in enumerate(model.parameters()):
        p.grad = value_fn(i, p).to(p.dtype)


def test_weight_decay_groups_exclude_biases_and_norms():
    opt = get_megatron_optimizer(OptimizerConfig(weight_decay=0.1), [Tiny()])
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [p.shape for p in decay["params"]] == [(3, 4)]
    assert len(no_decay["params"]) == 3  # dense.bias, norm.weight, norm.bias


@pytest.mark.parametrize("dtype,flag", [(torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_16bit_step_matches_fp32_adamw_on_main_params(dtype, flag):
    model = Tiny(dtype)
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0, loss_scale=1.0,
                             **{flag: True})
    opt = get_megatron_optimizer(config, [model])
    assert isinstance(opt, Float16OptimizerWithFloat16Params)
    reference_params = [nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    ref = torch.optim.AdamW([{"params": [reference_params[0]], "weight_decay": 0.1},
                             {"params": reference_params[1:], "weight_decay": 0.0}],
                            lr=1e-2, foreach=False)
    for step in range(3):
        set_grads(model, lambda i, p, k=step: torch.full(p.shape, 0.5 * (i + 1) * (k + 1)))
        for r, p in zip(reference_params, model.parameters()):
            r.grad = p.grad.float()
        ok, norm, zeros = opt.step()
        ref.step()
        assert ok and norm is None and zeros is None
    for main, r, p in zip(opt.main_params, reference_params, model.parameters()):
        assert main.dtype == torch.float32
        torch.testing.assert_close(main, r, rtol=1e-6, atol=1e-7)
        assert torch.equal(p, main.to(dtype))  # the model holds the rounded main params


def test_fp16_overflow_skips_step_on_hysteresis_then_backs_off():
    model = Tiny(torch.float16)
    opt = get_megatron_optimizer(OptimizerConfig(fp16=True, initial_loss_scale=1024.0,
                                                 hysteresis=2), [model])
    before = [p.detach().clone() for p in model.parameters()]
    for expected_scale in (1024.0, 512.0):
        set_grads(model, lambda i, p: torch.full(p.shape, float("inf") if i == 1 else 1.0))
        assert opt.step() == (False, None, None)
        assert opt.get_loss_scale() == expected_scale
    assert opt.skipped_steps == 2
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # a clean step unscales by 1/scale before the update
    set_grads(model, lambda i, p: torch.full(p.shape, 512.0))
    ok, norm, _ = opt.step()
    n = sum(p.numel() for p in model.parameters())
    assert ok and norm == pytest.approx(math.sqrt(n))  # unscaled grads are all 1
    assert opt.scale_loss(torch.tensor(2.0)).item() == 1024.0


def test_non_finite_norm_skips_bf16_step():
    model = Tiny(torch.bfloat16)
    opt = get_megatron_optimizer(OptimizerConfig(bf16=True, clip_grad=1.0), [model])
    before = [p.detach().clone() for p in model.parameters()]
    set_grads(model, lambda i, p: torch.full(p.shape, float("nan") if i == 0 else 1.0))
    ok, norm, _ = opt.step()
    assert not ok and math.isnan(norm) and opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_clipping_with_known_norm_and_filter():
    model = Tiny()
    # count only the weight matrix in the norm (e.g. the other params are a replica counted
    # elsewhere); clipping still scales every gradient
    weight = model.dense.weight
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.0, sgd_momentum=0.0,
                                                 clip_grad=1.0), [model],
                                 norm_param_filter=lambda p: p is weight,
                                 log_num_zeros_in_grad=True)
    assert isinstance(opt, FP32Optimizer)
    set_grads(model, lambda i, p: torch.full(p.shape, 2.0))
    weight.grad[0, 0] = 0.0
    ok, norm, zeros = opt.step()
    expected = math.sqrt(11 * 4.0)
    assert ok and norm == pytest.approx(expected) and zeros == 1
    coeff = 1.0 / (expected + 1e-6)
    torch.testing.assert_close(model.dense.bias.grad, torch.full((3,), 2.0 * coeff))
    # below the threshold nothing is scaled
    set_grads(model, lambda i, p: torch.full(p.shape, 0.01))
    opt.step()
    assert torch.all(model.norm.bias.grad == 0.01)


def test_state_dict_round_trip_continues_identically():
    config = OptimizerConfig(lr=1e-2, bf16=True, clip_grad=1.0)
    models = [Tiny(torch.bfloat16), Tiny(torch.bfloat16)]
    opts = [get_megatron_optimizer(config, [m]) for m in models]
    grad = lambda step: (lambda i, p: torch.full(p.shape, 0.1 * (i + step + 1)))  # noqa: E731
    set_grads(models[0], grad(0))
    opts[0].step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "opt.pt")
        torch.save(opts[0].state_dict(), path)
        state = torch.load(path, weights_only=True)
    models[1].load_state_dict(models[0].state_dict())
    opts[1].load_state_dict(state)
    for step in (1, 2):
        for m, o in zip(models, opts):
            set_grads(m, grad(step))
            o.step()
    for a, b in zip(opts[0].main_params, opts[1].main_params):
        assert torch.equal(a, b)


def test_zero_grad_and_config_errors():
    model = Tiny(torch.bfloat16)
    opt = get_megatron_optimizer(OptimizerConfig(bf16=True), [model])
    set_grads(model, lambda i, p: torch.ones(p.shape))
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is None for p in opt.main_params)
    assert opt.get_loss_scale() == 1.0
    with pytest.raises(ConfigError, match="--bf16"):
        get_megatron_optimizer(OptimizerConfig(), [Tiny(torch.bfloat16)])
    with pytest.raises(ConfigError, match="--fp16"):
        get_megatron_optimizer(OptimizerConfig(fp16=True), [Tiny(torch.bfloat16)])
    with pytest.raises(ConfigError, match="--optimizer"):
        get_megatron_optimizer(OptimizerConfig(optimizer="lamb"), [Tiny()])


# ----------------------------------------------------------------------------- process groups
def _worker(rank: int, world: int, init_file: str, results) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=30))
        group = dist.new_group([0, 1], timeout=timedelta(seconds=30))
        model = Tiny(torch.float16)
        opt = get_megatron_optimizer(
            OptimizerConfig(fp16=True, loss_scale=1.0, clip_grad=100.0), [model],
            grad_norm_group=group, found_inf_group=group)
        # the norm's sum of squares is summed over the group: rank r contributes (r+1)^2 per entry
        set_grads(model, lambda i, p: torch.full(p.shape, float(rank + 1)))
        ok, norm, _ = opt.step()
        # only rank 1 overflows, yet both ranks skip
        set_grads(model, lambda i, p: torch.full(p.shape, float("inf") if rank == 1 else 1.0))
        skipped = opt.step()
        results.put((rank, (ok, norm, skipped[0], opt.skipped_steps)))
        dist.destroy_process_group()
    except Exception as error:  # report to the parent; the other rank times out and exits
        results.put((rank, repr(error)))
        raise


@pytest.mark.timeout(60)
def test_norm_and_found_inf_are_reduced_over_the_group():
    ctx = mp.get_context("fork")  # no re-import of torch in the children: a second, not ten
    with tempfile.TemporaryDirectory() as tmp:
        results = ctx.SimpleQueue()
        procs = [ctx.Process(target=_worker, args=(r, 2, os.path.join(tmp, "init"), results))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=45)
        for p in procs:
            if p.is_alive():
                p.kill()
        outcome = {}
        while not results.empty():
            rank, value = results.get()
            outcome[rank] = value
        assert all(p.exitcode == 0 for p in procs), outcome
    n = sum(p.numel() for p in Tiny().parameters())
    expected_norm = math.sqrt(n * (1.0 + 4.0))
    for rank in range(2):
        ok, norm, second_ok, skipped = outcome[rank]
        assert ok and norm == pytest.approx(expected_norm, rel=1e-6)
        assert second_ok is False and skipped == 1
