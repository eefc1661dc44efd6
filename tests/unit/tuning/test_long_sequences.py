"""The tuner's context parallelism and sequence slices: the layouts searched, the memory and
time they are predicted to take, and the command that trains the chosen one."""

from __future__ import annotations

import pytest

from megatron_chimera.config import ModelConfig
from megatron_chimera.tuning.analytic_costs import ModelSpec
from megatron_chimera.tuning.autotune import SearchSpace, autotune, enumerate_layouts
from megatron_chimera.tuning.command import pretrain_flags
from megatron_chimera.tuning.hardware import PRESETS
from megatron_chimera.tuning.perf_model import PerformanceModel
from megatron_chimera.tuning.training_plan import TrainingPlan

LONG = ModelSpec(ModelConfig(num_layers=8, hidden_size=512, num_attention_heads=8,
                             seq_length=16384, vocab_size=32000, params_dtype="bf16"), "gpt2")


def test_the_space_has_cp_and_slices_where_they_apply():
    space = SearchSpace(num_gpus=8, global_batch_size=4, num_layers=8,
                        schedules=("1f1b", "chimera", "interleaved"), micro_batch_sizes=(1,),
                        recompute=(False,), distributed_optimizer=(False,),
                        partition_methods=("uniform",), context_parallel_sizes=(1, 2),
                        sequence_slices=(1, 4), pipeline_parallel_sizes=(4,))
    layouts = list(enumerate_layouts(space))
    assert {(lay.CP, lay.W) for lay in layouts} == {(1, 2), (2, 1)}  # W = P / (T CP D)
    assert all(lay.num_gpus == 8 for lay in layouts)
    sliced = {(lay.schedule, lay.CP) for lay in layouts if lay.slices == 4}
    assert sliced == {("1f1b", 1), ("chimera", 1)}  # not interleaved, not with CP


def test_context_parallel_halves_activations_and_pays_the_ring():
    model = PerformanceModel(LONG, PRESETS["a100"])
    one = TrainingPlan("1f1b", 4, 2, 1, 8)
    two = TrainingPlan("1f1b", 4, 1, 1, 8, CP=2)
    m1, m2 = model.memory(one)[0], model.memory(two)[0]
    assert m2.activation_bytes / m1.activation_bytes == pytest.approx(0.5, rel=0.1)
    piece = model.partition(two)[1]
    ring_f, ring_b = model.ring_seconds(two, piece)
    assert 0 < ring_f < ring_b <= 2 * ring_f  # backward: blocks and their dK/dV
    full, half = model.stage_times(one, piece), model.stage_times(two, piece)
    assert half.forward >= full.forward / 2  # no faster than half the work
    assert "--context-parallel-size" in pretrain_flags(LONG, two)


def test_slices_shrink_the_bubble_and_the_activations_of_few_long_sequences():
    model = PerformanceModel(LONG, PRESETS["a100"])
    plain = model.predict(TrainingPlan("1f1b", 8, 1, 1, 4))
    sliced = model.predict(TrainingPlan("1f1b", 8, 1, 1, 4, slices=4))
    assert sliced.iteration_s < 0.75 * plain.iteration_s  # bubble 64% -> ~30%
    # N < D: every sequence is live on rank 0 in both; a unit is a quarter sequence, and the
    # sliced peak adds the keys/values of the earlier slices (all 4 sequences' 16 units live)
    from megatron_chimera.tuning.rank_memory import slice_cache_bytes
    partition = model.partition(TrainingPlan("1f1b", 8, 1, 1, 4, slices=4))
    extra = 16 * slice_cache_bytes(LONG, partition, 1, 4)[0]
    assert sliced.memory[0].activation_bytes == pytest.approx(
        plain.memory[0].activation_bytes + extra, rel=0.02)
    assert slice_cache_bytes(LONG, partition, 1, 4)[1] == 2 * 3 * 4096 * 512 * 2  # 1 layer:
    # K and V of 3 earlier slices of 4096 tokens, bf16


def test_the_tuner_picks_slices_for_few_sequences_and_the_flags_parse():
    from megatron_chimera.training.arguments import parse_args
    space = SearchSpace(num_gpus=8, global_batch_size=4, num_layers=8,
                        schedules=("1f1b", "chimera"), micro_batch_sizes=(1,),
                        recompute=(False,), distributed_optimizer=(False,),
                        partition_methods=("uniform",), sequence_slices=(1, 2, 4),
                        pipeline_parallel_sizes=(8,))
    best = autotune(PerformanceModel(LONG, PRESETS["a100"]), space, 80 * 2**30).ranked[0]
    assert best.layout.slices == 4
    argv = pretrain_flags(LONG, best.layout) + ["--mock-data", "--train-iters", "2", "--lr",
                                                "1e-4", "--vocab-size", "32000"]
    config = parse_args(argv, world_size=8)
    assert config.parallel.pipeline_sequence_slices == 4
    assert config.parallel.pipeline_schedule == best.layout.schedule
