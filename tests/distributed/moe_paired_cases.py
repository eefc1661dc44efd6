"""Per-rank bodies of the paired runtime's tests on *real* MoE stages (issue 41): the ``alltoall``
dispatcher's collectives run through the comm the executor hands the layers (the paired runtime of
pipeline/overlap: one thread, backwards in pieces cut at the all-to-alls), so a pair's
all-to-alls interleave; overlap on gives exactly what overlap off gives and one process's
losses, also with dropout and full recomputation (each half has its own random streams)."""

from __future__ import annotations

import dataclasses
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_chimera import parallel_state
from megatron_chimera.pipeline.executor import ExecutorPolicy
from megatron_chimera.schedules import build_schedule
from megatron_chimera.tensor_parallel import model_parallel_cuda_manual_seed

from .moe_cases import _reference, _tp, moe_training_case
from .moe_overlap_cases import _interleaved

D, N, EP = 2, 4, 2  # Chimera D=2 x W=2 on 4 ranks; EP groups [0 1] [2 3]
OVERLAP = (("overlap_moe_expert_parallel_comm", True),)
LOSS_RTOL = 1e-6  # against one process: the same math, one summation order per micro-batch


def _train(case, schedule, config, steps: int, overlap_pairs: bool, seed: int | None = None,
           recompute: bool = False):
    """``steps`` iterations: this rank's losses ``{(step, micro-batch): loss}``, its gradient
    buffers after each iteration, the grad norms, and its MoE all-to-alls' labels in issue
    order. ``seed``: reseed the rank's generators first (dropout draws from them);
    ``recompute``: the executor recomputes each stage's forward in its backward."""
    tp = _tp()
    if seed is not None:
        model_parallel_cuda_manual_seed(
            seed + 100 * parallel_state.get_pipeline_model_parallel_rank())
    modules, optimizer, executor, _ = tp.build_run(
        case, config, schedule, recompute=recompute,
        policy=ExecutorPolicy(overlap_pairs=overlap_pairs))
    # the harness runs under NCCL's rules: every iteration's all-to-alls are checked against
    # the lowered expert ops (pipeline/expert_order.check_issued)
    assert executor.expert_ops is not None and any(executor.expert_ops.values())
    dp = parallel_state.get_data_parallel_rank()
    losses, grads, norms = {}, [], []
    executor.pair_runtime.issued = issued = []
    try:
        for step in range(steps):
            optimizer.zero_grad()
            result = executor.run([tp.make_batch(case.family, step, dp, m)
                                   for m in range(case.num_microbatches)])
            losses.update({(step, m): float(v["lm loss"])
                           for m, v in result.local_losses.items()})
            grads.append({f"{s}.{name}": p.main_grad.clone()
                          for s, module in modules.items()
                          for name, p in module.named_parameters()})
            norms.append(optimizer.step()[1])
        return losses, grads, norms, issued
    finally:
        executor.pair_runtime.issued = None


def _alltoall(config):
    """``config`` with the ``alltoall`` token dispatcher (the one whose all-to-alls overlap)."""
    return dataclasses.replace(config, moe=dataclasses.replace(
        config.moe, moe_token_dispatcher_type="alltoall"))


def _assert_same(got, want, what: str) -> None:
    """Losses and every gradient buffer bitwise equal."""
    losses, grads, norms, _ = got
    if losses != want[0]:
        raise AssertionError(f"{what}: losses {losses} != {want[0]}")
    for step, (g, w) in enumerate(zip(grads, want[1], strict=True)):
        for name, value in g.items():
            if not torch.equal(value, w[name]):
                raise AssertionError(f"{what}: step {step} gradient of {name} differs")
    assert norms == want[2], (what, norms, want[2])


