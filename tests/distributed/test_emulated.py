"""Emulated-compute stages: each action waits the configured time (single process).

``time.sleep`` is replaced by a recorder on a fake clock (sleeping advances it, reading it
barely does) and the final spin is switched off, so the tests check which waits each action
requests without depending on the machine's load.
"""

from __future__ import annotations

import pytest
import torch

from megatron_chimera.model.linear import defer_weight_grad
from megatron_chimera.pipeline import emulated, emulated_moe
from megatron_chimera.pipeline.emulated import (
    EmulatedCosts,
    EmulatedStage,
    EmulatedTorchStage,
    SleepingWeightGradStore,
    emulated_forward_step,
    mse_then_wait,
)
from megatron_chimera.pipeline.trace import END, START, Timeline

pytestmark = pytest.mark.timeout(30)
COSTS = EmulatedCosts(forward_s=0.02, backward_s=0.06, weight_s=0.04)


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """The durations the emulated modules asked to sleep, in order (real work takes no time on
    the fake clock, so a deadline-based sleep asks for the whole time)."""
    recorded: list[float] = []
    now = [0.0]

    def sleep(seconds: float) -> None:
        recorded.append(seconds)
        now[0] += seconds

    def perf_counter() -> float:
        now[0] += 1e-12  # reading the clock takes a moment, so a spin ends
        return now[0]

    monkeypatch.setattr(emulated.time, "sleep", sleep)
    monkeypatch.setattr(emulated.time, "perf_counter", perf_counter)
    monkeypatch.setattr(emulated, "SPIN_S", 0.0)
    return recorded


def test_forward_and_full_backward_wait_their_times(sleeps):
    """F waits forward_s; an ordinary backward waits the whole backward_s."""
    stage = EmulatedStage(COSTS, pre_process=True, post_process=True)
    out = stage(torch.randn(3, 2, 4))
    assert sleeps == [pytest.approx(COSTS.forward_s)]
    out.mean().backward()
    assert sleeps == [pytest.approx(COSTS.forward_s), pytest.approx(COSTS.backward_s)]
    assert stage.linear.weight.grad is not None


def test_split_backward_waits_input_then_weight_time(sleeps):
    """Under defer_weight_grad B waits backward - weight; the store's flush (W) waits weight_s."""
    stage = EmulatedStage(COSTS, pre_process=True, post_process=True)
    store = SleepingWeightGradStore()
    out = stage(torch.randn(3, 2, 4))
    with defer_weight_grad(stage, store):
        out.mean().backward()
    assert sleeps[1:] == [pytest.approx(COSTS.input_grad_s)]
    assert stage.linear.weight.grad is None and len(store) == 1
    store.flush()
    assert sleeps[2:] == [pytest.approx(COSTS.weight_s)]
    assert stage.linear.weight.grad is not None


def test_torch_stage_separates_input_and_weight_gradients(sleeps):
    """Input gradient alone waits input_grad_s; the weight branch alone waits weight_s."""
    stage = EmulatedTorchStage(COSTS, is_first=False)
    x = torch.randn(2, 3, 4, requires_grad=True)
    out = stage(x)
    torch.autograd.grad(out.sum(), x, retain_graph=True)
    assert sleeps[1:] == [pytest.approx(COSTS.input_grad_s)]
    torch.autograd.grad(out.sum(), stage.weight)
    assert sleeps[2:] == [pytest.approx(COSTS.weight_s)]


def test_first_torch_stage_backward_still_waits(sleeps):
    """Stage 0's input needs no gradient; its full backward still waits the whole backward, in
    one wait at the end of the pass (the two branches' times add up)."""
    stage = EmulatedTorchStage(COSTS, is_first=True)
    stage(torch.randn(2, 3, 4)).sum().backward()
    assert sleeps[1:] == [pytest.approx(COSTS.backward_s)]


