"""The paired runtime's baton (pipeline/overlap.py): the halves' all-to-alls are issued in one
order fixed by the two actions, whatever the timing, and the compute never runs on both
halves at once."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_chimera.pipeline.overlap import (
    expert_all_to_all,
    leading_half,
    run_in_turn,
    run_pair,
)
from megatron_chimera.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron_chimera.tensor_parallel.weight_grad import WeightGradStore

pytestmark = pytest.mark.timeout(60)


class _Handle:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def wait(self) -> None:
        time.sleep(self.seconds)


def _trace(pieces: dict[int, list[str]], lead: int, a2a_s: dict[int, float]) -> list[str]:
    """Run two halves whose pieces are "c" (compute) or "a" (all-to-all of ``a2a_s[half]``
    seconds); return the events in order."""
    events: list[str] = []
    computing = threading.Lock()

    def half(i: int):
        def body() -> None:
            for k, piece in enumerate(pieces[i]):
                if piece == "a":
                    expert_all_to_all(lambda k=k: (events.append(f"{i}a{k}"),
                                                   _Handle(a2a_s[i]))[1])
                else:
                    assert computing.acquire(blocking=False), "both halves compute at once"
                    events.append(f"{i}c{k}")
                    time.sleep(0.002)
                    computing.release()
        return body

    run_pair((half(0), half(1)), lead)
    return events


@pytest.mark.parametrize("a2a_s", [{0: 0.0, 1: 0.01}, {0: 0.01, 1: 0.0}])
def test_all_to_alls_alternate_whatever_their_duration(a2a_s):
    """F (c a c a) and B (a c a c) with the backward leading: the issue order is B's, F's, B's,
    ... whichever all-to-all ends first."""
    events = _trace({0: list("caca"), 1: list("acac")}, leading_half(("F", "B")), a2a_s)
    issues = [e for e in events if "a" in e[1:]]
    assert issues == ["1a0", "0a1", "1a2", "0a3"]
    assert sorted(events) == sorted(["0c0", "0a1", "0c2", "0a3", "1a0", "1c1", "1a2", "1c3"])


def test_the_backward_leads_an_f_and_b_pair():
    """DualPipe's order: the backward's combine-gradient all-to-all first."""
    assert leading_half(("F", "B")) == 1
    assert leading_half(("B", "F")) == 0
    assert leading_half(("F", "F")) == 0


class _RecordingStore(WeightGradStore):
    """A weight-gradient store that records each entry it computes (``<half>w<entry>``)."""

    def __init__(self, half: int, events: list[str], computing: threading.Lock) -> None:
        super().__init__()
        self.half, self.events, self.computing = half, events, computing

    def _flush_entry(self, index: int) -> None:
        assert self.computing.acquire(blocking=False), "both halves compute at once"
        self.events.append(f"{self.half}w{index}")
        super()._flush_entry(index)
        time.sleep(0.002)
        self.computing.release()


def _weight_trace(kinds: tuple[str, str], partner: str, entries: int) -> list[str]:
    """A W (flushing a real store of ``entries`` linear layers' gradients) paired with an F or
    B whose pieces are ``partner`` ("c" compute, "a" all-to-all of 10 ms): the events in order
    (the W's gradients checked against their formula)."""
    weight = kinds.index("W")
    lead = leading_half(kinds)
    events: list[str] = []
    computing = threading.Lock()
    store = _RecordingStore(weight, events, computing)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(3, 2) for _ in range(entries)]
    expected = []
    for layer in layers:
        inputs, grad_output = torch.randn(4, 3), torch.randn(4, 2)
        store.put(layer.weight, layer.bias, inputs, grad_output)
        expected.append((grad_output.t() @ inputs, grad_output.sum(0)))

    def other() -> None:
        for k, piece in enumerate(partner):
            if piece == "a":
                expert_all_to_all(lambda k=k: (events.append(f"{1 - weight}a{k}"),
                                               _Handle(0.01))[1])
            else:
                assert computing.acquire(blocking=False), "both halves compute at once"
                events.append(f"{1 - weight}c{k}")
                time.sleep(0.002)
                computing.release()

    halves = [other, other]
    halves[weight] = store.flush
    run_pair(halves, lead)
    for layer, (w, b) in zip(layers, expected):
        torch.testing.assert_close(layer.weight.grad, w, rtol=0, atol=0)
        torch.testing.assert_close(layer.bias.grad, b, rtol=0, atol=0)
    return events


def test_a_weight_half_computes_one_entry_per_all_to_all_of_the_other_half():
    """A W (no all-to-all) beside an F or B: the F or B leads; the W hands the baton back after
    each entry of its weight-gradient store's flush, so it computes one entry while each of
    the other half's all-to-alls is in flight (not all of them while the first is); the issue
    order is the other half's own, and the gradients are the store's exact ones."""
    assert leading_half(("W", "F")) == 1 and leading_half(("F", "W")) == 0
    assert leading_half(("W", "B")) == 1 and leading_half(("B", "W")) == 0
    events = _weight_trace(("W", "F"), "caca", 3)
    assert events == ["1c0", "1a1", "0w0", "1c2", "1a3", "0w1", "0w2"]
    events = _weight_trace(("B", "W"), "acac", 2)
    assert events == ["0a0", "1w0", "0c1", "0a2", "1w1", "0c3"]
    events = _weight_trace(("F", "W"), "cacacaca", 2)  # more all-to-alls than entries
    assert events == ["0c0", "0a1", "1w0", "0c2", "0a3", "1w1", "0c4", "0a5", "0c6", "0a7"]


def test_an_error_in_one_half_is_raised_after_both_end():
    """A failing half hands the baton over; the other half still finishes; the error is
    raised on the calling thread."""
    done = []

    def bad() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        run_pair((bad, lambda: done.append(1)), 0)
    assert done == [1]


def _draw_alone() -> torch.Tensor:
    with get_cuda_rng_tracker().fork():
        tracked = torch.rand(2)
    return torch.cat([torch.rand(4), tracked])


def _drawing_halves(draws: dict[int, list[torch.Tensor]]):
    """Two halves that draw from the default generator between all-to-alls (a dropout mask
    per piece), recording their draws."""

    def half(i: int):
        def body() -> None:
            for _ in range(3):
                draws[i].append(_draw_alone())
                expert_all_to_all(lambda: _Handle(0.0))
            draws[i].append(_draw_alone())
        return body

    return half(0), half(1)


@pytest.fixture
def _fresh_tracker():
    """The process's RNG tracker is emptied again after the test (it is process state)."""
    yield
    get_cuda_rng_tracker().reset()


@pytest.mark.parametrize("lead", [0, 1])
@pytest.mark.usefixtures("_fresh_tracker")
def test_each_half_draws_from_its_own_random_stream(lead):
    """Overlapped, the halves alternate after every draw (from the default generator and the
    tensor-parallel tracker's); yet each half draws what it draws when the pair runs one half
    after the other (run_in_turn), and the rank's streams go on alike after the pair: the first
    half continues them, the second runs on a fork."""
    runs = {}
    for overlapped in (True, False):
        model_parallel_cuda_manual_seed(5)
        draws: dict[int, list[torch.Tensor]] = {0: [], 1: []}
        halves = _drawing_halves(draws)
        if overlapped:
            run_pair(halves, lead)
        else:
            run_in_turn(halves)
        runs[overlapped] = draws, torch.rand(4)
    (paired, after_paired), (in_turn, after_in_turn) = runs[True], runs[False]
    for i in (0, 1):
        assert all(torch.equal(x, y) for x, y in zip(paired[i], in_turn[i], strict=True))
    assert torch.equal(after_paired, after_in_turn)
    model_parallel_cuda_manual_seed(5)
    alone = [_draw_alone() for _ in range(4)]
    assert all(torch.equal(x, y) for x, y in zip(paired[0], alone, strict=True))
    # the second half's streams are others (default and tracked parts alike)
    assert not torch.equal(paired[0][0][:4], paired[1][0][:4])
    assert not torch.equal(paired[0][0][4:], paired[1][0][4:])
    assert torch.equal(after_paired, torch.rand(4))


def test_the_model_all_to_all_runs_through_the_baton():
    """The MoE layer's hook (model/moe/expert_comm) is the paired runtime's all-to-all once the
    runtime is imported: in a pair its calls interleave with the other half's, labelled."""
    from megatron_chimera.model.moe import expert_comm
    from megatron_chimera.pipeline import overlap

    def half(i: int):
        def body() -> None:
            for k in range(2):
                expert_comm.expert_all_to_all(f"h{i}.{k}", lambda: _Handle(0.0))
        return body

    overlap.issued = []
    try:
        run_pair((half(0), half(1)), 1)
        assert overlap.issued == ["-:h1.0", "-:h0.0", "-:h1.1", "-:h0.1"]
    finally:
        overlap.issued = None
