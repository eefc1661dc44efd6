"""The point-to-point side of one iteration: the receives and sends a lowered schedule posts.

The lowered lists (:mod:`megatron_chimera.schedules.lowering`) say when each ``RECV`` and
``SEND`` is posted; :class:`P2PCommunicator` keeps their buffers and work handles between the
post and the compute action that consumes or produced the message:

* ``post_recv(m)`` allocates the buffer (shape and dtype from the configuration, no handshake)
  and posts the receive; ``take(m)`` waits for it and returns the tensor.
* ``send(m, tensor)`` posts the send; outputs whose sends completed can be freed (Megatron's
  ``deallocate_output_tensor``), and :meth:`finish` waits for every send at the end.
* A message between two stages on the same rank is handed over locally (``put_local``).

Tags (``Message.tag``) are unique within an iteration; NCCL ignores them and matches in issue
order, which the lowering keeps (the receiver posts in the sender's order).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_chimera.pipeline.transport import Transport
from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.lowering import (
    ACTIVATION,
    GRADIENT,
    Message,
    iteration_actions,
    needed_message,
    produced_message,
)

__all__ = ["P2PCommunicator", "Message", "ACTIVATION", "GRADIENT", "needed_message",
           "produced_message", "iteration_actions", "sends_in_order"]


def sends_in_order(schedule: Schedule, rank: int, forward_only: bool = False) -> list[Message]:
    """Messages ``rank`` sends in one iteration, in its posting order."""
    produced = (produced_message(schedule, a)
                for a in iteration_actions(schedule, rank, forward_only))
    return [m for m in produced if m is not None]


class P2PCommunicator:
    """Buffers and work handles of one iteration's point-to-point messages on one rank."""

    def __init__(self, transport: Transport, tensor_shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.transport = transport
        self.tensor_shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self._posted: dict[Message, tuple[torch.Tensor, Any]] = {}
        self._local: dict[Message, torch.Tensor] = {}
        self._sends: list[tuple[torch.Tensor, Any, Message]] = []
        self.bytes_sent = 0  # payload bytes of this iteration's sends (local hand-overs excluded)

    def post_recv(self, message: Message) -> None:
        """Post the receive of ``message`` (its buffer comes from the configured shape)."""
        buffer = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)
        self._posted[message] = (buffer, self.transport.irecv(buffer, message))

    def take(self, message: Message) -> torch.Tensor:
        """The tensor of ``message``: waited for if received, handed over if local."""
        if message in self._local:
            return self._local.pop(message)
        try:
            buffer, work = self._posted.pop(message)
        except KeyError:
            raise RuntimeError(f"{message.short()} is consumed before its receive is posted: "
                               f"the lowered list is out of order") from None
        self.transport.wait(work, message)
        return buffer

    def put_local(self, message: Message, tensor: torch.Tensor) -> None:
        """Hand ``message`` over to a stage on this rank (a detached copy)."""
        self._local[message] = tensor.detach().clone()

    def send(self, message: Message, tensor: torch.Tensor) -> Any:
        """Post the send of ``tensor`` as ``message``; returns its work handle."""
        if tuple(tensor.shape) != self.tensor_shape or tensor.dtype != self.dtype:
            raise RuntimeError(
                f"{message.short()}: tensor {tuple(tensor.shape)} {tensor.dtype} does not match "
                f"the configured p2p shape {self.tensor_shape} {self.dtype}")
        payload = tensor.detach().contiguous()
        work = self.transport.isend(payload, message)
        self.bytes_sent += payload.numel() * payload.element_size()
        self._sends.append((payload, work, message))
        return work

    def release_completed_sends(self) -> None:
        """Drop the buffers of the oldest sends that have completed (lets freed outputs really be
        freed). Gloo reports completion only through ``wait``, so there they stay to the end."""
        done = 0
        while done < len(self._sends) and self._sends[done][1].is_completed():
            done += 1
        del self._sends[:done]

    def finish(self) -> None:
        """Wait for every send of the iteration; every posted receive must have been consumed."""
        for _, work, message in self._sends:
            self.transport.wait(work, message)
        self._sends.clear()
        leftover = list(self._posted) + list(self._local)
        if leftover:
            raise RuntimeError(f"{len(leftover)} messages of the iteration were never consumed "
                               f"(first: {leftover[0].short()})")
