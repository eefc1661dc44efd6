"""The single-thread paired runtime (pipeline/overlap.py): the halves' all-to-alls are issued in
one order fixed by the two actions, pieces alternate on the calling thread (no thread, no
interpreter setting), each half draws from its own random streams named on the rank's device,
and a backward cut at its all-to-alls (BackwardTape) gives exactly one backward's gradients."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from megatron_chimera.model.moe.expert_comm import BackwardTape, ExpertComm
from megatron_chimera.pipeline.overlap import Half, PairRuntime, leading_half
from megatron_chimera.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron_chimera.tensor_parallel import random as tp_random
from megatron_chimera.tensor_parallel.weight_grad import WeightGradStore

pytestmark = pytest.mark.timeout(60)


class _Handle:
    """A started all-to-all: records its wait."""

    def __init__(self, events: list[str], label: str) -> None:
        self.events, self.label = events, label

    def wait(self) -> None:
        self.events.append(f"{self.label}.wait")


def _driver(runtime: PairRuntime, i: int, pieces: str, events: list[str]):
    """A forward-like half: compute ("c") and all-to-alls ("a") through the runtime."""
    def body() -> None:
        for k, piece in enumerate(pieces):
            if piece == "a":
                runtime.exchange(f"{i}a{k}", lambda k=k: (events.append(f"{i}a{k}"),
                                                          _Handle(events, f"{i}a{k}"))[1])
            else:
                events.append(f"{i}c{k}")
    return body


def _pieces(runtime: PairRuntime, i: int, pieces: str, events: list[str]):
    """A backward-like half: each all-to-all ends a piece (issued, yielded, waited after)."""
    def body():
        for k, piece in enumerate(pieces):
            if piece == "a":
                handle = runtime.start(f"{i}a{k}", lambda k=k: (
                    events.append(f"{i}a{k}"), _Handle(events, f"{i}a{k}"))[1])
                yield handle
                handle.wait()
            else:
                events.append(f"{i}c{k}")
    return body


def test_f_and_b_alternate_on_one_thread_in_a_fixed_order():
    """F (c a c a, a driver) and B (a c a c, pieces) with the backward leading: B issues, F
    computes and issues, B waits and computes and issues, ...; no thread is started and the
    interpreter's switch interval is untouched."""
    runtime = PairRuntime()
    events: list[str] = []
    threads, switch = threading.active_count(), sys.getswitchinterval()
    seen = []

    def watch():
        seen.append((threading.active_count(), sys.getswitchinterval()))

    f = _driver(runtime, 0, "caca", events)
    b = _pieces(runtime, 1, "acac", events)
    runtime.run_pair((Half("F", lambda: (watch(), f())[1], False),
                      Half("B", lambda: (watch(), (yield from b()))[1], True)),
                     leading_half(("F", "B")))
    assert seen == [(threads, switch)] * 2
    assert events == ["1a0", "0c0", "0a1", "1a0.wait", "1c1", "1a2", "0a1.wait", "0c2",
                      "0a3", "1a2.wait", "1c3", "0a3.wait"]


def test_two_piece_lists_alternate_and_two_drivers_run_in_turn():
    """B&B: piece by piece from the leader; F&F: one after the other (in list order)."""
    runtime = PairRuntime()
    events: list[str] = []
    runtime.run_pair((Half("B", _pieces(runtime, 0, "cac", events), True),
                      Half("B", _pieces(runtime, 1, "cac", events), True)), 1)
    assert [e for e in events if "." not in e] == ["1c0", "1a1", "0c0", "0a1", "1c2", "0c2"]
    events.clear()
    runtime.run_pair((Half("F", _driver(runtime, 0, "ca", events), False),
                      Half("F", _driver(runtime, 1, "ca", events), False)), 1)
    assert events == ["0c0", "0a1", "0a1.wait", "1c0", "1a1", "1a1.wait"]


