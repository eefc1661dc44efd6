"""Mixed-precision optimizer, loss scalers, global grad-norm clipping and the LR schedule."""

from __future__ import annotations

from megatron_chimera.optimizer.builder import get_megatron_optimizer, get_param_groups
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
    "DynamicGradScaler",
    "FP32Optimizer",
    "Float16OptimizerWithFloat16Params",
    "MegatronGradScaler",
    "MegatronOptimizer",
    "OptimizerParamScheduler",
    "get_megatron_optimizer",
    "get_param_groups",
]
