"""Receive buffers are reused only when nothing reads them any more: equality with one process.

Every stage is ``h -> Linear(h)`` with the Linear last, so its saved input is the received
activation and, in a split backward, the output gradient its W queues is the received gradient
buffer itself -- both read long after the action that consumed them. Stage 1 is the identity
(``h.view_as(h)``): the activation it sends is a view of the buffer it received (and, autograd
permitting, so is the gradient it sends back). Two iterations' gradients must equal a single
process's (each stage replica over the micro-batches of its pipe), and buffers must have been
reused: the pool allocated fewer than were received, and nothing more in the second iteration.
"""

from __future__ import annotations

import datetime

import pytest
import torch
from torch import nn

from megatron_chimera import parallel_state
from megatron_chimera.model.linear import Linear
from megatron_chimera.pipeline.executor import Gradients, PipelineExecutor, StageWork
from megatron_chimera.pipeline.topology import PipelineTopology
from megatron_chimera.schedules import build_schedule
from megatron_chimera.schedules.actions import FORWARD
from megatron_chimera.schedules.lowering import RECV
from tests.helpers.schedules import with_weight_actions

from .harness import spawn_world

pytestmark = pytest.mark.distributed
SEQ, MICRO_BATCH, HIDDEN = 3, 2, 5
IDENTITY_STAGE = 1


class ChainStage(nn.Module):
    """One stage of the chain: a seeded Linear applied last, or the identity (stage 1)."""

    def __init__(self, stage: int, num_stages: int) -> None:
        super().__init__()
        self.stage, self.last = stage, stage == num_stages - 1
        self.linear = None
        if stage != IDENTITY_STAGE:
            self.linear = Linear(HIDDEN, HIDDEN)
            g = torch.Generator().manual_seed(1000 + stage)
            with torch.no_grad():
                self.linear.weight.copy_(torch.randn(HIDDEN, HIDDEN, generator=g) * 0.5)
                self.linear.bias.copy_(torch.randn(HIDDEN, generator=g) * 0.1)
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """The received activation."""
        self.input_tensor = tensor

    def forward(self, batch: torch.Tensor | None) -> torch.Tensor:
        """``[s, b, h]`` out; the per-token loss ``[b, s]`` at the last stage."""
        hidden = batch if self.stage == 0 else self.input_tensor
        hidden = hidden.view_as(hidden) if self.linear is None else self.linear(hidden)
        return hidden.pow(2).mean(dim=-1).t() if self.last else hidden


def _forward_step(batch, model: ChainStage):
    output = model(batch)
    return output, lambda per_token: (per_token.mean(), {"loss": per_token.mean().detach()})


def _batch(step: int, microbatch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(31 * step + microbatch)
    return torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=g)


def _reference(num_stages: int, n: int, step: int, microbatches: list[int],
               ) -> dict[int, torch.Tensor]:
    """Weight gradients of every stage, one process, over ``microbatches`` (those of the pipe
    that visits a rank's stage: without gradient synchronisation each stage replica holds only
    its pipe's share)."""
    stages = [ChainStage(s, num_stages) for s in range(num_stages)]
    for m in microbatches:
        hidden = _batch(step, m)
        for stage in stages:
            stage.set_input_tensor(hidden)
            hidden = stage(hidden if stage.stage == 0 else None)
        (hidden.mean() / n).backward()
    return {s.stage: s.linear.weight.grad for s in stages if s.linear is not None}


def run_chain(rank: int, world_size: int, name: str, n: int, options: dict,
              split_delay: int | None) -> None:
    """Two iterations of ``name`` on the chain; gradients against :func:`_reference`."""
    schedule = build_schedule(name, world_size, n, **options)
    if split_delay is not None:
        schedule = with_weight_actions(schedule, split_delay)
    parallel_state.initialize_model_parallel(world_size, schedule.placement, schedule.num_stages,
                                             timeout=datetime.timedelta(seconds=60))
    try:
        prank = parallel_state.get_pipeline_model_parallel_rank()
        stages = {s: ChainStage(s, schedule.num_stages) for s in schedule.stages_of_rank(prank)}
        executor = PipelineExecutor(
            schedule, PipelineTopology.from_parallel_state(),
            StageWork(stages, _forward_step, (SEQ, MICRO_BATCH, HIDDEN), torch.float32),
            Gradients(loss_scale_divisor=n))
        allocated: list[int] = []  # receive buffers the pool created, after each iteration
        for step in range(2):
            for module in stages.values():
                module.zero_grad(set_to_none=True)
            executor.run([_batch(step, m) for m in range(n)])
            for s, module in stages.items():
                if module.linear is None:
                    continue
                if module.linear.weight_grad_deferrable != schedule.split_backward:
                    raise AssertionError(  # split backwards defer; the others run torch's own
                        f"stage {s}: deferrable forward {module.linear.weight_grad_deferrable} "
                        f"under a schedule with split_backward={schedule.split_backward}")
                visiting = sorted({a.microbatch for a in schedule.actions[prank]
                                   if a.kind == FORWARD and a.stage == s})
                reference = _reference(schedule.num_stages, n, step, visiting)
                torch.testing.assert_close(
                    module.linear.weight.grad, reference[s], rtol=1e-5, atol=1e-7,
                    msg=lambda text, s=s, t=step: f"stage {s}, iteration {t}: {text}")
            allocated.append(executor.comm.pool.allocated)
        received = sum(op.op == RECV for op in executor.lowered[False].comms(prank))
        if allocated[1] != allocated[0]:
            raise AssertionError(f"rank {prank}: the second iteration allocated "
                                 f"{allocated[1] - allocated[0]} more receive buffers")
        if allocated[0] > received or (prank == 0 and allocated[0] >= received):
            raise AssertionError(f"rank {prank}: {allocated[0]} buffers for {received} receives "
                                 f"per iteration: buffers were not reused")
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name,options,split_delay", [
    ("1f1b", {}, None),
    ("chimera", {}, None),
    ("zb-h1", {}, None),
    ("chimera-zb", {}, None),
    ("1f1b", {}, 5),  # W long after B: the queued input and output gradient must survive
])
def test_reused_buffers_never_change_what_is_read(name, options, split_delay):
    """D=4, N=8 under NCCL semantics: same gradients as one process, buffers reused."""
    spawn_world(run_chain, 4, name, 8, options, split_delay, timeout_s=220)