def run_real_moe_overlap(rank: int, world_size: int) -> None:
    """Chimera D=2 x W=2 with --overlap-moe-expert-parallel-comm on a tiny GPT whose stages each
    hold one real MoE layer (EP=2, ``alltoall`` dispatcher, top-2 of 4 experts, capacity 1.5:
    uneven and dropped token counts): overlap on gives bitwise the losses and gradients of the
    same pairs run one half after the other, and every micro-batch's loss and each grad norm of
    one process (1e-6 relative); the pairs' real all-to-alls (counts, tokens, gradients) did
    interleave, and both ranks of each EP group issued the same ones in the same order. Then,
    with dropout 0.2 drawn from the rank's generators (no keyed stream: every draw depends on
    where the generator is) and --recompute-granularity full, or the executor's recomputation of
    the whole stage (the backward half replays its masks while the forward half draws new
    ones), overlap on and off are bitwise equal."""
    moe = moe_training_case("chimera", D, EP, N, options=OVERLAP, sharded=True)
    case = moe.tp
    schedule = build_schedule(case.schedule, D, N, **dict(case.options))
    assert any(schedule.pairs), "no pairs to overlap"
    w = world_size // D
    config = _alltoall(case.model_config())
    ref_losses, ref_norms, _, _ = _reference(case, w, config)
    parallel_state.initialize_model_parallel(
        D, schedule.placement, schedule.num_stages, 1, timeout=timedelta(seconds=60),
        expert_model_parallel_size=EP, expert_groups=True)
    try:
        steps = len(ref_norms)
        on = _train(case, schedule, config, steps, True)
        off = _train(case, schedule, config, steps, False)
        _assert_same(on, off, "overlap on vs off")
        dp = parallel_state.get_data_parallel_rank()
        assert on[0], "this rank holds no last stage"
        for (step, m), loss in on[0].items():
            want = ref_losses[step][dp * N + m]["lm loss"]
            assert abs(loss - want) <= LOSS_RTOL * abs(want), (step, m, loss, want)
        for got, want in zip(on[2], ref_norms, strict=True):
            assert abs(got - want) <= LOSS_RTOL * abs(want), ("grad norm", got, want)
        plain, issued, in_turn = on[0], on[3], off[3]
        assert any(".bwd" in label for label in issued) and any(
            "dispatch.counts" in label for label in issued), issued
        assert _interleaved(issued) and not _interleaved(in_turn), issued
        peers: list = [None] * EP
        dist.all_gather_object(peers, issued,
                               group=parallel_state.get_expert_model_parallel_group())
        assert all(p == peers[0] for p in peers), "EP ranks issued different orders"

        dropout = _alltoall(case.model_config(hidden_dropout=0.2, attention_dropout=0.2,
                                    recompute_granularity="full", recompute_method="uniform",
                                    recompute_num_layers=1))
        on = _train(case, schedule, dropout, 1, True, seed=99)
        off = _train(case, schedule, dropout, 1, False, seed=99)
        _assert_same(on, off, "dropout + full recomputation: overlap on vs off")
        assert all(loss != plain[(0, m)] for (_, m), loss in on[0].items()), "no dropout drawn"
        dropout = _alltoall(case.model_config(hidden_dropout=0.2, attention_dropout=0.2))
        on = _train(case, schedule, dropout, 1, True, seed=7, recompute=True)
        off = _train(case, schedule, dropout, 1, False, seed=7, recompute=True)
        _assert_same(on, off, "dropout + the executor's recomputation: overlap on vs off")
    finally:
        parallel_state.destroy_model_parallel()
    for name in ("chimera-zb", "1f1b"):  # W pieces beside an F or B; Megatron's 1F1B pairing
        _dropout_recompute_on_equals_off(name)


def _dropout_recompute_on_equals_off(name: str) -> None:
    """``name`` (D=2 x W=2, EP=2, paired) with dropout 0.1 and the executor's recomputation:
    overlap on and off bitwise equal, the pairs' all-to-alls interleaved, and no Python thread
    started (nor the interpreter's switch interval changed) while the paired iteration ran."""
    moe = moe_training_case(name, D, EP, N, options=OVERLAP)
    case = moe.tp
    schedule = build_schedule(case.schedule, D, N, **dict(case.options))
    assert any(schedule.pairs), f"{name}: no pairs to overlap"
    parallel_state.initialize_model_parallel(
        D, schedule.placement, schedule.num_stages, 1, timeout=timedelta(seconds=60),
        expert_model_parallel_size=EP, expert_groups=True)
    try:
        config = _alltoall(case.model_config(hidden_dropout=0.1, attention_dropout=0.1))
        started: list = []
        start, switch = threading.Thread.start, sys.getswitchinterval()
        threading.Thread.start = lambda thread: (started.append(thread.name), start(thread))[1]
        try:  # the paired runtime starts no Python thread and leaves the interpreter alone
            on = _train(case, schedule, config, 1, True, seed=3, recompute=True)
        finally:
            threading.Thread.start = start
        assert not started and sys.getswitchinterval() == switch, (started,
                                                                   sys.getswitchinterval())
        off = _train(case, schedule, config, 1, False, seed=3, recompute=True)
        _assert_same(on, off, f"{name}: dropout 0.1 + recomputation: overlap on vs off")
        assert _interleaved(on[3]) and not _interleaved(off[3]), (name, on[3])
    finally:
        parallel_state.destroy_model_parallel()