def test_the_backward_leads_an_f_and_b_pair():
    """DualPipe's order: the backward's combine-gradient all-to-all first."""
    assert leading_half(("F", "B")) == 1
    assert leading_half(("B", "F")) == 0
    assert leading_half(("F", "F")) == 0
    assert leading_half(("W", "F")) == 1 and leading_half(("B", "W")) == 0


def test_a_weight_half_computes_one_entry_per_all_to_all_of_the_other_half():
    """A W beside an F: one weight-gradient entry while each of the F's all-to-alls is in
    flight, the rest after; the gradients are the store's exact ones."""
    runtime = PairRuntime()
    events: list[str] = []
    torch.manual_seed(0)
    store = WeightGradStore()
    layers = [torch.nn.Linear(3, 2) for _ in range(3)]
    expected = []
    for layer in layers:
        inputs, grad_output = torch.randn(4, 3), torch.randn(4, 2)
        store.put(layer.weight, layer.bias, inputs, grad_output)
        expected.append((grad_output.t() @ inputs, grad_output.sum(0)))

    def weight():
        for k, _ in enumerate(store.pieces()):
            events.append(f"0w{k}")
            yield
        events.append("0w.end")

    runtime.run_pair((Half("W", weight, True),
                      Half("F", _driver(runtime, 1, "caca", events), False)),
                     leading_half(("W", "F")))
    assert [e for e in events if "." not in e or e == "0w.end"] == [
        "1c0", "1a1", "0w0", "1c2", "1a3", "0w1", "0w.end"]
    for layer, (w, b) in zip(layers, expected):
        torch.testing.assert_close(layer.weight.grad, w, rtol=0, atol=0)
        torch.testing.assert_close(layer.bias.grad, b, rtol=0, atol=0)


def test_an_error_in_one_half_is_raised():
    runtime = PairRuntime()

    def bad() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        runtime.run_pair((Half("F", bad, False), Half("F", lambda: None, False)), 0)
    assert runtime.action is None


def _draw_alone() -> torch.Tensor:
    with get_cuda_rng_tracker().fork():
        tracked = torch.rand(2)
    return torch.cat([torch.rand(4), tracked])


@pytest.fixture
def _fresh_tracker():
    """The process's RNG tracker is emptied again after the test (it is process state)."""
    yield
    get_cuda_rng_tracker().reset()


@pytest.mark.parametrize("lead", [0, 1])
@pytest.mark.usefixtures("_fresh_tracker")
def test_each_half_draws_from_its_own_random_stream(lead):
    """Overlapped, the halves alternate after every draw; yet each half draws what it draws
    when the pair runs one half after the other, and the rank's streams go on alike after."""
    runs = {}
    for overlapped in (True, False):
        runtime = PairRuntime()
        model_parallel_cuda_manual_seed(5)
        draws: dict[int, list[torch.Tensor]] = {0: [], 1: []}

        def driver(draws=draws, runtime=runtime):
            for _ in range(3):
                draws[0].append(_draw_alone())
                runtime.exchange("a", lambda: _Handle([], "a"))
            draws[0].append(_draw_alone())

        def pieces(draws=draws):
            for _ in range(3):
                draws[1].append(_draw_alone())
                yield
            draws[1].append(_draw_alone())

        halves = (Half("F", driver, False), Half("B", pieces, True))
        if overlapped:
            runtime.run_pair(halves, lead)
        else:
            runtime.run_in_turn(halves)
        runs[overlapped] = draws, torch.rand(4)
    (paired, after_paired), (in_turn, after_in_turn) = runs[True], runs[False]
    for i in (0, 1):
        assert all(torch.equal(x, y) for x, y in zip(paired[i], in_turn[i], strict=True))
    assert torch.equal(after_paired, after_in_turn)
    model_parallel_cuda_manual_seed(5)
    alone = [_draw_alone() for _ in range(4)]
    assert all(torch.equal(x, y) for x, y in zip(paired[0], alone, strict=True))
    assert not torch.equal(paired[0][0][:4], paired[1][0][:4])


