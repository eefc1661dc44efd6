"""torch.distributed.pipelining's schedules on emulated stages: what the benchmarks compare with.

:func:`build_torch_pipeline` places :class:`~.emulated.EmulatedTorchStage` stages the way each of
torch's schedules expects (one stage per rank for 1F1B, a loop of two for interleaved 1F1B, a V
for ZBV and DualPipeV) over the ranks of ``group``, and returns a :class:`TorchPipeline` whose
:meth:`~TorchPipeline.step` runs one iteration (used by ``tools/benchmark_schedules.py`` and
``tools/benchmark_overhead.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_chimera.pipeline.emulated import (
    EmulatedCosts,
    EmulatedTorchStage,
    emulated_stage_costs,
    mse_then_wait,
)

TORCH_SCHEDULES = ("torch-1f1b", "torch-interleaved", "torch-zbv", "torch-dualpipev")
_SPLIT = ("torch-zbv", "torch-dualpipev")  # F, I (input gradient) and W per stage and micro-batch


@dataclass
class TorchPipeline:
    """One rank's part of a torch pipelining schedule over emulated stages."""

    name: str
    schedule: Any
    stages: list[Any]
    stage_ids: list[int]
    num_stages: int
    num_microbatches: int
    inputs: torch.Tensor  # the whole batch, [micro_batch x N, seq, hidden]

    @property
    def actions_per_rank(self) -> int:
        """Compute actions of this rank per iteration (F and B, or F, I and W when split)."""
        per_microbatch = 3 if self.name in _SPLIT else 2
        return per_microbatch * len(self.stage_ids) * self.num_microbatches

    def step(self) -> None:
        """One iteration (gradients zeroed first)."""
        for stage in self.stages:
            stage.submod.zero_grad(set_to_none=True)
        kwargs: dict[str, Any] = {}
        if self.num_stages - 1 in self.stage_ids:
            kwargs = {"target": torch.zeros_like(self.inputs), "losses": []}
        if 0 in self.stage_ids:
            self.schedule.step(self.inputs, **kwargs)
        else:
            self.schedule.step(**kwargs)


def build_torch_pipeline(name: str, d: int, n: int, costs: EmulatedCosts,
                         shape: tuple[int, int, int], group: dist.ProcessGroup | None = None,
                         end_stage_factor: float = 1.0) -> TorchPipeline:
    """Schedule ``name`` (one of :data:`TORCH_SCHEDULES`) over the ``d`` ranks of ``group``
    (default: the world) with ``n`` micro-batches of ``shape = (micro_batch, seq, hidden)``;
    each stage takes ``costs`` scaled to its share of the model (the first and last
    ``end_stage_factor`` times more, :func:`emulated_stage_costs`). Raises ValueError for an unknown
    name, and torch's own ValueError where a schedule does not support ``(d, n)``."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as ts

    rank = dist.get_rank(group)
    if name == "torch-1f1b":
        stage_ids, num_stages, cls = [rank], d, ts.Schedule1F1B
    elif name == "torch-interleaved":
        stage_ids, num_stages, cls = [rank, rank + d], 2 * d, ts.ScheduleInterleaved1F1B
    elif name in _SPLIT:
        stage_ids, num_stages = [rank, 2 * d - 1 - rank], 2 * d
        cls = ts.ScheduleZBVZeroBubble if name == "torch-zbv" else ts.ScheduleDualPipeV
    else:
        raise ValueError(f"unknown torch schedule {name!r}; choose {TORCH_SCHEDULES}")
    per_stage = emulated_stage_costs(costs, num_stages, d, end_stage_factor,
                                     split=name in _SPLIT)
    example = torch.randn(*shape)
    modules = {sid: EmulatedTorchStage(per_stage[sid], sid == 0, shape[-1],
                                       is_last=sid == num_stages - 1) for sid in stage_ids}
    stages = [
        PipelineStage(modules[sid], sid, num_stages, torch.device("cpu"),
                      input_args=(example.clone().requires_grad_(sid > 0),),
                      output_args=(example.clone().requires_grad_(),), group=group)
        for sid in stage_ids
    ]
    loss_fn = functools.partial(mse_then_wait, modules.get(num_stages - 1))
    schedule = cls(stages[0] if cls is ts.Schedule1F1B else stages, n, loss_fn=loss_fn)
    inputs = torch.randn(shape[0] * n, *shape[1:])
    return TorchPipeline(name, schedule, stages, stage_ids, num_stages, n, inputs)
