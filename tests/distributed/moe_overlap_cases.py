"""Per-rank bodies of the paired runtime's tests on emulated MoE stages (issue 41): overlap on
and off give the same losses and gradients, the losses equal one process's, and every rank of
an expert-parallel group issues the pairs' all-to-alls in one order."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from megatron_chimera import parallel_state
from megatron_chimera.model.moe.expert_comm import BackwardTape
from megatron_chimera.pipeline.emulated import EmulatedCosts
from megatron_chimera.pipeline.emulated_moe import (
    EmulatedAllToAll,
    EmulatedMoEStage,
    emulated_moe_forward_step,
)
from megatron_chimera.pipeline.executor import (
    ExecutorPolicy,
    Gradients,
    PipelineExecutor,
    StageWork,
)
from megatron_chimera.pipeline.overlap import Half, PairRuntime
from megatron_chimera.pipeline.topology import PipelineTopology
from megatron_chimera.schedules import build_schedule
from megatron_chimera.schedules.actions import BACKWARD, FORWARD, WEIGHT, Action

SEQ, MICRO_BATCH, HIDDEN = 4, 2, 4
COSTS = EmulatedCosts(0.002, 0.002)  # forward, whole backward: seconds per stage
ALL_TO_ALL_S = 0.002  # per stage and direction: all-to-all = compute
LAYERS = 2  # MoE layers per stage: 4 all-to-alls per F and per B


def _batch(data_rank: int, step: int, microbatch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * data_rank + 100 * step + microbatch)
    return torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=g)


def _stage(stage: int, num_stages: int, exchange: EmulatedAllToAll,
           all_to_all_s: float) -> EmulatedMoEStage:
    return EmulatedMoEStage(COSTS, all_to_all_s, exchange, stage == 0, stage == num_stages - 1,
                            HIDDEN, seed=stage, layers=LAYERS)


def _reference_losses(num_stages: int, data_rank: int, steps: int,
                      n: int) -> dict[tuple[int, int], float]:
    """Every (iteration, micro-batch)'s loss through all stages in this process (no
    all-to-all)."""
    local = EmulatedAllToAll(None)
    stages = [_stage(s, num_stages, local, 0.0) for s in range(num_stages)]
    losses = {}
    with torch.no_grad():
        for step in range(steps):
            for m in range(n):
                hidden = _batch(data_rank, step, m)
                for s, module in enumerate(stages):
                    if s > 0:
                        module.set_input_tensor(hidden)
                    hidden = module(hidden)
                losses[(step, m)] = float(hidden.mean())
    return losses


def _run(schedule_name: str, d: int, n: int, steps: int, overlap: bool,
         overlap_pairs: bool = True,
         ) -> tuple[dict[tuple[int, int], float], dict[str, torch.Tensor], list[str]]:
    """``steps`` iterations: the last stage's losses, this rank's gradients and the labels of
    its all-to-alls in issue order."""
    options = {"overlap_moe_expert_parallel_comm": True} if overlap else {}
    schedule = build_schedule(schedule_name, d, n, **options)
    assert bool(any(schedule.pairs)) == overlap
    parallel_state.initialize_model_parallel(d, schedule.placement, schedule.num_stages,
                                             timeout=datetime.timedelta(seconds=60),
                                             expert_model_parallel_size=2)
    try:
        exchange = EmulatedAllToAll(parallel_state.get_expert_model_parallel_group())
        exchange.issued = []
        prank = parallel_state.get_pipeline_model_parallel_rank()
        stages = {s: _stage(s, schedule.num_stages, exchange, ALL_TO_ALL_S)
                  for s in schedule.stages_of_rank(prank)}
        executor = PipelineExecutor(
            schedule, PipelineTopology.from_parallel_state(),
            StageWork(stages, emulated_moe_forward_step, (SEQ, MICRO_BATCH, HIDDEN),
                      torch.float32),
            Gradients(loss_scale_divisor=n), policy=ExecutorPolicy(overlap_pairs=overlap_pairs))
        dp = parallel_state.get_data_parallel_rank()
        losses: dict[tuple[int, int], float] = {}
        for step in range(steps):
            result = executor.run([_batch(dp, step, m) for m in range(n)])
            losses.update({(step, m): float(v["loss"]) for m, v in result.local_losses.items()})
        grads = {f"{s}.{name}": p.grad.clone() for s, module in stages.items()
                 for name, p in module.named_parameters()}
        return losses, grads, exchange.issued
    finally:
        parallel_state.destroy_model_parallel()


def _interleaved(labels: list[str]) -> bool:
    """Whether two actions' all-to-alls alternate somewhere (x, y, x): a pair overlapped."""
    action = [label.split(":")[0] for label in labels]
    return any(action[i] == action[i + 2] != action[i + 1] for i in range(len(action) - 2))


