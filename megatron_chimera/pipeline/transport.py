"""How point-to-point messages move: torch.distributed, or the same under NCCL's rules for tests.

:class:`Transport` posts the sends and receives of a lowered schedule with
``torch.distributed.isend`` / ``irecv`` (tagged, which only gloo uses), connects each direction
once before the first iteration, and offers :meth:`Transport.sync_point` where a device-wide
sync could happen. With the environment variable ``MEGATRON_CHIMERA_NCCL_SEMANTICS=1`` on the
gloo backend, :func:`make_transport` returns :class:`~.nccl_semantics.NcclSemanticsTransport`
instead, which enforces NCCL's rules that gloo forgives (tag-blind FIFO matching, a rendezvous
at the first exchange of each direction, device-wide syncs waiting for posted operations).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_chimera.parallel_state import nccl_semantics_requested
from megatron_chimera.pipeline.topology import PipelineTopology
from megatron_chimera.schedules.lowering import Message

PROBE = -1  # Message.direction of the one-time connection probe


class Transport:
    """torch.distributed point-to-point operations between pipeline ranks of one replica."""

    def __init__(self, topology: PipelineTopology, tag_of: Any = None) -> None:
        self.topology = topology
        self.connected: set[tuple[int, int]] = set()  # directions (pipeline ranks) warmed up
        tag = tag_of or (lambda message: 0)
        # the warm-up probe (direction PROBE) uses tag 0; it precedes every message of its pair
        self.tag_of = lambda message: 0 if message.direction == PROBE else tag(message)

    def group(self, src: int, dst: int) -> dist.ProcessGroup | None:
        """The group a message from global rank ``src`` to ``dst`` travels on (None: default)."""
        return self.topology.p2p_group(src, dst)

    def isend(self, tensor: torch.Tensor, message: Message) -> Any:
        """Start sending ``tensor`` (contiguous) as ``message``; returns its work handle."""
        src = self.topology.to_global_rank(message.src)
        dst = self.topology.to_global_rank(message.dst)
        return dist.isend(tensor, dst=dst, tag=self.tag_of(message), group=self.group(src, dst))

    def irecv(self, buffer: torch.Tensor, message: Message) -> Any:
        """Post the receive of ``message`` into ``buffer``; returns its work handle."""
        src = self.topology.to_global_rank(message.src)
        dst = self.topology.to_global_rank(message.dst)
        return dist.irecv(buffer, src=src, tag=self.tag_of(message), group=self.group(src, dst))

    def wait(self, work: Any, message: Message) -> None:
        """Block until the posted ``work`` of ``message`` completed."""
        work.wait()

    def connect(self, src: int, dst: int) -> None:
        """Exchange one tiny message from pipeline rank ``src`` to ``dst`` (blocking), so the
        connection of that direction exists before the first iteration. A direction this
        transport already connected is skipped: executors sharing it (training and evaluation,
        a schedule rebuilt at run time) connect only the directions that are new to it -- on
        both ends alike, since every rank connects in the same global order."""
        if (src, dst) in self.connected:
            return
        self.connected.add((src, dst))
        me = self.topology.pipeline_rank
        probe = torch.zeros(1, device=_device())
        message = Message(PROBE, 0, 0, 0, src, dst)
        if me == src:
            work = self.isend(probe, message)
        elif me == dst:
            work = self.irecv(probe, message)
        else:
            return
        self.wait(work, message)

    def begin_iteration(self) -> None:
        """An iteration starts (no-op here)."""

    def sync_point(self, where: str) -> None:
        """A point where a device-wide sync may happen (no-op: the real device decides)."""


def _device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_transport(topology: PipelineTopology, tag_of: Any = None) -> Transport:
    """The transport of this process: NCCL semantics on gloo when requested, else plain."""
    if nccl_semantics_requested() and dist.is_initialized() and dist.get_backend() == "gloo":
        from megatron_chimera.pipeline.nccl_semantics import NcclSemanticsTransport

        return NcclSemanticsTransport(topology)
    return Transport(topology, tag_of)