def test_a_failed_backward_does_not_break_the_next_one(sleeps):
    """A backward pass that fails after a node queued its wait never runs the wait; the next
    forward forgets it, so the next backward waits its time again."""
    stage = EmulatedTorchStage(COSTS, is_first=False)
    x = torch.randn(2, 3, 4, requires_grad=True)
    handle = x.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(RuntimeError, match="injected"):
        torch.autograd.grad(stage(x).sum(), x)
    handle.remove()
    del sleeps[:]
    torch.autograd.grad(stage(x).sum(), x)
    assert sleeps[1:] == [pytest.approx(COSTS.input_grad_s)]


def test_the_loss_is_inside_the_forward_time(sleeps):
    """At the last stage the forward's wait comes after the loss (emulated_forward_step's loss
    function waits); any other stage waits in its forward."""
    last = EmulatedStage(COSTS, pre_process=True, post_process=True)
    output, loss_func = emulated_forward_step(torch.randn(3, 2, 4), last)
    assert sleeps == []
    loss, stats = loss_func(output)
    assert sleeps == [pytest.approx(COSTS.forward_s)] and torch.equal(stats["loss"], loss)
    middle = EmulatedStage(COSTS, pre_process=True, post_process=False)
    emulated_forward_step(torch.randn(3, 2, 4), middle)
    assert sleeps[1:] == [pytest.approx(COSTS.forward_s)]
    torch_last = EmulatedTorchStage(COSTS, is_first=False, is_last=True)
    out = torch_last(torch.randn(2, 3, 4))
    assert len(sleeps) == 2
    mse_then_wait(torch_last, out, torch.zeros_like(out))
    assert sleeps[2:] == [pytest.approx(COSTS.forward_s)]


def test_the_backward_waits_after_its_gradient_accumulation(sleeps, monkeypatch):
    """The last piece of a backward is waited once the pass has accumulated the gradient of the
    stage's input (an engine callback), so no real work of B follows its wait."""
    stage = EmulatedStage(COSTS, pre_process=False, post_process=True)
    x = torch.randn(3, 2, 4, requires_grad=True)
    stage.set_input_tensor(x)
    out = stage(None)
    seen: list[bool] = []
    sleep = emulated.time.sleep
    monkeypatch.setattr(emulated.time, "sleep",
                        lambda seconds: (seen.append(x.grad is not None), sleep(seconds)))
    out.mean().backward()
    assert seen == [True] and sleeps[1:] == [pytest.approx(COSTS.backward_s)]


def test_weight_time_cannot_exceed_backward():
    """W is part of the backward: a larger --weight-ms is rejected by name."""
    with pytest.raises(ValueError, match="--weight-ms"):
        EmulatedCosts(0.01, 0.01, 0.02)


def test_layers_share_the_backward_and_zero_times_never_sleep(sleeps):
    """With several layers the backward sleeps in one piece per layer that add up to the whole
    time; a stage of zero times asks for no sleep at all."""
    stage = EmulatedStage(COSTS, pre_process=True, post_process=True, layers=4)
    stage(torch.randn(3, 2, 4)).mean().backward()
    assert len(sleeps) == 5 and sum(sleeps[1:]) == pytest.approx(COSTS.backward_s)
    free = EmulatedStage(EmulatedCosts(0.0, 0.0), pre_process=True, post_process=True, layers=4)
    free(torch.randn(3, 2, 4)).mean().backward()
    assert len(sleeps) == 5


def test_real_work_is_absorbed_by_the_deadline(sleeps, monkeypatch):
    """Time the tiny real work takes is subtracted from the sleep, not added to it: a W whose
    gradient computation takes 15 ms sleeps weight_s - 15 ms."""
    stage = EmulatedStage(COSTS, pre_process=True, post_process=True)
    store = SleepingWeightGradStore()
    out = stage(torch.randn(3, 2, 4))
    with defer_weight_grad(stage, store):
        out.mean().backward()
    monkeypatch.setattr(emulated.WeightGradStore, "_flush_entry",
                        lambda self, index: emulated.time.sleep(0.015))
    store.flush()
    assert sleeps[-2:] == [0.015, pytest.approx(COSTS.weight_s - 0.015)]