def run_overlap_equivalence(rank: int, world_size: int) -> None:
    """Chimera and Chimera-ZB D=2 x W=2 with EP=2 on emulated MoE stages (all-to-all =
    compute): the paired runtime with overlap gives the losses of one process (<= 1e-6
    relative: the same math, one summation order per micro-batch), the gradients of the
    unpaired schedule (<= 1e-6: the micro-batches accumulate in another order) and exactly
    those of the same paired schedule run one half after the other; every rank of an EP group
    issued the same all-to-alls in the same order, and the halves' all-to-alls did interleave.
    Chimera-ZB's paired order also pairs Ws with lone Fs and Bs (the W computes one
    weight-gradient entry, of its 2 x LAYERS, while each of the other half's all-to-alls is in
    flight)."""
    d, n = 2, 4
    zb = build_schedule("chimera-zb", d, n, overlap_moe_expert_parallel_comm=True)
    assert any(WEIGHT in (zb.actions[r][i].kind, zb.actions[r][i + 1].kind)
               for r, starts in enumerate(zb.pairs) for i in starts)
    for name in ("chimera", "chimera-zb"):
        _check_equivalence(rank, name, d, n)


def _check_equivalence(rank: int, name: str, d: int, n: int) -> None:
    """:func:`run_overlap_equivalence` for one schedule."""
    steps = 2
    plain_losses, plain_grads, _ = _run(name, d, n, steps, overlap=False)
    losses, grads, issued = _run(name, d, n, steps, overlap=True)
    seq_losses, seq_grads, seq_issued = _run(name, d, n, steps, overlap=True,
                                             overlap_pairs=False)
    assert losses == seq_losses
    for key, grad in grads.items():
        assert torch.equal(grad, seq_grads[key]), key
        torch.testing.assert_close(grad, plain_grads[key], rtol=1e-6, atol=1e-7, msg=key)
    # Chimera: every rank holds a last stage (pipe 0's on pipeline rank D-1, pipe 1's on 0)
    assert losses and losses.keys() == plain_losses.keys()
    reference = _reference_losses(d, parallel_state_free_data_rank(rank, d), steps, n)
    for key, loss in losses.items():
        assert abs(loss - reference[key]) <= 1e-6 * abs(reference[key]), (key, loss)
        assert abs(loss - plain_losses[key]) <= 1e-6 * abs(plain_losses[key]), (key, loss)
    assert _interleaved(issued) and not _interleaved(seq_issued)
    peers: list = [None] * 2
    dist.all_gather_object(peers, issued, group=_ep_group_of(rank, d))
    assert peers[0] == peers[1] and len(peers[0]) > 0


def parallel_state_free_data_rank(rank: int, d: int) -> int:
    """The data-parallel rank of global ``rank`` (T=1: consecutive ranks share a pipeline
    rank, see parallel_state)."""
    return rank % (dist.get_world_size() // d)


_EP_GROUPS: dict[int, dist.ProcessGroup] = {}


def _ep_group_of(rank: int, d: int) -> dist.ProcessGroup:
    """The expert-parallel group of ``rank`` (consecutive pairs), created on every rank."""
    if not _EP_GROUPS:
        w = dist.get_world_size() // d
        for p in range(d):
            _EP_GROUPS[p] = dist.new_group(list(range(p * w, p * w + w)))
    return _EP_GROUPS[rank // (dist.get_world_size() // d)]


def run_order_mismatch(rank: int, world_size: int) -> None:
    """Two ranks of one EP group run a pair of two backwards (pieces cut at their all-to-alls,
    on one thread): with the same leading half they issue the same all-to-alls; when rank 1
    leads with the other half, both ranks' first all-to-all meets a different one of the
    peer's and each raises, naming it."""
    exchange = EmulatedAllToAll(dist.group.WORLD)
    runtime = PairRuntime()
    stages = [_stage(0, 2, exchange, 0.001), _stage(1, 2, exchange, 0.001)]
    for stage in stages:
        stage.set_expert_comm(runtime)
    hidden = torch.randn(SEQ, MICRO_BATCH, HIDDEN)

    def run_backward(tensors, grads):
        torch.autograd.backward(tensors, grads)

    def half(i: int) -> Half:
        tape = runtime.tape = BackwardTape()
        runtime.action = Action(FORWARD, i, i, i)
        if i:
            stages[i].set_input_tensor(hidden)
        out = stages[i](hidden)
        runtime.tape = None
        return Half(Action(BACKWARD, i, i, i),
                    lambda: tape.pieces(runtime, out, torch.ones_like(out), run_backward), True)

    for lead_of_rank_1, fails in ((0, False), (1, True)):
        halves = (half(0), half(1))
        exchange.issued = []
        try:
            runtime.run_pair(halves, lead_of_rank_1 if rank == 1 else 0)
        except RuntimeError as exc:
            assert fails and "issued in different orders" in str(exc), exc
        else:
            assert not fails, "a mismatched all-to-all order went unnoticed"
            peers: list = [None] * 2
            dist.all_gather_object(peers, exchange.issued)
            assert peers[0] == peers[1] and _interleaved(peers[0]), peers
