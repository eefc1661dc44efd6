"""The context-parallel group's communication: a ring shift for ``p2p`` (ring) attention and the
differentiable all-gather / all-to-all that ``allgather`` and ``a2a`` attention are made of.

Every collective here also runs on gloo (the test bed): the reduce-scatter that is the
all-gather's backward is an all-reduce plus a slice there, NCCL's ``reduce_scatter_tensor``
elsewhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class RingShift:
    """Send a tensor to the next rank of the group and receive the previous rank's, asynchronously
    (``start``, then ``wait`` for the received tensor)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        ranks = dist.get_process_group_ranks(group)
        me = dist.get_rank(group)
        self.group = group
        self.next = ranks[(me + 1) % len(ranks)]
        self.prev = ranks[(me - 1) % len(ranks)]
        self._works: list = []
        self._received: torch.Tensor | None = None
        self._sent: torch.Tensor | None = None

    def start(self, tensor: torch.Tensor) -> None:
        """Post the send of ``tensor`` (kept alive until :meth:`wait`) and the receive."""
        tensor = tensor.contiguous()
        self._received = torch.empty_like(tensor)
        self._sent = tensor
        ops = [dist.P2POp(dist.isend, tensor, self.next, self.group),
               dist.P2POp(dist.irecv, self._received, self.prev, self.group)]
        self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        """The previous rank's tensor, once both transfers are complete."""
        for work in self._works:
            work.wait()
        received, self._received, self._sent, self._works = self._received, None, None, []
        return received


def _reduce_scatter(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``tensor`` over the group and keep this rank's slice of ``dim``."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if dist.get_backend(group) == "nccl":
        parts = [p.contiguous() for p in tensor.chunk(size, dim=dim)]
        out = torch.empty_like(parts[rank])
        dist.reduce_scatter(out, parts, group=group)
        return out
    total = tensor.contiguous()
    dist.all_reduce(total, group=group)
    return total.chunk(size, dim=dim)[rank].contiguous()


def _all_gather(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(tensor, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


def all_gather(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along ``dim`` in rank order; the backward sums the
    gradient over the group and keeps this rank's slice (a reduce-scatter)."""
    return _AllGather.apply(tensor, dim, group)


def _all_to_all(tensor: torch.Tensor, scatter_dim: int, gather_dim: int,
                group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    sends = [p.contiguous() for p in tensor.chunk(size, dim=scatter_dim)]
    receives = [torch.empty_like(sends[0]) for _ in range(size)]
    dist.all_to_all(receives, sends, group=group)
    return torch.cat(receives, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(tensor, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(tensor: torch.Tensor, scatter_dim: int, gather_dim: int,
               group: dist.ProcessGroup) -> torch.Tensor:
    """Split ``tensor`` into group-size parts along ``scatter_dim``, send part ``i`` to rank
    ``i`` and concatenate what arrives along ``gather_dim`` in rank order (its backward is the
    all-to-all the other way)."""
    return _AllToAll.apply(tensor, scatter_dim, gather_dim, group)
