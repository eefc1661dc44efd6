"""``get_megatron_optimizer``: parameter groups, inner optimizer, grad scaler and wrapper."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_chimera.config import ConfigError, OptimizerConfig
from megatron_chimera.distributed.data_parallel import DataParallel
from megatron_chimera.distributed.grad_buffer import ModelGradBuffers, ShardGroup
from megatron_chimera.model.fused import FusedBackend, get_fused_backend
from megatron_chimera.optimizer.distributed_optimizer import DistributedOptimizer
from megatron_chimera.optimizer.grad_scaler import (
    ConstantGradScaler,
    DynamicGradScaler,
    MegatronGradScaler,
)
from megatron_chimera.optimizer.kernels import build_adam
from megatron_chimera.optimizer.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
    NormFilter,
)

InnerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


def get_param_groups(model_chunks: list[nn.Module],
                     weight_decay: float) -> list[dict]:
    """Two groups: with weight decay, and without for biases and norm weights (1-D parameters).

    Order is deterministic (chunk order, then ``named_parameters`` order) so optimizer state dicts
    line up across runs.
    """
    decay, no_decay, seen = [], [], set()
    for chunk in model_chunks:
        for _, param in chunk.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            (no_decay if param.ndim == 1 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def _grad_scaler(config: OptimizerConfig) -> MegatronGradScaler | None:
    if not config.fp16:
        return None
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    return DynamicGradScaler(initial_scale=config.initial_loss_scale,
                             min_scale=config.min_loss_scale, growth_factor=2.0,
                             backoff_factor=0.5, growth_interval=config.loss_scale_window,
                             hysteresis=config.hysteresis)


def _check(config: OptimizerConfig) -> None:
    if config.fp16 and config.bf16:
        raise ConfigError("--fp16 and --bf16 are mutually exclusive")
    if config.optimizer not in ("adam", "sgd"):
        raise ConfigError(f"--optimizer must be 'adam' or 'sgd', got {config.optimizer!r}")
    if config.clip_grad < 0:
        raise ConfigError(f"--clip-grad must be >= 0, got {config.clip_grad}")


def _inner_factory(config: OptimizerConfig, backend: FusedBackend) -> InnerFactory:
    """Builds the inner optimizer (AdamW or SGD with the config's settings) over param groups."""
    def make(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        if config.optimizer == "adam":
            return build_adam(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                              eps=config.adam_eps, weight_decay=config.weight_decay,
                              backend=backend)
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum,
                               weight_decay=config.weight_decay, foreach=True)
    return make


def _half_dtype(config: OptimizerConfig) -> torch.dtype | None:
    return torch.float16 if config.fp16 else torch.bfloat16 if config.bf16 else None


def get_megatron_optimizer(config: OptimizerConfig, model_chunks: list[nn.Module],
                           grad_norm_group=None, found_inf_group=None,
                           norm_param_filter: NormFilter | None = None,
                           log_num_zeros_in_grad: bool = False,
                           grad_buffers: ModelGradBuffers | None = None,
                           shards: dict[int | str, ShardGroup] | None = None,
                           world_group=None, overlap_param_gather: bool = False,
                           make_inner: InnerFactory | None = None) -> MegatronOptimizer:
    """The optimizer over all parameters of this rank's ``model_chunks`` (its stage replicas).

    ``grad_norm_group`` / ``found_inf_group``: process groups over which the norm's sum of squares
    (SUM) and the overflow flag (MAX) are reduced (None: local). ``norm_param_filter(param)``
    selects the parameters that count in the global norm (default: all). ``grad_buffers``: the
    buffers gradients are reduced into (the local copies of the tied embedding then share one
    main parameter). ``shards`` (with ``grad_buffers``): build the distributed optimizer, sharded
    per stage (and ``TIED`` embedding) as given, reducing norm and found-inf over
    ``world_group``. ``make_inner`` overrides the inner optimizer (tests).
    """
    _check(config)
    backend = get_fused_backend(config.use_apex)
    groups = get_param_groups(model_chunks, config.weight_decay)
    model_params = [p for g in groups for p in g["params"]]
    if not model_params:
        raise ValueError("get_megatron_optimizer: the model chunks have no trainable parameters")
    half = _half_dtype(config)
    if half is None:
        wrong = {p.dtype for p in model_params} - {torch.float32}
        if wrong:
            raise ConfigError(f"model has {wrong} parameters: pass --fp16 or --bf16")
    else:
        for param in model_params:
            if param.dtype not in (torch.float32, half):
                raise ConfigError(f"model parameter dtype {param.dtype} does not match "
                                  f"{'--fp16' if half == torch.float16 else '--bf16'}")
    make_inner = make_inner or _inner_factory(config, backend)
    if shards is not None:
        if grad_buffers is None:
            raise ValueError("the distributed optimizer needs the gradient buffers")
        return DistributedOptimizer(make_inner, groups, grad_buffers, shards, config.clip_grad,
                                    _grad_scaler(config), backend, world_group,
                                    overlap_param_gather, log_num_zeros_in_grad)
    tied = grad_buffers.tied_copies if grad_buffers is not None else []
    mains: dict[int, nn.Parameter] = {}
    main_groups, main_params = [], []
    for group in groups:
        group_mains = []
        for param in group["params"]:
            source = tied[0] if any(param is c for c in tied) else param
            if id(source) not in mains:
                mains[id(source)] = _main_param(source)
                group_mains.append(mains[id(source)])
            main_params.append(mains[id(source)])
        main_groups.append({**group, "params": group_mains})
    cls = FP32Optimizer if half is None else Float16OptimizerWithFloat16Params
    return cls(make_inner(main_groups), model_params, main_params, config.clip_grad,
               _grad_scaler(config), backend, grad_norm_group=grad_norm_group,
               found_inf_group=found_inf_group, norm_param_filter=norm_param_filter,
               log_num_zeros_in_grad=log_num_zeros_in_grad, grad_buffers=grad_buffers)


def get_data_parallel_optimizer(config: OptimizerConfig, data_parallel: DataParallel,
                                make_inner: InnerFactory | None = None) -> MegatronOptimizer:
    """The optimizer of a rank's stage modules over their data-parallel state: local (norm and
    found-inf reduced over the model-replica group, each stage counted on its owner) or
    distributed (sharded over each stage-replica group, the tied embedding over the embedding
    group, reduced over the world). Either way a parameter replicated over the tensor-parallel
    ranks counts on tensor rank 0 only. ``make_inner`` overrides the inner optimizer (tests)."""
    dp = data_parallel
    chunks = [dp.modules[s] for s in sorted(dp.modules)]
    if dp.shards is None:
        return get_megatron_optimizer(
            config, chunks, grad_norm_group=dp.replica_group, found_inf_group=dp.replica_group,
            norm_param_filter=dp.norm_filter, grad_buffers=dp.buffers, make_inner=make_inner)
    optimizer = get_megatron_optimizer(
        config, chunks, grad_buffers=dp.buffers, shards=dp.shards, world_group=dist.group.WORLD,
        overlap_param_gather=dp.overlap_param_gather, make_inner=make_inner)
    optimizer.register_param_gather_hooks(dp.modules)
    return optimizer


def _main_param(param: nn.Parameter) -> nn.Parameter:
    """fp32 main copy of a 16-bit model parameter (fp32 parameters are their own main copy)."""
    if param.dtype == torch.float32:
        return param
    return nn.Parameter(param.detach().clone().float())
