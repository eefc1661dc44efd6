"""What a :class:`~.executor.PipelineExecutor` is given: the stage work, the training side and
the posting policy (split from :mod:`.executor`, which re-exports them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_chimera.distributed.grad_sync import GradientSynchronizer
from megatron_chimera.schedules.lowering import DEFAULT_LOOKAHEAD
from megatron_chimera.tensor_parallel.weight_grad import WeightGradStore

ForwardStepFunc = Callable[[Any, nn.Module], tuple[torch.Tensor, Callable]]


@dataclass(frozen=True)
class StageWork:
    """What the executor runs: this rank's stage ``modules`` (every stage it holds, one module
    per stage, shared by the pipes that visit it), the ``forward_step_func``, the shape and
    dtype of every p2p message (``[seq, micro_batch, hidden]``) on ``device``, and whether B
    re-runs the forward from the stage input (``recompute``)."""

    modules: dict[int, nn.Module]
    forward_step_func: ForwardStepFunc
    tensor_shape: Sequence[int]
    dtype: torch.dtype
    device: torch.device | str = "cpu"
    recompute: bool = False


@dataclass(frozen=True)
class Gradients:
    """The training side of an executor: each micro-batch loss is divided by
    ``loss_scale_divisor`` (``N x W``) before its backward; ``grad_sync`` reduces the gradients
    (None: evaluation only); ``scale_loss`` is the fp16 grad scaler's hook;
    ``weight_grad_store_factory`` makes the store of each split backward (W)."""

    loss_scale_divisor: float = 1.0
    grad_sync: GradientSynchronizer | None = None
    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None
    weight_grad_store_factory: Callable[[], WeightGradStore] = WeightGradStore


@dataclass(frozen=True)
class ExecutorPolicy:
    """How the lists run: ``recv_lookahead`` is how many compute actions early a receive is
    posted when NCCL's rules allow it; ``deallocate_outputs`` frees a sent activation's storage;
    ``warm_up`` connects every direction before the first iteration; ``safe_posting=False``
    ignores NCCL's rules (only to show that tests catch it); ``overlap_pairs`` runs each paired
    action's halves so that one's all-to-alls overlap the other's compute (:mod:`.overlap`;
    False: one half after the other); ``time_kinds`` sums each rank's compute time per action
    kind (F, B, W) for straggler attribution (``--log-straggler``; off: none of that timing)."""

    recv_lookahead: int = DEFAULT_LOOKAHEAD
    deallocate_outputs: bool = True
    warm_up: bool = True
    safe_posting: bool = True
    overlap_pairs: bool = True
    time_kinds: bool = True
