"""What the point-to-point communicator keeps of a sent tensor: nothing but the work handle.

Megatron frees a pipeline output's data right after posting its send (the backend holds the
payload until sent); a sent gradient is dropped by its last holder. A stand-in transport records
the payloads it was given, so the test can check that what goes out is the original data while
the communicator's own references are gone.
"""

from __future__ import annotations

import gc
import weakref

import torch

from megatron_chimera.pipeline.p2p import P2PCommunicator, uniform_specs
from megatron_chimera.schedules.lowering import ACTIVATION, GRADIENT, SEND, Message


class _RecordingTransport:
    """Posts nothing; keeps each payload it is handed (as a backend's work object would)."""

    def __init__(self) -> None:
        self.payloads: list[torch.Tensor] = []
        self.waited: list[Message] = []

    def post(self, op, messages, tensors):
        assert op == SEND
        self.payloads += [t.clone() for t in tensors]  # what went out, by value
        return [object() for _ in messages]

    def wait(self, work, message) -> None:
        self.waited.append(message)


def _message(direction: int, microbatch: int) -> Message:
    return Message(direction, pipe=0, microbatch=microbatch, stage=0, src=0, dst=1)


def test_an_activation_is_freed_when_its_send_is_posted_and_keeps_its_graph():
    transport = _RecordingTransport()
    comm = P2PCommunicator(transport, uniform_specs((2, 3), torch.float32))
    x = torch.randn(2, 3, requires_grad=True)
    output = x * 2
    expected = output.detach().clone()
    comm.send(_message(ACTIVATION, 0), output, free_when_sent=True)
    assert output.numel() == 1  # freed now, not at the iteration's end
    assert output.grad_fn is not None  # the backward still finds its graph
    torch.testing.assert_close(transport.payloads[0], expected)
    comm.finish()
    assert transport.waited == [_message(ACTIVATION, 0)]


def test_a_sent_gradient_is_not_held_by_the_communicator():
    transport = _RecordingTransport()
    comm = P2PCommunicator(transport, uniform_specs((2, 3), torch.float32))
    grad = torch.randn(2, 3)
    alive = weakref.ref(grad)
    comm.send(_message(GRADIENT, 1), grad)
    del grad
    gc.collect()
    assert alive() is None  # only the backend (here: its recorded copy) holds the data
    assert comm.bytes_sent == 2 * 3 * 4
    comm.finish()


class _AnyTransport(_RecordingTransport):
    """Accepts receives too (their buffers are recorded, nothing arrives)."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[torch.Tensor] = []

    def post(self, op, messages, tensors):
        if op == SEND:
            return super().post(op, messages, tensors)
        self.received += list(tensors)
        return [object() for _ in messages]


def test_variable_length_messages_are_sized_by_their_micro_batch():
    """set_tokens: each receive buffer has its micro-batch's length, a send of another length is
    refused naming the message, and pooled buffers of unused lengths are dropped."""
    transport = _AnyTransport()
    comm = P2PCommunicator(transport, uniform_specs((4, 1, 3), torch.float32))
    comm.set_tokens([5, 2, 7])
    comm.post_recvs([_message(ACTIVATION, m) for m in range(3)])
    assert [tuple(b.shape) for b in transport.received] == [(5, 1, 3), (2, 1, 3), (7, 1, 3)]
    for m in range(3):
        comm.take(_message(ACTIVATION, m))
        comm.release(_message(ACTIVATION, m))
    comm.send(_message(GRADIENT, 2), torch.zeros(7, 1, 3))
    try:
        comm.send(_message(GRADIENT, 0), torch.zeros(7, 1, 3))
    except RuntimeError as exc:
        assert "(7, 1, 3)" in str(exc) and "(5, 1, 3)" in str(exc)
    else:
        raise AssertionError("a send of the wrong length was accepted")
    comm.finish()
    comm.set_tokens([2, 2, 9])  # 5 and 7 unused now: their free buffers go
    assert {spec.shape for spec in comm.pool._free} == {(2, 1, 3)}
    comm.set_tokens(None)
    assert comm.spec_of(_message(ACTIVATION, 1)).shape == (4, 1, 3)
