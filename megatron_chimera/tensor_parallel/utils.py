"""Parameter attributes and tensor arithmetic of tensor parallelism (Megatron-core's names).

A parameter split over the T tensor-parallel ranks carries Megatron's attributes
``tensor_model_parallel = True``, ``partition_dim`` and ``partition_stride``, plus ``master_size``:
its size along ``partition_dim`` in the layout-independent full (master) tensor. The master tensor
is what initialisation draws and what checkpoints store; for column- and row-parallel weights
``master_size = T x local size``; for the vocabulary-parallel tensors it is the vocabulary padded
for one rank (``--make-vocab-size-divisible-by``), and the rows Megatron's T-dependent padding adds
beyond it are zero. A parameter whose gradient is partial on each rank under sequence parallelism
(LayerNorm weights and biases, row-parallel biases) carries ``sequence_parallel = True``.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_chimera import parallel_state

_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """``numerator / denominator``; ValueError when it does not divide."""
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by {denominator}")
    return numerator // denominator


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool, dim: int,
                                         stride: int = 1, master_size: int | None = None) -> None:
    """Mark ``param`` as split along ``dim`` over the tensor-parallel ranks (Megatron's
    attributes); ``master_size`` defaults to T x its local size along ``dim``."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride
    if is_parallel:
        world = parallel_state.get_tensor_model_parallel_world_size()
        param.master_size = master_size if master_size is not None else param.shape[dim] * world


def set_defaults_if_not_set_tensor_model_parallel_attributes(param: torch.Tensor) -> None:
    """Give a replicated parameter Megatron's default attributes (not split)."""
    for name, value in _DEFAULTS.items():
        if not hasattr(param, name):
            setattr(param, name, value)


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """Whether ``param`` is split over the tensor-parallel ranks."""
    return bool(getattr(param, "tensor_model_parallel", False))


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor) -> bool:
    """True for a split parameter, and for a replicated one on tensor rank 0 only: count each
    parameter of the model once (grad norm, zero counts)."""
    return is_tensor_parallel(param) or parallel_state.get_tensor_model_parallel_rank() == 0


def mark_sequence_parallel(module: nn.Module, enabled: bool) -> None:
    """Flag every parameter of ``module`` as sequence parallel (its gradient is partial per rank
    and is all-reduced over the tensor-parallel group) when ``enabled``."""
    for param in module.parameters():
        param.sequence_parallel = enabled


def master_shape(param: torch.Tensor) -> tuple[int, ...]:
    """Shape of the layout-independent full tensor ``param`` is a shard of."""
    shape = list(param.shape)
    if is_tensor_parallel(param):
        shape[param.partition_dim] = param.master_size
    return tuple(shape)


def padded_master_size(param: torch.Tensor) -> int:
    """Size along ``partition_dim`` of all T shards together (>= ``master_size``)."""
    return param.shape[param.partition_dim] * parallel_state.get_tensor_model_parallel_world_size()


def shard_of_master(param: torch.Tensor, master: torch.Tensor, rank: int | None = None,
                    world_size: int | None = None) -> torch.Tensor:
    """This rank's shard of the full tensor ``master`` (zero-padded along ``partition_dim`` to the
    T shards when the master is smaller, as the vocabulary is)."""
    if not is_tensor_parallel(param):
        return master
    rank = parallel_state.get_tensor_model_parallel_rank() if rank is None else rank
    world = (parallel_state.get_tensor_model_parallel_world_size()
             if world_size is None else world_size)
    dim, local = param.partition_dim, param.shape[param.partition_dim]
    stride = getattr(param, "partition_stride", 1)
    if stride > 1:  # the master is `stride` blocks, each split over the ranks (fused gate+up)
        blocks = master.chunk(stride, dim=dim)
        part = local // stride
        return torch.cat([b.narrow(dim, rank * part, part) for b in blocks], dim=dim)
    return pad_along(master, dim, local * world).narrow(dim, rank * local, local)


def join_shards(param: torch.Tensor, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor of ``param`` from its T ``shards`` (in tensor-rank order): the inverse of
    :func:`shard_of_master`, padding rows cut to ``master_size``."""
    dim = param.partition_dim
    stride = getattr(param, "partition_stride", 1)
    if stride > 1:
        pieces = [shard.chunk(stride, dim=dim) for shard in shards]
        return torch.cat([p[i] for i in range(stride) for p in pieces], dim=dim)
    return torch.cat(shards, dim=dim).narrow(dim, 0, param.master_size)


def pad_along(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``tensor`` with zeros appended along ``dim`` up to ``size`` (itself when not smaller)."""
    missing = size - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


def split_tensor_along_dim(tensor: torch.Tensor, dim: int, parts: int) -> list[torch.Tensor]:
    """``parts`` equal contiguous chunks of ``tensor`` along ``dim``."""
    divide(tensor.shape[dim], parts, f"dimension {dim} of size")
    return [chunk.contiguous() for chunk in torch.chunk(tensor, parts, dim=dim)]


class VocabUtility:
    """The vocabulary range ``[first, last)`` a tensor-parallel rank holds (Megatron's name)."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition: int, rank: int,
                                                  world_size: int) -> tuple[int, int]:
        """Range of ``rank`` when every rank holds ``per_partition`` rows."""
        first = rank * per_partition
        return first, first + per_partition

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int,
                                           world_size: int) -> tuple[int, int]:
        """Range of ``rank`` in a (padded) vocabulary split evenly over ``world_size`` ranks."""
        per_partition = divide(global_vocab_size, world_size, "padded vocabulary")
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank,
                                                                      world_size)
