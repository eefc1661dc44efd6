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
