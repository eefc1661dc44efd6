"""The point-to-point side of the iterations: the receives and sends a lowered schedule posts.

The lowered lists (:mod:`megatron_chimera.schedules.lowering`) say when each ``RECV`` and
``SEND`` is posted, and the compiled program (:mod:`.program`) when each receive buffer is free
again; :class:`P2PCommunicator` keeps the buffers and work handles in between:

* ``post_recvs(ms)`` takes a buffer per message from the :class:`BufferPool` (shape and dtype of
  the message's direction from the configuration, no handshake) and posts the receives (one batch,
  :meth:`.transport.Transport.post`); ``take(m)`` waits for one and returns it;
  ``release(m)`` gives its buffer back to the pool once the program says nothing reads it.
* ``send(m, tensor)`` posts a send and keeps nothing of the tensor but the work handle: the
  backend holds the data until the send completed (NCCL stashes it on its stream, gloo in its
  work object), as Megatron's ``deallocate_output_tensor`` right after ``isend`` relies on. With
  ``free_when_sent`` (activations, whose ``grad_fn`` the backward still needs) the output's data
  is freed at once; a sent gradient is simply dropped by its last holder. :meth:`finish` waits
  for every send at the end of the iteration.
* A message between two stages on the same rank is handed over locally (``put_local``).
* Variable-length micro-batches (``--variable-seq-lengths``): :meth:`set_tokens` gives each
  micro-batch's sequence length for the iteration; every message's buffer is then sized by its
  own micro-batch (:meth:`spec_of`: the known shape of ``schedules/shapes.py``, no handshake),
  and pooled buffers of shapes the iteration does not use are dropped.

A buffer a pending send still reads (an output that is a view of the stage input) is given back
only at :meth:`finish`, so a later receive can never overwrite data in flight. Tags
(``Message.tag``) are unique within an iteration; NCCL ignores them and matches in issue order,
which the lowering keeps (the receiver posts in the sender's order).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from megatron_chimera.pipeline.transport import Transport
from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.lowering import (
    ACTIVATION,
    GRADIENT,
    RECV,
    SEND,
    Message,
    iteration_actions,
    needed_message,
    produced_message,
)

__all__ = ["P2PCommunicator", "BufferPool", "MessageSpec", "Message", "ACTIVATION", "GRADIENT",
           "needed_message", "produced_message", "iteration_actions", "sends_in_order"]


def sends_in_order(schedule: Schedule, rank: int, forward_only: bool = False) -> list[Message]:
    """Messages ``rank`` sends in one iteration, in its posting order."""
    produced = (produced_message(schedule, a)
                for a in iteration_actions(schedule, rank, forward_only))
    return [m for m in produced if m is not None]


class MessageSpec(NamedTuple):
    """Shape and dtype of the messages of one direction (activations, or gradients); a named
    tuple, so that the buffer pool's lookups hash it in C."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def uniform_specs(shape: Sequence[int], dtype: torch.dtype) -> dict[int, MessageSpec]:
    """The same shape and dtype for activations and gradients (no sequence parallelism)."""
    spec = MessageSpec(tuple(shape), dtype)
    return {ACTIVATION: spec, GRADIENT: spec}


