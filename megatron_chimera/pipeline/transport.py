"""How point-to-point messages move: torch.distributed, or the same under NCCL's rules for tests.

:class:`Transport` posts the sends and receives of a lowered schedule, connects each direction
once before the first iteration, and offers :meth:`Transport.sync_point` where a device-wide
sync could happen. With the environment variable ``MEGATRON_CHIMERA_NCCL_SEMANTICS=1`` on the
gloo backend, :func:`~.executor.make_transport` returns
:class:`~.nccl_semantics.NcclSemanticsTransport` instead, which enforces NCCL's rules that gloo
forgives (tag-blind FIFO matching, a rendezvous at the first exchange of each direction,
device-wide syncs waiting for posted operations).

The hot path is short: the process group, the peer's rank in it and the tag are worked out once
per message (:class:`Address`, cached: an iteration's messages recur in every iteration), and
operations go straight to the group's ``send`` / ``recv`` -- what ``torch.distributed.isend`` /
``irecv`` end in, without their per-call argument checks. A batch
(:meth:`Transport.post`: the operations of one step with one peer, in the lowered order) is
posted operation by operation, each with its own work handle. It is deliberately not coalesced
into one NCCL group call (``batch_isend_irecv``): a coalesced batch completes as a whole, so the
consumer of its first message would also wait for the last one, which the peer may produce a
whole action later (Chimera's two flows share each direction); posted one by one, each consumer
waits for its own message only, and the host cost of an NCCL ``send`` / ``recv`` is a few
microseconds anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from megatron_chimera.pipeline.topology import PipelineTopology
from megatron_chimera.schedules.lowering import SEND, Message

PROBE = -1  # Message.direction of the one-time connection probe


class Address(NamedTuple):
    """Where one message goes on the wire: the process group, the peer's rank in it, the tag."""

    group: dist.ProcessGroup
    peer: int
    tag: int


class Transport:
    """torch.distributed point-to-point operations between pipeline ranks of one replica."""

    def __init__(self, topology: PipelineTopology, tag_of: Any = None) -> None:
        self.topology = topology
        self.connected: set[tuple[int, int]] = set()  # directions (pipeline ranks) warmed up
        tag = tag_of or (lambda message: 0)
        # the warm-up probe (direction PROBE) uses tag 0; it precedes every message of its pair
        self.tag_of = lambda message: 0 if message.direction == PROBE else tag(message)
        self._addresses: dict[Message, Address] = {}

    def group(self, src: int, dst: int) -> dist.ProcessGroup | None:
        """The group a message from global rank ``src`` to ``dst`` travels on (None: default)."""
        return self.topology.p2p_group(src, dst)

    def address(self, message: Message) -> Address:
        """Group, peer (its rank in the group) and tag of ``message``, worked out once per
        message."""
        address = self._addresses.get(message)
        if address is None:
            src = self.topology.to_global_rank(message.src)
            dst = self.topology.to_global_rank(message.dst)
            group = self.group(src, dst) or dist.group.WORLD
            peer = dst if self.topology.global_rank == src else src
            address = self._addresses[message] = Address(
                group, dist.get_group_rank(group, peer), self.tag_of(message))
        return address

    def isend(self, tensor: torch.Tensor, message: Message) -> Any:
        """Start sending ``tensor`` (contiguous) as ``message``; returns its work handle."""
        group, peer, tag = self.address(message)
        return group.send([tensor], peer, tag)

    def irecv(self, buffer: torch.Tensor, message: Message) -> Any:
        """Post the receive of ``message`` into ``buffer``; returns its work handle."""
        group, peer, tag = self.address(message)
        return group.recv([buffer], peer, tag)

    def post(self, op: str, messages: Sequence[Message], tensors: Sequence[torch.Tensor],
             ) -> list[Any]:
        """Post ``SEND`` or ``RECV`` ``op`` of ``messages`` (one step, one peer, in the lowered
        order) with ``tensors``, one operation each (see the module docstring for why not one
        coalesced call); returns their work handles. The loop is :meth:`isend` / :meth:`irecv`
        inlined (the executor's hot path); :meth:`post_each` is the plain form."""
        addresses, works = self._addresses, []
        for message, tensor in zip(messages, tensors):
            group, peer, tag = addresses.get(message) or self.address(message)
            works.append(group.send([tensor], peer, tag) if op == SEND
                         else group.recv([tensor], peer, tag))
        return works

    def post_each(self, op: str, messages: Sequence[Message], tensors: Sequence[torch.Tensor],
                  ) -> list[Any]:
        """:meth:`post` through :meth:`isend` / :meth:`irecv` (for transports that redefine
        them)."""
        post = self.isend if op == SEND else self.irecv
        return [post(t, m) for m, t in zip(messages, tensors)]

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

    #: whether :meth:`sync_point` does anything (the executor skips the call when not)
    has_sync_points = False
    #: called with (group, label) for every gradient collective the iteration issues, where a
    #: transport models what a device-wide sync waits for (None: nothing to model)
    collective_issued = None

    def sync_point(self, where: str) -> None:
        """A point where a device-wide sync may happen (no-op: the real device decides)."""


def _device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