def test_the_last_part_of_a_wait_is_spun(sleeps, monkeypatch):
    """A wait sleeps all but SPIN_S and spins the rest (the OS wakes sleepers late); one shorter
    than SPIN_S does not sleep at all."""
    now = [0.0]
    reads: list[float] = []

    def perf_counter() -> float:
        now[0] += 1e-4  # a coarse clock: the spin ends after a few dozen reads
        reads.append(now[0])
        return now[0]

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    monkeypatch.setattr(emulated.time, "perf_counter", perf_counter)
    monkeypatch.setattr(emulated.time, "sleep", sleep)
    monkeypatch.setattr(emulated, "SPIN_S", 0.005)
    emulated.sleep_until(0.02)
    assert sleeps == [pytest.approx(0.015, abs=2e-4)] and now[0] >= 0.02
    assert len(reads) >= 0.005 / 1e-4  # it spun
    emulated.sleep_until(now[0] + 0.003)
    assert len(sleeps) == 1


@pytest.mark.parametrize("layers", [1, 3])
def test_a_traced_stage_records_each_action_from_its_start_to_its_wait_end(sleeps, layers):
    """With a timeline, F, B and W each record one start and one end, the end after the action's
    last wait (the backward's after its gradient accumulation); without one, nothing is kept."""
    timeline = Timeline()
    stage = EmulatedStage(COSTS, pre_process=True, post_process=True, layers=layers)
    stage.trace_into(timeline)
    store = SleepingWeightGradStore(timeline=timeline)
    out = stage(torch.randn(3, 2, 4))
    assert [e[0] for e in timeline.events] == [START, END]
    assert timeline.events[1][1] - timeline.events[0][1] == pytest.approx(COSTS.forward_s)
    with defer_weight_grad(stage, store):
        out.mean().backward()
    store.flush()
    kinds = [e[0] for e in timeline.events]
    assert kinds == [START, END] * 3
    times = [e[1] for e in timeline.events]
    assert times == sorted(times)
    assert times[3] - times[2] == pytest.approx(COSTS.input_grad_s)
    assert times[5] - times[4] == pytest.approx(COSTS.weight_s)
    stage.trace_into(None)
    stage(torch.randn(3, 2, 4)).mean().backward()
    assert len(timeline.events) == 6


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("work_s", [0.003, 0.02])
def test_a_moe_action_queues_its_pieces_and_waits_once_at_its_end(sleeps, layers, work_s):
    """An emulated MoE stage's pieces are queued on its device while the host does each piece's
    real work (here ``work_s`` per layer piece): F and B each wait once, at their end, and last
    their emulated time while the host keeps ahead (3 ms of work per piece: hidden); a host
    slower than the pieces (20 ms of work per piece of 10-15 ms) makes the device wait for it,
    so the action lasts the host's time."""
    costs = EmulatedCosts(0.02, 0.06)
    stage = emulated_moe.EmulatedMoEStage(costs, 0.0, emulated_moe.EmulatedAllToAll(None),
                                          pre_process=True, post_process=True, layers=layers)
    for linear in stage.linears:
        linear.register_forward_hook(lambda *_: emulated.time.sleep(work_s))
        linear.weight.register_hook(lambda grad: emulated.time.sleep(work_s))
    pieces = 2 * layers
    outputs: list[torch.Tensor] = []
    for run, emulated_s in ((lambda: outputs.append(stage(torch.randn(3, 2, 4))),
                             costs.forward_s),
                            (lambda: outputs[0].mean().backward(), costs.backward_s)):
        before = len(sleeps)
        start = emulated.time.perf_counter()
        run()
        host_s = pieces * work_s
        piece_s = emulated_s / pieces
        # the last piece is queued after the host's work for the ones before it
        expected = max(emulated_s, (pieces - 1) * work_s + piece_s, host_s)
        assert emulated.time.perf_counter() - start == pytest.approx(expected, abs=1e-9)
        waits = [s for s in sleeps[before:] if s != work_s]
        assert len(waits) == (1 if expected > host_s else 0)  # one wait, at the end