class BufferPool:
    """Receive buffers reused across messages and iterations, one free list per spec."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: dict[MessageSpec, list[torch.Tensor]] = {}
        self.allocated = 0  # buffers created so far (the most ever in use at once)

    def trim(self, keep: set[MessageSpec]) -> None:
        """Drop the free buffers of every spec not in ``keep`` (variable shapes)."""
        for spec in [s for s in self._free if s not in keep]:
            del self._free[spec]

    def acquire(self, spec: MessageSpec) -> torch.Tensor:
        """A buffer of ``spec`` (contents undefined)."""
        free = self._free.get(spec)
        if free:
            return free.pop()
        self.allocated += 1
        return torch.empty(spec.shape, dtype=spec.dtype, device=self.device)

    def release(self, spec: MessageSpec, buffer: torch.Tensor) -> None:
        """Give ``buffer`` back: nothing reads or writes it any more."""
        self._free.setdefault(spec, []).append(buffer)


class _Received:
    """A posted receive: its pooled buffer, spec and work handle."""

    __slots__ = ("buffer", "spec", "work", "pinned")

    def __init__(self, buffer: torch.Tensor, spec: MessageSpec, work: Any) -> None:
        self.buffer, self.spec, self.work = buffer, spec, work
        self.pinned = False  # a pending send reads it: give it back at finish() only


class P2PCommunicator:
    """Buffers and work handles of the point-to-point messages of one rank (across iterations).

    ``specs`` gives each direction's shape and dtype (activations and gradients may differ, e.g.
    with sequence parallelism)."""

    def __init__(self, transport: Transport, specs: Mapping[int, MessageSpec],
                 device: torch.device | str = "cpu") -> None:
        self.transport = transport
        self.specs = dict(specs)
        self.device = torch.device(device)
        self.pool = BufferPool(self.device)
        self._posted: dict[Message, _Received] = {}  # posted, not yet taken
        self._in_use: dict[Message, _Received] = {}  # taken, not yet released
        self._by_storage: dict[int, Message] = {}  # data pointer of a buffer in use -> message
        self._local: dict[Message, torch.Tensor] = {}
        self._sends: list[tuple[Any, Message]] = []  # posted sends: work handle, message
        self.waiting: Message | None = None  # the message a take() waits for (hang forensics)
        self.bytes_sent = 0  # payload bytes of this iteration's sends (local hand-overs excluded)
        self.tokens: tuple[int, ...] | None = None  # per-micro-batch sequence lengths

    def set_tokens(self, tokens: Sequence[int] | None) -> None:
        """Size this iteration's messages by micro-batch: ``tokens[m]`` replaces the first
        (sequence) dimension of micro-batch ``m``'s messages; None: the configured shapes."""
        self.tokens = None if tokens is None else tuple(int(t) for t in tokens)
        if self.tokens is not None:
            self.pool.trim({self._sized(spec, t) for spec in self.specs.values()
                            for t in set(self.tokens)})

    @staticmethod
    def _sized(spec: MessageSpec, tokens: int) -> MessageSpec:
        return MessageSpec((tokens, *spec.shape[1:]), spec.dtype)

    def spec_of(self, message: Message) -> MessageSpec:
        """Shape and dtype of ``message``'s buffer: its direction's, with its micro-batch's
        sequence length when :meth:`set_tokens` gave them."""
        spec = self.specs[message.direction]
        if self.tokens is None:
            return spec
        return self._sized(spec, self.tokens[message.microbatch])

    def begin_iteration(self) -> None:
        """Start an iteration. Whatever a failed previous one left is dropped, not pooled (a
        receive into it may still be pending)."""
        self.bytes_sent = 0
        if self._posted or self._in_use or self._sends or self._local:
            self._posted.clear()
            self._in_use.clear()
            self._by_storage.clear()
            self._sends.clear()
            self._local.clear()

    # ------------------------------------------------------------------------ receiving
    def post_recvs(self, messages: Sequence[Message]) -> None:
        """Post the receives of ``messages`` (one step, one peer) as one batch."""
        specs = [self.spec_of(m) for m in messages]
        buffers = [self.pool.acquire(spec) for spec in specs]
        works = self.transport.post(RECV, messages, buffers)
        for message, buffer, spec, work in zip(messages, buffers, specs, works):
            self._posted[message] = _Received(buffer, spec, work)

    def take(self, message: Message) -> torch.Tensor:
        """The tensor of ``message``: waited for if received, handed over if local. A received
        one is a fresh alias of its pooled buffer (no autograd state carried over)."""
        local = self._local.pop(message, None)
        if local is not None:
            return local
        received = self._posted.pop(message, None)
        if received is None:
            raise RuntimeError(f"{message.short()} is consumed before its receive is posted: "
                               f"the lowered list is out of order")
        self.waiting = message
        self.transport.wait(received.work, message)
        self.waiting = None
        self._in_use[message] = received
        self._by_storage[received.buffer.data_ptr()] = message
        return received.buffer.detach()

    def release(self, message: Message) -> None:
        """``message``'s buffer is read no more: back to the pool (at :meth:`finish` if a
        pending send still reads it). No-op for local hand-overs."""
        received = self._in_use.get(message)
        if received is None or received.pinned:
            return
        del self._in_use[message]
        del self._by_storage[received.buffer.data_ptr()]
        self.pool.release(received.spec, received.buffer)

    def put_local(self, message: Message, tensor: torch.Tensor) -> None:
        """Hand ``message`` over to a stage on this rank (a detached copy)."""
        self._local[message] = tensor.detach().clone()

    # -------------------------------------------------------------------------- sending
    def send(self, message: Message, tensor: torch.Tensor, free_when_sent: bool = False) -> None:
        """Post the send of ``tensor`` as ``message``; with ``free_when_sent`` its data is freed
        (``deallocate_output_tensor``) once the send completed."""
        spec = self.spec_of(message)
        if tensor.shape != spec.shape or tensor.dtype != spec.dtype:
            raise RuntimeError(
                f"{message.short()}: tensor {tuple(tensor.shape)} {tensor.dtype} does not match "
                f"the configured p2p shape {spec.shape} {spec.dtype}")
        payload = tensor.detach().contiguous()
        aliased = self._by_storage.get(payload.untyped_storage().data_ptr())
        if aliased is not None:  # the output is a view of a received buffer
            self._in_use[aliased].pinned = True
        (work,) = self.transport.post(SEND, (message,), (payload,))
        self.bytes_sent += payload.numel() * payload.element_size()
        self._sends.append((work, message))
        if free_when_sent:  # the work holds the data until sent; the graph keeps grad_fn only
            deallocate_output_tensor(tensor)

    # ------------------------------------------------------------------------ iteration end
    def finish(self) -> None:
        """Wait for every send of the iteration and give every buffer back; every posted
        receive must have been consumed."""
        for work, message in self._sends:
            self.transport.wait(work, message)
        self._sends.clear()
        for received in self._in_use.values():
            self.pool.release(received.spec, received.buffer)
        self._in_use.clear()
        self._by_storage.clear()
        leftover = list(self._posted) + list(self._local)
        if leftover:
            raise RuntimeError(f"{len(leftover)} messages of the iteration were never consumed "
                               f"(first: {leftover[0].short()})")


def deallocate_output_tensor(output: torch.Tensor) -> None:
    """Megatron's trick: free an output's data once sent, keeping its ``grad_fn`` for backward."""
    output.data = torch.empty((1,), device=output.device, dtype=output.dtype)
