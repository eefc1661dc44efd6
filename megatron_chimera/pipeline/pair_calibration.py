"""The paired runtime's host costs, measured on emulated MoE stages for the simulator (issue 41).

The simulator costs an unpaired F or B as its compute plus its all-to-all, and a pair as the
paired runtime's baton runs it (``schedules/simulate.py: baton_pair_time``). What the host adds
on top is measured here, on the ranks of the run and while all of them do the same (so the load
is the run's): every rank times its first stage's

* **unpaired** forward then backward (``F``, ``B``: exposed all-to-alls), against
  ``C_F + A + C_B + A``: the difference, per action, is the simulator's ``action_overhead``;
* **pair** of a forward and the backward of an earlier forward (``PairRuntime.run_pair``: the
  forward a driver, the backward in pieces cut at its all-to-alls, the backward leading, as
  the executor runs an F&B pair), against the baton model (the runtime's strict
  alternation): less the one ``action_overhead`` the simulator charges a pair, the rest is
  spread over the pair's hand-overs -- ``hand_over_cost``, the one value that makes the baton
  model's pair last as long as the measured one (bisection; the model's time grows with it).

Each timing is a rank's median over ``reps`` (all ranks start each one together), then the
median over the ranks: a pipeline's critical path adds the host costs of the ranks it passes,
one after the other, not the slowest rank's at every step (and one rank's hiccup during the
calibration must not stand for all). Only the two host costs are fitted,
from actions run outside any schedule; the schedules' own iterations are not used.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_chimera.model.moe.expert_comm import BackwardTape
from megatron_chimera.pipeline.emulated_moe import EmulatedMoEStage
from megatron_chimera.pipeline.overlap import Half, PairRuntime, leading_half
from megatron_chimera.schedules.actions import BACKWARD, FORWARD, Action
from megatron_chimera.schedules.simulate import action_pieces, baton_pair_time


@dataclass(frozen=True)
class PairHostCosts:
    """Host seconds per unpaired F/B (``action_s``) and per baton hand-over in a pair
    (``hand_over_s``), and the raw timings they came from (seconds: measured, modelled)."""

    action_s: float
    hand_over_s: float
    unpaired: tuple[float, float]
    pair: tuple[float, float]


def _median_over_ranks(seconds: float) -> float:
    gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([seconds], dtype=torch.float64))
    return statistics.median(float(t) for t in gathered)


def _timed(run: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def fit_hand_over(measured_s: float, model: Callable[[float], float]) -> float:
    """The hand-over cost h >= 0 at which ``model(h)`` (non-decreasing) reaches ``measured_s``
    (0 when the model is already as slow)."""
    low, high = 0.0, max(measured_s, 1e-6)
    if model(low) >= measured_s:
        return 0.0
    while model(high) < measured_s:
        high *= 2
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if model(mid) < measured_s else (low, mid)
    return (low + high) / 2


def calibrate(stage: EmulatedMoEStage, stage_id: int, batch: torch.Tensor,
              reps: int = 8) -> PairHostCosts:
    """Measure :class:`PairHostCosts` on ``stage`` (every rank of the world calls this at once,
    the ranks of one expert-parallel group on the same ``stage_id``); ``batch`` is the first
    stage's input, and of the others' shape."""
    layers = stage.num_layers
    c_f = stage.costs.forward_s
    c_b = stage.backward_compute_s()
    a2a = stage.all_to_all_s
    lead = leading_half((FORWARD, BACKWARD))
    modelled_pair = lambda h: baton_pair_time(  # noqa: E731 - the model of the pair below
        (action_pieces(FORWARD, c_f, a2a, layers), action_pieces(BACKWARD, c_b, a2a, layers)),
        lead, h)
    counter = iter(range(10**9))
    runtime = PairRuntime()
    comm = stage.exchange.comm
    stage.set_expert_comm(runtime)

    def forward_half() -> Half:
        action = Action(FORWARD, 0, stage_id, next(counter))
        return Half(action, lambda: forward(action), False)

    def forward(action: Action | None = None) -> tuple[torch.Tensor, BackwardTape]:
        tape = runtime.tape = BackwardTape()
        runtime.action = action or Action(FORWARD, 0, stage_id, next(counter))
        if not stage.pre_process:
            stage.set_input_tensor(torch.randn_like(batch).requires_grad_())
        try:
            return stage(batch).sum(), tape
        finally:
            runtime.tape = None

    def backward(taped: tuple[torch.Tensor, BackwardTape]) -> Half:
        loss, tape = taped
        return Half(Action(BACKWARD, 0, stage_id, next(counter)),
                    lambda: tape.pieces(runtime, loss, torch.ones_like(loss),
                                        torch.autograd.backward), True)

    def unpaired() -> None:
        taped: list = []
        action = Action(FORWARD, 0, stage_id, next(counter))
        runtime.run_alone(Half(action, lambda: taped.append(forward(action)), False))
        runtime.run_alone(backward(taped[0]))

    try:
        timings_unpaired, timings_paired = [], []
        for _ in range(reps):
            timings_unpaired.append(_timed(unpaired))
            earlier = backward(forward())
            timings_paired.append(_timed(lambda e=earlier: runtime.run_pair(
                (forward_half(), e), lead)))
    finally:
        runtime.action = None
        stage.set_input_tensor(None)
        stage.set_expert_comm(comm)
    unpaired, paired = timings_unpaired, timings_paired
    nominal = c_f + c_b + 2 * a2a
    measured_unpaired = _median_over_ranks(statistics.median(unpaired))
    action_s = max((measured_unpaired - nominal) / 2, 0.0)
    measured_pair = _median_over_ranks(statistics.median(paired))
    hand_over_s = fit_hand_over(measured_pair - action_s, modelled_pair)
    return PairHostCosts(action_s, hand_over_s, (measured_unpaired, nominal),
                         (measured_pair, modelled_pair(0.0)))