def test_a_moe_weight_gradient_queues_entry_by_entry(sleeps):
    """The W of an emulated MoE stage of 2 layers is 4 entries (one per compute piece), each
    queued on the stage's device for its quarter of weight_s, one per step of the store's pieces
    (where the paired runtime switches to the partner); the last waits for the device."""
    costs = EmulatedCosts(0.02, 0.06, 0.04)
    stage = emulated_moe.EmulatedMoEStage(costs, 0.0, emulated_moe.EmulatedAllToAll(None),
                                          pre_process=True, post_process=True, layers=2)
    store = SleepingWeightGradStore()
    out = stage(torch.randn(3, 2, 4))
    with defer_weight_grad(stage, store):
        out.mean().backward()
    assert len(store) == 4
    done = len(sleeps)
    start = emulated.time.perf_counter()
    between = [len(sleeps) for _ in store.pieces()]
    assert between == [done] * 3  # the first three entries are queued, not waited for
    assert sleeps[done:] == [pytest.approx(costs.weight_s)]
    assert emulated.time.perf_counter() - start == pytest.approx(costs.weight_s)
    assert all(linear.weight.grad is not None for linear in stage.linears)


class _FakeWork:
    def __init__(self, log: list, op: str, tensors: list) -> None:
        self.log, self.op, self.tensors = log, op, tensors

    def wait(self) -> bool:
        self.log.append(("wait", self.op))
        return True


class _FakeGroup:
    """Records sends; a receive fills its buffer from what was sent (a loopback link)."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []
        self.log: list = []

    def send(self, tensors, peer, tag):
        self.sent.append(tensors[0].clone())
        return _FakeWork(self.log, "send", tensors)

    def recv(self, tensors, peer, tag):
        tensors[0].copy_(self.sent.pop(0))
        return _FakeWork(self.log, "recv", tensors)


def test_device_timed_messages_carry_the_producers_device_time(sleeps, monkeypatch):
    """A DeviceTimedTransport sends each message with the device time its producer's pieces end
    (an activation: the F of its stage; a gradient: the B of the stage above) and, on the
    receiving rank, the consumer (the F above, the B below) starts no earlier than that time
    plus the latency, even when its host got there first."""
    from types import SimpleNamespace

    from megatron_chimera.schedules.actions import Action
    from megatron_chimera.schedules.lowering import ACTIVATION, GRADIENT, RECV, SEND, Message

    device = emulated_moe.EmulatedAllToAll(None)
    producer = Action("F", 0, 2, 5)
    device._ready[producer] = 7.5  # the F's pieces end at 7.5 s on the sender's device
    group = _FakeGroup()
    transport = emulated_moe.DeviceTimedTransport(SimpleNamespace(pipeline_rank=1), None,
                                                  device, latency_s=0.25)
    monkeypatch.setattr(transport, "address", lambda message: (group, 1, 0))
    activation = Message(ACTIVATION, 0, 5, 2, 0, 1)
    assert activation.producer() == producer
    assert activation.consumer() == Action("F", 0, 3, 5)
    gradient = Message(GRADIENT, 0, 5, 2, 1, 0)
    assert (gradient.producer(), gradient.consumer()) == (
        Action("B", 0, 3, 5), Action("B", 0, 2, 5))
    (send,) = transport.post(SEND, [activation], [torch.ones(2)])
    assert float(group.sent[1]) == 7.5
    buffer = torch.zeros(2)
    (recv,) = transport.post(RECV, [activation], [buffer])
    transport.wait(send, activation._replace(dst=0))  # a send's wait stamps nothing
    assert device._inputs == {}
    transport.wait(recv, activation)
    assert torch.equal(buffer, torch.ones(2)) and group.log.count(("wait", "recv")) == 2
    consumer = activation.consumer()
    assert device._inputs == {consumer: 7.75}
    device.comm = SimpleNamespace(action=consumer, tape=None)
    assert device.piece_start(0.5) == pytest.approx(8.25)  # its host (clock ~0) was earlier
