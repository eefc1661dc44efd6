"""Rank bodies of the sequence-sliced pipeline tests: each micro-batch's sequence cut into k
slices that run as pipeline units in the sliced schedules' orders (``schedules/slices.py``),
each stage caching the earlier slices' keys/values (``model/sequence_slices.py``), against one
process training the whole sequences."""

from __future__ import annotations

from megatron_chimera import parallel_state
from megatron_chimera.distributed.grad_sync import assert_replicas_identical
from megatron_chimera.model.sequence_slices import split_into_slices
from megatron_chimera.schedules.slices import sliced_schedule
from megatron_chimera.schedules.validate import validate
from tests.helpers.tensor_parallel import full_state

from .cases import run_each
from .tp_cases import (
    TPCase,
    _check_close,
    _init_groups,
    _reference_name,
    build_run,
    make_batch,
    reference_training,
)

RTOL = 1e-6


def run_sliced_case(rank: int, world_size: int, case: TPCase) -> None:
    """Train ``case.steps`` steps sliced; losses (each sequence's: the mean of its slices'), clipped
    gradient norms and weights equal the unsliced single-process run (1e-6 relative)."""
    k, n = case.slices, case.num_microbatches
    schedule = sliced_schedule(case.schedule, case.pipeline_size, n, k)
    validate(schedule)
    config = case.model_config()
    ref_losses, ref_norms, ref_params = reference_training(case, 1, config)
    _init_groups(case, schedule)
    try:
        modules, optimizer, executor, partition = build_run(case, config, schedule)
        prank = parallel_state.get_pipeline_model_parallel_rank()
        results = []
        for step in range(case.steps):
            optimizer.zero_grad()
            units = [part for m in range(n) for part in split_into_slices(
                make_batch("gpt2", step, 0, m, case.reset_positions), k)]
            result = executor.run(units)
            if result.executed != schedule.actions[prank]:
                raise AssertionError(f"pipeline rank {prank}: executed order differs")
            _, norm, _ = optimizer.step()
            _check_close(norm, ref_norms[step], f"step {step} grad norm")
            results.append(result)
        for step, figures in enumerate(executor.gather(results) or []):
            for m, want in enumerate(ref_losses[step]):
                got = sum(u["lm loss"] for u in figures.losses[m * k:(m + 1) * k]) / k
                _check_close(got, want["lm loss"], f"step {step} sequence {m} lm loss")
        assert_replicas_identical(modules)
        for stage, module in modules.items():
            for local, value in full_state(module).items():
                name = _reference_name(module, local, partition[stage][0])
                want = ref_params[name]
                err = float((value - want).abs().max() / want.abs().max().clamp_min(1e-12))
                if err > 1e-5:
                    raise AssertionError(f"stage {stage} {name}: rel. error {err:.2e}")
    finally:
        parallel_state.destroy_model_parallel()


def run_sliced_cases(rank: int, world_size: int, cases: list[TPCase]) -> None:
    """Every case in sequence in this world; name the failing one."""
    run_each(rank, world_size, cases, run_sliced_case)
