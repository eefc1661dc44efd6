"""Point-to-point transfer of activations and gradients between pipe neighbours.

Every message of an iteration is known in advance from the schedule: the forward ``F(p, s, m)``
sends the activation of micro-batch ``m`` from stage ``s`` to stage ``s+1`` of pipe ``p``, and the
backward ``B(p, s, m)`` sends the gradient from stage ``s`` to stage ``s-1``. So:

* **Tags** are ``((stage * P + pipe) * N + microbatch) * 2 + direction`` (``stage`` = the lower
  stage of the edge), unique within an iteration: the up to four flows between two ranks (two
  pipes x activation/gradient) never mix on backends that match by tag (gloo).
* **Posting order**: NCCL ignores tags and matches in posting order per pair of ranks, so between
  any two ranks the receiver posts its receives in exactly the order the sender posts its sends
  (the sender's action order, which both ranks derive from the schedule). A receive is posted
  early (``prefetch``: when an upcoming action will need it), together with every earlier message
  from the same sender that is not yet posted.
* **Shapes** come from the configuration (``[seq, micro_batch, hidden]``): no handshake.
* With NCCL each direction between two ranks has its own 2-rank group
  (``parallel_state.get_p2p_group``), so a send queued behind another on one stream can never
  block the opposite flow.
* Sends are non-blocking; :meth:`P2PCommunicator.finish` waits for them at the end of the iteration.
  A message between two stages on the same rank is handed over locally (a copy).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_chimera.pipeline.topology import PipelineTopology
from megatron_chimera.schedules.actions import FORWARD, Action, Schedule, input_of, output_to

ACTIVATION = 0
GRADIENT = 1


@dataclass(frozen=True)
class Message:
    """One activation (``stage -> stage+1``) or gradient (``stage+1 -> stage``) transfer."""

    direction: int
    pipe: int
    microbatch: int
    stage: int  # the lower stage of the edge
    src: int  # pipeline rank of the sender
    dst: int  # pipeline rank of the receiver

    def tag(self, num_pipes: int, num_microbatches: int) -> int:
        """Backend tag, unique per message within one iteration."""
        return ((self.stage * num_pipes + self.pipe) * num_microbatches + self.microbatch) * 2 + (
            self.direction
        )


def _message(producer: Action, schedule: Schedule) -> Message:
    """The transfer of ``producer``'s output to the next stage (F) or the previous stage (B)."""
    p, s, m = producer.pipe, producer.stage, producer.microbatch
    if producer.kind == FORWARD:
        return Message(ACTIVATION, p, m, s, schedule.rank_of(p, s), schedule.rank_of(p, s + 1))
    return Message(GRADIENT, p, m, s - 1, schedule.rank_of(p, s), schedule.rank_of(p, s - 1))


def produced_message(schedule: Schedule, action: Action) -> Message | None:
    """The message ``action`` sends when it finishes (None at the pipe ends and for W)."""
    if output_to(action, schedule.num_stages) is None:
        return None
    return _message(action, schedule)


def needed_message(schedule: Schedule, action: Action) -> Message | None:
    """The message ``action`` must receive before it runs (None when its input is produced on
    its own stage: F of stage 0, B of the last stage, W)."""
    producer = input_of(action, schedule.num_stages)
    if producer is None or producer.stage == action.stage:
        return None
    return _message(producer, schedule)


def iteration_actions(schedule: Schedule, rank: int, forward_only: bool = False) -> list[Action]:
    """``rank``'s actions for one iteration (only the forwards in forward-only mode)."""
    actions = schedule.actions[rank]
    return [a for a in actions if a.kind == FORWARD] if forward_only else list(actions)


def sends_in_order(schedule: Schedule, rank: int, forward_only: bool = False) -> list[Message]:
    """Messages ``rank`` sends in one iteration, in its posting order."""
    actions = iteration_actions(schedule, rank, forward_only)
    produced = (produced_message(schedule, a) for a in actions)
    return [m for m in produced if m is not None]


