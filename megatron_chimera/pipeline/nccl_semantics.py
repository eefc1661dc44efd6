"""NCCL's point-to-point rules on the gloo backend, so CPU tests catch what only NCCL would hang on.

gloo forgives three things NCCL does not; :class:`NcclSemanticsTransport` takes them away:

1. **Tags are ignored**: every message of a pair uses tag 0, so messages match in issue order
   only; a header sent ahead of each payload names the message, and a receive that gets another
   message than it expects fails naming both.
2. **The first exchange in each direction is a rendezvous**: the first send of a direction blocks
   until the receiver has posted its first receive of that direction, and vice versa.
3. **A posted operation sits on the device**: a device-wide sync (the allocator's free-and-retry
   on OOM, ``empty_cache``, ``synchronize``) waits until every posted send and receive of this
   rank is matched by its peer, and every gradient collective it issued (stage-replica and
   embedding reductions, :meth:`collective_issued`) is issued by every member of its group.
   :meth:`sync_point` -- called before every compute action -- waits exactly so. It models
   one rank syncing while the others run: in each iteration one rank, in turn, syncs at every
   point (two simultaneous syncs, e.g. two OOMs at once, are out of scope; NCCL's watchdog
   timeout bounds them). The static check
   (:func:`~megatron_chimera.schedules.validate.validate_lowered`) covers every rank and point
   exhaustively; this one tests the executor that runs the lists.

Who has posted what is published in the c10d store (per direction: sends and receives posted);
every wait has a short deadline (``MEGATRON_CHIMERA_NCCL_SEMANTICS_TIMEOUT``, default 10 s), after
which the wait fails with a deadlock report naming this rank, its operation, and what the peer
is doing. Enable with ``MEGATRON_CHIMERA_NCCL_SEMANTICS=1`` (see
:func:`~.executor.make_transport`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_chimera.pipeline.failures import PipelineFailure, first_failure
from megatron_chimera.pipeline.topology import PipelineTopology
from megatron_chimera.pipeline.transport import Transport
from megatron_chimera.schedules.lowering import Message

TIMEOUT_ENV = "MEGATRON_CHIMERA_NCCL_SEMANTICS_TIMEOUT"
_POLL_S = 0.005


class NcclDeadlock(PipelineFailure):
    """A wait NCCL would block on forever: the message names the ranks and their operations."""


class _Sent:
    """A send's header and payload works (the header tensor kept alive until both finished)."""

    def __init__(self, header_work: Any, header: torch.Tensor, work: Any) -> None:
        self.header_work, self.header, self.work = header_work, header, work

    def wait(self) -> None:
        """Wait for the header and the payload."""
        self.header_work.wait()
        self.work.wait()

    def is_completed(self) -> bool:
        """Completion as gloo reports it (only after :meth:`wait`)."""
        return self.work.is_completed()


def _header(message: Message) -> torch.Tensor:
    return torch.tensor([message.direction, message.pipe, message.microbatch, message.stage],
                        dtype=torch.int64)


