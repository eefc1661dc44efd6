"""Autograd-aware communication at tensor-parallel boundaries (Megatron-core's mappings).

Each function returns its input unchanged with T = 1, without an autograd node (no host cost
per layer). Tensor-parallel regions split the last dimension
(hidden features, heads, vocabulary); sequence-parallel regions split the first (the sequence of
``[s, b, h]`` activations):

==========================================  ==========================  ==========================
function                                    forward                     backward
==========================================  ==========================  ==========================
copy_to_tensor_model_parallel_region        identity                    all-reduce
reduce_from_tensor_model_parallel_region    all-reduce                  identity
scatter_to_tensor_model_parallel_region     keep this rank's last-dim   all-gather last dim
gather_from_tensor_model_parallel_region    all-gather last dim         keep this rank's chunk
scatter_to_sequence_parallel_region         keep this rank's seq chunk  all-gather sequence
gather_from_sequence_parallel_region        all-gather sequence         reduce-scatter (or keep
                                                                        the chunk when the output
                                                                        gradient is replicated)
reduce_scatter_to_sequence_parallel_region  reduce-scatter sequence     all-gather sequence
==========================================  ==========================  ==========================
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_chimera import parallel_state
from megatron_chimera.tensor_parallel.collectives import all_gather_single, reduce_scatter_single
from megatron_chimera.tensor_parallel.utils import split_tensor_along_dim


def _world() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()


def _group() -> dist.ProcessGroup:
    return parallel_state.get_tensor_model_parallel_group()


def _reduce(tensor: torch.Tensor) -> torch.Tensor:
    """All-reduce (SUM) over the tensor-parallel group (a new tensor)."""
    if _world() == 1:
        return tensor
    out = tensor.contiguous().clone()
    dist.all_reduce(out, group=_group())
    return out


def _split_last(tensor: torch.Tensor) -> torch.Tensor:
    if _world() == 1:
        return tensor
    return split_tensor_along_dim(tensor, -1, _world())[
        parallel_state.get_tensor_model_parallel_rank()]


def _gather_last(tensor: torch.Tensor) -> torch.Tensor:
    """All-gather along the last dimension: one single-tensor collective into ``[T, ...]``,
    then the ranks' chunks moved next to each other (one copy, as ``cat`` would make)."""
    world = _world()
    if world == 1:
        return tensor
    gathered = gather_along_first_dim(tensor.unsqueeze(0))  # [T, *shape]
    return gathered.movedim(0, -2).reshape(*tensor.shape[:-1], tensor.shape[-1] * world)


def _split_first(tensor: torch.Tensor) -> torch.Tensor:
    if _world() == 1:
        return tensor
    return split_tensor_along_dim(tensor, 0, _world())[
        parallel_state.get_tensor_model_parallel_rank()]


def gather_along_first_dim(tensor: torch.Tensor, async_op: bool = False):
    """All-gather ``tensor`` along its first dimension over the tensor-parallel group (no
    autograd: for a function that does its own backward). With ``async_op``: ``(gathered,
    work)``, the result valid once ``work`` (None with T = 1) was waited on."""
    if _world() == 1:
        return (tensor, None) if async_op else tensor
    shape = list(tensor.shape)
    shape[0] *= _world()
    out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    work = all_gather_single(out, tensor.contiguous(), group=_group(), async_op=async_op)
    return (out, work) if async_op else out


def _reduce_scatter_first(tensor: torch.Tensor) -> torch.Tensor:
    if _world() == 1:
        return tensor
    out, _ = reduce_scatter_along_first_dim(tensor, async_op=False)
    return out


def reduce_scatter_along_first_dim(tensor: torch.Tensor, async_op: bool = True):
    """Sum ``tensor`` over the tensor-parallel group, keeping this rank's chunk of the first
    dimension: ``(chunk, work)`` -- ``work`` to wait on when ``async_op`` (then the chunk is
    valid only after it), else None."""
    world = _world()
    shape = list(tensor.shape)
    if shape[0] % world:
        raise ValueError(f"sequence length {shape[0]} is not divisible by the tensor-parallel "
                         f"size {world}")
    shape[0] //= world
    out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    work = reduce_scatter_single(out, tensor.contiguous(), group=_group(), async_op=async_op)
    return out, work


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):  # type: ignore[override]
        return input_

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        return _reduce(grad_output)


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):  # type: ignore[override]
        return _reduce(input_)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        return grad_output


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):  # type: ignore[override]
        return _split_last(input_)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        return _gather_last(grad_output)


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):  # type: ignore[override]
        return _gather_last(input_)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        return _split_last(grad_output)


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):  # type: ignore[override]
        return _split_first(input_)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        return gather_along_first_dim(grad_output)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, tensor_parallel_output_grad):  # type: ignore[override]
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return gather_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_first(grad_output), None
        return _split_first(grad_output), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):  # type: ignore[override]
        return _reduce_scatter_first(input_)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        return gather_along_first_dim(grad_output)


def copy_to_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient (the input of a column-parallel layer)."""
    if _world() == 1:
        return input_
    return _CopyToModelParallelRegion.apply(input_)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """All-reduce forward (the partial sums of a row-parallel layer); identity backward."""
    if _world() == 1:
        return input_
    return _ReduceFromModelParallelRegion.apply(input_)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """This rank's chunk of the last dimension; the gradient is all-gathered back."""
    if _world() == 1:
        return input_
    return _ScatterToModelParallelRegion.apply(input_)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """All-gather along the last dimension; the gradient keeps this rank's chunk."""
    if _world() == 1:
        return input_
    return _GatherFromModelParallelRegion.apply(input_)


def scatter_to_sequence_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """This rank's chunk of the sequence (first) dimension; the gradient is all-gathered."""
    if _world() == 1:
        return input_
    return _ScatterToSequenceParallelRegion.apply(input_)


def gather_from_sequence_parallel_region(input_: torch.Tensor,
                                         tensor_parallel_output_grad: bool = True
                                         ) -> torch.Tensor:
    """All-gather along the sequence; the gradient is reduce-scattered (each rank's output
    gradient is partial), or only split when ``tensor_parallel_output_grad`` is False (the
    consumer computed the same thing on every rank)."""
    if _world() == 1:
        return input_
    return _GatherFromSequenceParallelRegion.apply(input_, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Sum the partial outputs of a row-parallel layer and keep this rank's sequence chunk; the
    gradient is all-gathered."""
    if _world() == 1:
        return input_
    return _ReduceScatterToSequenceParallelRegion.apply(input_)