class P2PCommunicator:
    """Posts one iteration's sends and receives for one pipeline rank, in schedule-derived order."""

    def __init__(
        self,
        schedule: Schedule,
        pipeline_rank: int,
        tensor_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        topology: PipelineTopology | None = None,
        forward_only: bool = False,
    ) -> None:
        topology = topology or PipelineTopology.standalone(pipeline_rank)
        if topology.pipeline_rank != pipeline_rank:
            raise ValueError(f"topology is of pipeline rank {topology.pipeline_rank}, "
                             f"not {pipeline_rank}")
        self.schedule = schedule
        self.rank = pipeline_rank
        self.tensor_shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self.to_global_rank = topology.to_global_rank
        self.group_for = topology.p2p_group
        self._pending_recv: dict[int, deque[Message]] = {}
        for peer in range(schedule.num_ranks):
            if peer == pipeline_rank:
                continue
            sent = sends_in_order(schedule, peer, forward_only)
            incoming = [m for m in sent if m.dst == self.rank]
            if incoming:
                self._pending_recv[peer] = deque(incoming)
        self._posted: dict[Message, tuple[torch.Tensor, dist.Work]] = {}
        self._local: dict[Message, torch.Tensor] = {}
        self._sends: list[tuple[torch.Tensor, dist.Work]] = []

    def _tag(self, message: Message) -> int:
        return message.tag(self.schedule.num_pipes, self.schedule.num_microbatches)

    def prefetch(self, action: Action) -> None:
        """Post the receive ``action`` needs, and every earlier one from the same sender."""
        message = needed_message(self.schedule, action)
        if message is None or message.src == self.rank or message in self._posted:
            return
        queue = self._pending_recv.get(message.src)
        if not queue or message not in queue:
            raise RuntimeError(f"pipeline rank {self.rank}: no receive planned for {message}")
        while True:
            nxt = queue.popleft()
            buffer = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)
            src, me = self.to_global_rank(nxt.src), self.to_global_rank(self.rank)
            work = dist.irecv(buffer, src=src, tag=self._tag(nxt), group=self.group_for(src, me))
            self._posted[nxt] = (buffer, work)
            if nxt == message:
                return

    def recv(self, action: Action) -> torch.Tensor:
        """Wait for and return the tensor ``action`` needs (posting its receive if not yet done)."""
        message = needed_message(self.schedule, action)
        if message is None:
            raise RuntimeError(f"{action.short()} receives nothing")
        if message.src == self.rank:
            return self._local.pop(message)
        self.prefetch(action)
        buffer, work = self._posted.pop(message)
        work.wait()
        return buffer

    def send(self, action: Action, tensor: torch.Tensor) -> dist.Work | None:
        """Start sending what ``action`` produced; returns the send's work (None if local)."""
        message = produced_message(self.schedule, action)
        if message is None:
            raise RuntimeError(f"{action.short()} sends nothing")
        if tuple(tensor.shape) != self.tensor_shape or tensor.dtype != self.dtype:
            raise RuntimeError(
                f"{action.short()}: tensor {tuple(tensor.shape)} {tensor.dtype} does not match the "
                f"configured p2p shape {self.tensor_shape} {self.dtype}"
            )
        if message.dst == self.rank:
            self._local[message] = tensor.detach().clone()
            return None
        payload = tensor.detach().contiguous()
        me, dst = self.to_global_rank(self.rank), self.to_global_rank(message.dst)
        work = dist.isend(payload, dst=dst, tag=self._tag(message), group=self.group_for(me, dst))
        self._sends.append((payload, work))
        return work

    def release_completed_sends(self) -> None:
        """Drop the buffers of the oldest sends that have completed (lets freed outputs really be
        freed). Gloo reports completion only through ``wait``, so there they stay to the end."""
        done = 0
        while done < len(self._sends) and self._sends[done][1].is_completed():
            done += 1
        del self._sends[:done]

    def finish(self) -> None:
        """Wait for every send of the iteration; every planned receive must have been consumed."""
        for _, work in self._sends:
            work.wait()
        self._sends.clear()
        leftover = [m for q in self._pending_recv.values() for m in q] + list(self._posted)
        if leftover or self._local:
            raise RuntimeError(
                f"pipeline rank {self.rank}: {len(leftover) + len(self._local)} messages of the "
                f"iteration were never consumed (first: {(leftover or list(self._local))[0]})"
            )