class NcclSemanticsTransport(Transport):
    """gloo point-to-point with NCCL's matching, first-exchange rendezvous and sync semantics."""

    def __init__(self, topology: PipelineTopology) -> None:
        super().__init__(topology, tag_of=lambda message: 0)
        self.store = dist.distributed_c10d._get_default_store()
        self.timeout_s = float(os.environ.get(TIMEOUT_ENV, "10"))
        me = topology.global_rank
        # every rank creates its transports in the same sequence: the epoch names this one
        self.epoch = self.store.add(f"ncclsem/epoch/{me}", 1)
        self.prefix = f"ncclsem/{self.epoch}"
        self.iteration = 0
        self.syncing = False
        self.counts: dict[tuple[str, int, int], int] = {}  # (op, src, dst) -> posted so far
        self.pending: list[tuple[str, int, int, int, str]] = []  # op, src, dst, k, label
        self.awaiting: tuple[int, str] | None = None  # (peer, why) while waiting for a peer
        # issued gradient collectives: group name, its global ranks, count k, label
        self.pending_collectives: list[tuple[str, list[int], int, str]] = []
        self._where("started")

    # ----------------------------------------------------------------------------- bookkeeping
    def _key(self, op: str, src: int, dst: int) -> str:
        group = self.group(src, dst)
        name = "default" if group is None else group.group_name
        return f"{self.prefix}/{name}/{src}->{dst}/{op}"

    def _where(self, text: str) -> None:
        self.store.set(f"{self.prefix}/where/{self.topology.global_rank}", text)

    def _peer_where(self, rank: int) -> str:
        key = f"{self.prefix}/where/{rank}"
        if not self.store.check([key]):
            return "(not started)"
        return self.store.get(key).decode()

    def _post(self, op: str, message: Message) -> tuple[int, int, int]:
        src = self.topology.to_global_rank(message.src)
        dst = self.topology.to_global_rank(message.dst)
        k = self.counts.get((op, src, dst), 0) + 1
        self.counts[(op, src, dst)] = k
        self.store.add(self._key(op, src, dst), 1)
        return src, dst, k

    def _posted_by_peer(self, op: str, src: int, dst: int) -> int:
        """How many ``op`` (send / recv) the peer has posted on ``src -> dst``."""
        return self.store.add(self._key(op, src, dst), 0)

    def _await(self, counterpart: str, src: int, dst: int, k: int, why: str) -> None:
        """Wait until the peer posted its ``k``-th ``counterpart`` on ``src -> dst``; a failure
        recorded by any rank ends the wait at once (naming that rank)."""
        if self._posted_by_peer(counterpart, src, dst) >= k:
            return
        peer = dst if counterpart == "recv" else src
        self._where(why)
        self._wait_until(lambda: self._posted_by_peer(counterpart, src, dst) >= k, why, peer,
                         f"to post its {counterpart} #{k} of {src}->{dst}")

    def _wait_until(self, done, why: str, peer: int, what: str) -> None:
        """Poll ``done()`` until it holds; a failure recorded by any rank ends the wait at once
        (naming that rank), the deadline with a deadlock report naming ``peer`` and ``what``
        this rank waits for it to do."""
        me = self.topology.global_rank
        deadline = time.monotonic() + self.timeout_s
        self.awaiting = (peer, why)  # read by the hang watch (pipeline/hang.py)
        while not done():
            first = first_failure(wait_seconds=0.0)
            if first is not None:
                raise PipelineFailure(f"{first}; rank {me} stopped while it {why}")
            if time.monotonic() > deadline:
                raise NcclDeadlock(
                    f"NCCL-semantics deadlock: rank {me} {why}, waiting {self.timeout_s:g} s for "
                    f"rank {peer} {what}; rank {peer} is at: {self._peer_where(peer)}")
            time.sleep(_POLL_S)
        self.awaiting = None

    # ---------------------------------------------------------------------------- collectives
    def collective_issued(self, group: dist.ProcessGroup, label: str) -> None:
        """This rank issued a gradient collective on ``group``: count it in the store (per
        group and rank, over the whole run, whichever transport is running) and remember it
        for this rank's next sync point."""
        me = self.topology.global_rank
        k = self.store.add(f"ncclsem/coll/{group.group_name}/{me}", 1)
        members = dist.get_process_group_ranks(group)
        self.pending_collectives.append((group.group_name, members, k, label))

    def _await_collective(self, name: str, members: list[int], k: int, why: str) -> None:
        """Wait until every member of group ``name`` issued its ``k``-th collective on it."""
        for member in members:
            key = f"ncclsem/coll/{name}/{member}"
            self._wait_until(lambda key=key: self.store.add(key, 0) >= k, why, member,
                             f"to issue collective #{k} of its group {members}")

    # ----------------------------------------------------------------------------- transport
    has_sync_points = True
    post = Transport.post_each  # through the isend / irecv below

    def isend(self, tensor: torch.Tensor, message: Message) -> Any:
        """Header then payload, tag 0; the first send of a direction is a rendezvous."""
        src, dst, k = self._post("send", message)
        label = f"sends {message.short()} to rank {dst}"
        if k == 1:
            self._await("recv", src, dst, 1, f"{label} (first exchange of {src}->{dst})")
        group = self.group(src, dst)
        header = _header(message)
        header_work = dist.isend(header, dst=dst, tag=0, group=group)
        work = dist.isend(tensor, dst=dst, tag=0, group=group)
        self.pending.append(("recv", src, dst, k, label))
        return _Sent(header_work, header, work)

    def irecv(self, buffer: torch.Tensor, message: Message) -> Any:
        """Header then payload, tag 0; the first receive of a direction is a rendezvous."""
        src, dst, k = self._post("recv", message)
        label = f"receives {message.short()} from rank {src}"
        if k == 1:
            self._await("send", src, dst, 1, f"{label} (first exchange of {src}->{dst})")
        group = self.group(src, dst)
        header = torch.empty(4, dtype=torch.int64)
        header_work = dist.irecv(header, src=src, tag=0, group=group)
        work = dist.irecv(buffer, src=src, tag=0, group=group)
        self.pending.append(("send", src, dst, k, label))
        return (header_work, header, work)

    def wait(self, work: Any, message: Message) -> None:
        """Wait for a send, or for a receive's header and payload (and check the header)."""
        if isinstance(work, _Sent):
            work.wait()
            return
        header_work, header, payload_work = work
        header_work.wait()
        got = tuple(int(x) for x in header)
        expected = (message.direction, message.pipe, message.microbatch, message.stage)
        if got != expected:
            raise PipelineFailure(
                f"NCCL-semantics: rank {self.topology.global_rank} received message "
                f"{got} from rank {self.topology.to_global_rank(message.src)} where it expected "
                f"{message.short()} {expected}: sends and receives of the pair are posted in "
                f"different orders (NCCL ignores tags and matches in issue order)")
        payload_work.wait()

    def begin_iteration(self) -> None:
        """A new iteration: the next rank in turn is the one that syncs at every point."""
        world = dist.get_world_size()
        self.syncing = (self.epoch + self.iteration) % world == self.topology.global_rank
        self.iteration += 1
        self.pending_collectives.clear()  # the last iteration waited for all of them

    def sync_point(self, where: str) -> None:
        """A device-wide sync here (on the syncing rank of this iteration): wait until every
        posted operation of this rank is matched."""
        if not self.syncing:
            if len(self.pending) > 64:  # forget what is surely matched by now
                self.pending = [entry for entry in self.pending
                                if self._posted_by_peer(*entry[:3]) < entry[3]]
            return
        for counterpart, src, dst, k, label in self.pending:
            self._await(counterpart, src, dst, k,
                        f"syncs the device before {where} while it {label}")
        self.pending.clear()
        for name, members, k, label in self.pending_collectives:
            self._await_collective(name, members, k,
                                   f"syncs the device before {where} after it issued the {label}")
        self.pending_collectives.clear()
        self._where(f"runs {where}")
