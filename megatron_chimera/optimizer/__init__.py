"""Mixed-precision and distributed optimizers, loss scalers, grad-norm clipping, the LR schedule."""

from __future__ import annotations

from megatron_chimera.distributed.grad_buffer import ShardGroup
from megatron_chimera.optimizer.builder import (
    get_data_parallel_optimizer,
    get_megatron_optimizer,
    get_param_groups,
)
from megatron_chimera.optimizer.distributed_optimizer import DistributedOptimizer
from megatron_chimera.optimizer.grad_scaler import (
    ConstantGradScaler,
    DynamicGradScaler,
    MegatronGradScaler,
)
from megatron_chimera.optimizer.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
)
from megatron_chimera.optimizer.param_scheduler import OptimizerParamScheduler

__all__ = [
    "ConstantGradScaler",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "FP32Optimizer",
    "Float16OptimizerWithFloat16Params",
    "MegatronGradScaler",
    "MegatronOptimizer",
    "OptimizerParamScheduler",
    "ShardGroup",
    "get_data_parallel_optimizer",
    "get_megatron_optimizer",
    "get_param_groups",
]
