"""Optimizer state through a checkpoint: a resumed run equals the uninterrupted one, bit for bit.

Two GPU paths had resume bugs: fused AdamW wants its ``step`` tensors on the parameter's device
(torch's ``Optimizer.load_state_dict`` puts them there; writing ``state`` directly did not), and
Apex's FusedAdam keeps its step count in ``param_groups`` (never saved: bias correction restarted
at every resume). The fused path runs here with ``torch.optim.AdamW(fused=True)`` on the CPU, the
Apex path with a stand-in that keeps ``step`` in its groups as Apex does.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_chimera.checkpoint.checkpointing import (
    CheckpointContents,
    StageSlice,
    save_checkpoint,
)
from megatron_chimera.checkpoint.loading import CheckpointTarget, load_checkpoint
from megatron_chimera.config import ModelConfig
from megatron_chimera.model.fused import FusedBackend
from megatron_chimera.model.gpt2 import GPTModel
from megatron_chimera.optimizer.builder import get_param_groups
from megatron_chimera.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

CONFIG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
                     vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0)


class ApexStyleFusedAdam(torch.optim.Optimizer):
    """AdamW whose step count lives in ``param_groups`` (as NVIDIA Apex's FusedAdam keeps it)."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      bias_correction=True))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - Adam, as Apex's kernel computes it
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            b1, b2 = group["betas"]
            c1, c2 = 1 - b1 ** group["step"], 1 - b2 ** group["step"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(m / c1, (v / c2).sqrt_().add_(group["eps"]), value=-group["lr"])


def build(kind: str):
    """A one-stage GPT model and the optimizer of ``kind`` over it."""
    config = CONFIG if kind != "bf16" else dataclasses.replace(CONFIG, params_dtype="bf16")
    model = GPTModel(config, seed=5)
    groups = get_param_groups([model], weight_decay=0.1)
    params = [p for g in groups for p in g["params"]]
    backend = FusedBackend(apex=False)
    if kind == "fused":
        inner = torch.optim.AdamW(groups, lr=1e-2, fused=True)
        return model, FP32Optimizer(inner, params, params, 1.0, None, backend)
    if kind == "apex":
        inner = ApexStyleFusedAdam(groups, lr=1e-2, weight_decay=0.1)
        return model, FP32Optimizer(inner, params, params, 1.0, None, backend)
    mains = [torch.nn.Parameter(p.detach().float()) for p in params]
    main_groups, at = [], 0
    for group in groups:
        n = len(group["params"])
        main_groups.append({**group, "params": mains[at:at + n]})
        at += n
    inner = torch.optim.AdamW(main_groups, lr=1e-2, foreach=True)
    return model, Float16OptimizerWithFloat16Params(inner, params, mains, 1.0, None, backend)


def train(model, optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_length), generator=g)
        positions = torch.arange(CONFIG.seq_length).expand(2, -1)
        optimizer.zero_grad()
        model(tokens, positions, labels=tokens.roll(-1, dims=1)).float().mean().backward()
        assert optimizer.step()[0]


def save(root, model, optimizer, iteration: int, fmt: str = "torch") -> None:
    stage = StageSlice(0, (0, CONFIG.num_layers), model)
    save_checkpoint(str(root), CheckpointContents(iteration, [stage], [(0, CONFIG.num_layers)],
                                                  optimizer=optimizer), rank=0, world_size=1,
                    ckpt_format=fmt)


def resume(root, kind: str):
    model, optimizer = build(kind)
    stage = StageSlice(0, (0, CONFIG.num_layers), model)
    load_checkpoint(str(root), CheckpointTarget([stage], 1, optimizer), rank=0, world_size=1)
    return model, optimizer


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("kind", ["fused", "apex", "bf16"])
def test_resumed_run_equals_uninterrupted_run(tmp_path, kind, fmt):
    straight, straight_opt = build(kind)
    train(straight, straight_opt, range(6))
    model, optimizer = build(kind)
    train(model, optimizer, range(3))
    save(tmp_path, model, optimizer, 3, fmt)
    model, optimizer = resume(tmp_path, kind)
    if kind == "fused":  # load_state_dict's policy: step tensors on the parameter's device
        for param, state in optimizer.optimizer.state.items():
            assert state["step"].device == param.device and state["step"].dtype == torch.float32
    if kind == "apex":
        assert all(group["step"] == 3 for group in optimizer.optimizer.param_groups)
    train(model, optimizer, range(3, 6))
    for (name, a), b in zip(straight.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name


def test_the_resume_check_can_fail(tmp_path):
    """Restarting Apex's step count (the old behaviour) changes the weights."""
    straight, straight_opt = build("apex")
    train(straight, straight_opt, range(6))
    model, optimizer = build("apex")
    train(model, optimizer, range(3))
    save(tmp_path, model, optimizer, 3)
    model, optimizer = resume(tmp_path, "apex")
    for group in optimizer.optimizer.param_groups:
        del group["step"]
    train(model, optimizer, range(3, 6))
    assert not all(torch.equal(a, b) for a, b in zip(straight.parameters(), model.parameters()))


class _CopyCounter(TorchDispatchMode):
    """Counts the tensor copies an operation makes (clone, _to_copy, copy_, empty_like)."""

    def __init__(self) -> None:
        super().__init__()
        self.copied_elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if name.startswith(("clone", "_to_copy", "copy_", "empty_like")):
            self.copied_elements += math.prod(args[0].shape) if args else 0
        return func(*args, **(kwargs or {}))


def test_saving_makes_no_copy_of_model_or_optimizer_state(tmp_path):
    """Save writes host copies only: on the CPU nothing is copied at all (before: every Adam
    moment and fp32 main parameter was cloned on the device first, +12 bytes per parameter)."""
    model, optimizer = build("bf16")
    train(model, optimizer, range(2))
    with _CopyCounter() as counter:
        save(tmp_path, model, optimizer, 2)
    assert counter.copied_elements == 0
    numel = sum(p.numel() for p in model.parameters())
    model, optimizer = resume(tmp_path, "bf16")  # and the state is all there
    assert sum(s["exp_avg"].numel() for s in optimizer.optimizer.state.values()) == numel