def test_every_rng_call_of_a_half_names_the_ranks_device(monkeypatch):
    """On CUDA the runtime saves, restores and forks each half's generator of the rank's
    device, never the current device implicitly (a fake CUDA records the device argument)."""
    calls: list[tuple[str, object]] = []
    state = torch.zeros(16, dtype=torch.uint8)
    monkeypatch.setattr(tp_random, "_cuda_active", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state",
                        lambda device="cuda": (calls.append(("get", device)), state)[1])
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda s, device="cuda": calls.append(("set", device)))
    monkeypatch.setattr(tp_random, "seeded_cuda_state",
                        lambda seed, device: (calls.append(("fork", device)), state)[1])
    runtime = PairRuntime("cuda:3")
    events: list[str] = []
    runtime.run_pair((Half("F", _driver(runtime, 0, "caca", events), False),
                      Half("B", _pieces(runtime, 1, "acac", events), True)), 1)
    assert {kind for kind, _ in calls} == {"get", "set", "fork"}
    assert all(torch.device(device) == torch.device("cuda:3") for _, device in calls), calls


class _Identity:
    """An all-to-all of one rank: the tensor itself (its gradient likewise)."""

    def __call__(self, x):
        return _Handle([], "x"), x.clone()


def test_a_backward_cut_at_its_all_to_alls_is_exact():
    """A graph with a residual around two all-to-alls and a tensor crossing them (as the MoE
    layer's probabilities and the transformer's residual): the tape's pieces give the gradients
    of one backward (a tensor read on both sides of a cut sums its gradient's terms in another
    order: 1e-6), bitwise where nothing is summed across a cut, and yield once per gradient
    all-to-all."""
    torch.manual_seed(0)
    w1, w2, w3 = (torch.randn(4, 4, requires_grad=True) for _ in range(3))
    x = torch.randn(3, 4, requires_grad=True)
    grad = torch.randn(3, 4)

    def forward(tape: BackwardTape | None, comm: ExpertComm):
        h = torch.tanh(x @ w1)
        if tape is not None:
            h = tape.split(h)
        probs = torch.sigmoid(h @ w2)
        start = tape.segment if tape is not None else 0
        rows = h * probs
        rows = tape.all_to_all(rows, "dispatch", comm, _Identity(), _Identity()) \
            if tape is not None else rows.clone()
        rows = torch.relu(rows @ w3)
        rows = tape.all_to_all(rows, "combine", comm, _Identity(), _Identity()) \
            if tape is not None else rows.clone()
        if tape is not None:
            probs, h = tape.cut(probs, start), tape.cut(h, start)
        return h + rows * probs

    comm = ExpertComm()
    out = forward(None, comm)
    out.backward(grad)
    want = [t.grad.clone() for t in (x, w1, w2, w3)]
    for t in (x, w1, w2, w3):
        t.grad = None
    tape = BackwardTape()
    out = forward(tape, comm)
    comm.issued = []

    def run_backward(tensors, grads):
        torch.autograd.backward(tensors, grads)

    yields = sum(1 for _ in tape.pieces(comm, out, grad, run_backward))
    assert yields == 2 and comm.issued == ["combine.bwd", "dispatch.bwd"]
    for t, w in zip((x, w1, w2, w3), want, strict=True):
        torch.testing.assert_close(t.grad, w, rtol=1e-6, atol=1e-7)
    assert torch.equal(w3.grad, want[3])


def test_a_piece_run_inside_its_partners_span_is_timed_once(monkeypatch):
    """The busy timer's spans nest (a B piece inside its F partner's span, at the F's
    all-to-all): each action is charged its own time, the sum is the wall time."""
    from megatron_chimera.pipeline import busy_timer
    from megatron_chimera.pipeline.busy_timer import BusyTimer

    clock = iter([0.0, 1.0, 3.0, 4.0])
    monkeypatch.setattr(busy_timer.time, "perf_counter", lambda: next(clock))
    charged: dict[str, float] = {}
    timer = BusyTimer(torch.device("cpu"), [], lambda a, s: charged.__setitem__(a, s))
    with timer("F"):
        with timer("B"):
            pass
    assert timer.total() == 4.0 and charged == {"F": 2.0, "B": 2.0}
