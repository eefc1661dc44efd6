"""Where a rank's piece of a tensor lies in the layout-independent full ("master") tensor.

A sharded checkpoint stores every tensor at its master shape (:func:`master_shape`: the T
tensor-parallel shards joined, the vocabulary padding cut off) as chunks with global offsets.
This rank's piece is either the whole local shard (model weights) or a flattened range of it (a
distributed-optimizer fragment). Both are cut into rectangles of the master tensor: a flat range
of a 2-D shard is at most three rectangles (a partial first row, whole rows, a partial last row;
of an n-d shard at most 2n - 1), each mapped through the shard's place along ``partition_dim``
(one segment, or ``stride`` for fused gate+up weights; rows past ``master_size`` dropped). An
MoE layer's experts (``[experts / EP, ...]`` stacked weights) are rows ``expert_offset ...`` of
the master ``[num_experts, ...]`` tensor: the expert dimension is sharded over the EP ranks, so
a checkpoint of one expert-parallel size loads into any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_chimera import parallel_state
from megatron_chimera.tensor_parallel.utils import is_tensor_parallel, master_shape

Rect = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclass(frozen=True)
class ShardSpec:
    """A local tensor's shape, its master shape and, along ``dim``, the segments
    ``(local_start, master_start, length)`` that it holds of the master."""

    local_shape: tuple[int, ...]
    master_shape: tuple[int, ...]
    dim: int
    segments: tuple[tuple[int, int, int], ...]


def spec_of(tensor: torch.Tensor, tp_rank: int | None = None,
            tp_world: int | None = None) -> ShardSpec:
    """The shard spec of a parameter (tensor-parallel or replicated) or buffer."""
    shape = tuple(tensor.shape)
    if getattr(tensor, "num_experts", None) is not None:  # experts: rows of [num_experts, ...]
        return ShardSpec(shape, (tensor.num_experts,) + shape[1:], 0,
                         ((0, tensor.expert_offset, shape[0]),))
    if not is_tensor_parallel(tensor):
        return ShardSpec(shape, shape, 0, ((0, 0, shape[0] if shape else 1),))
    rank = parallel_state.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    world = (parallel_state.get_tensor_model_parallel_world_size()
             if tp_world is None else tp_world)
    dim, local = tensor.partition_dim, shape[tensor.partition_dim]
    size = tensor.master_size
    stride = getattr(tensor, "partition_stride", 1)
    if stride > 1:  # `stride` master blocks, each split over the ranks
        part, block = local // stride, size // stride
        segments = tuple((j * part, j * block + rank * part, part) for j in range(stride))
    else:
        length = max(0, min(local, size - rank * local))
        segments = ((0, rank * local, length),) if length else ()
    del world  # the shard size fixes the offsets; T only matters through `rank`
    return ShardSpec(shape, master_shape(tensor), dim, segments)


def _local_rects(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[Rect, int]]:
    """Rectangles of the local shard covering flat elements ``[lo, hi)``, each with the flat
    index where its (row-major, contiguous) values start. A range of an n-d tensor is at most
    ``2n - 1`` rectangles: partial slices of each trailing dimension around whole ones of the
    first (a 3-d expert weight's distributed-optimizer fragment: up to five)."""
    if len(shape) == 0:
        return [(((), ()), lo)]
    if len(shape) == 1:
        return [(((lo,), (hi - lo,)), lo)]
    if lo >= hi:
        return []
    inner = 1
    for size in shape[1:]:
        inner *= size

    def in_row(row: int, a: int, b: int) -> list[tuple[Rect, int]]:
        """Elements ``[a, b)`` of row ``row`` (flat indices of the whole tensor)."""
        return [(((row,) + offsets, (1,) + sizes), row * inner + start)
                for (offsets, sizes), start in _local_rects(shape[1:], a - row * inner,
                                                            b - row * inner)]

    first, last = lo // inner, (hi - 1) // inner
    if first == last:
        return in_row(first, lo, hi)
    rects, at = [], lo
    if at % inner:  # partial first row
        rects += in_row(first, at, (first + 1) * inner)
        at = (first + 1) * inner
    full = (hi - at) // inner
    if full:
        rects.append((((at // inner,) + (0,) * (len(shape) - 1), (full,) + shape[1:]), at))
        at += full * inner
    if at < hi:  # partial last row
        rects += in_row(at // inner, at, hi)
    return rects


def master_chunks(spec: ShardSpec, values: torch.Tensor, lo: int, hi: int
                  ) -> list[tuple[Rect, torch.Tensor]]:
    """``values`` (flat, elements ``[lo, hi)`` of the local shard) as master rectangles, each
    with a view of its values (views of ``values``: writing into them fills ``values``)."""
    found = []
    for (offsets, sizes), start in _local_rects(spec.local_shape, lo, hi):
        count = 1
        for size in sizes:
            count *= size
        view = values[start - lo:start - lo + count].view(sizes)
        if not sizes:
            found.append((((), ()), view))
            continue
        d = spec.dim
        for local_start, master_start, length in spec.segments:
            a = max(offsets[d], local_start)
            b = min(offsets[d] + sizes[d], local_start + length)
            if a >= b:
                continue
            out_off = list(offsets)
            out_size = list(sizes)
            out_off[d] = master_start + a - local_start
            out_size[d] = b - a
            found.append(((tuple(out_off), tuple(out_size)), view.narrow(d, a - offsets[d], b - a)))
    return found
