"""--rampup-batch-size START INCREMENT SAMPLES: Megatron's batch rule, the iteration count, and
the flag's errors (each naming it) before any process group."""

from __future__ import annotations

import pytest

from megatron_chimera.config import ConfigError
from megatron_chimera.training.arguments import parse_args

BASE = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 1 --global-batch-size 16 --lr 1e-3 --mock-data "
        "--vocab-size 100").split()


def parse(extra: str, world_size: int = 1):
    return parse_args([*BASE, *extra.split()], world_size=world_size)


def batches(training) -> list[int]:
    out, consumed = [], 0
    for _ in range(training.total_train_iters):
        out.append(training.global_batch_at(consumed))
        consumed += out[-1]
    return out


def test_megatron_rule_and_iterations():
    # 3 increments over 48 samples: +4 every 16 samples; an iteration starting at exactly 48
    # consumed samples is still in the ramp (Megatron: "consumed > SAMPLES" ends it)
    training = parse("--train-samples 120 --rampup-batch-size 4 4 48").training
    assert batches(training) == [4, 4, 4, 4, 8, 8, 12, 12, 16, 16, 16, 16]
    assert training.total_train_iters == 12 and training.total_train_samples == 120
    assert training.microbatch_counts() == [4, 8, 12, 16]
    assert [training.num_microbatches_at(c) for c in (0, 15, 16, 48, 49)] == [4, 4, 8, 16, 16]
    # a partial last batch is dropped, as Megatron (the ramp ends at 56 samples)
    assert parse("--train-samples 127 --rampup-batch-size 4 4 48").training.total_train_iters \
        == 12
    # data parallel: N counts micro-batches per replica (batch / (micro batch x W))
    dp = parse("--train-samples 120 --rampup-batch-size 4 4 48", world_size=2).training
    assert dp.microbatch_counts() == [2, 4, 6, 8] and dp.num_microbatches_at(20) == 4
    flat = parse("--train-samples 120").training
    assert flat.total_train_iters == 7 and batches(flat) == [16] * 7


@pytest.mark.parametrize("extra,world_size,message", [
    ("--train-iters 10 --rampup-batch-size 4 4 48", 1, "needs --train-samples"),
    ("--train-samples 100 --rampup-batch-size 0 4 48", 1, "must be positive"),
    ("--train-samples 100 --rampup-batch-size 4 4 0", 1, "must be positive"),
    ("--train-samples 100 --rampup-batch-size 32 4 48", 1, "START plus a whole number"),
    ("--train-samples 100 --rampup-batch-size 6 4 48", 1, "START plus a whole number"),
    ("--train-samples 100 --rampup-batch-size 2 2 48", 4, "multiples of --micro-batch-size"),
    # Chimera D=4 needs N a multiple of 4 above 4 (below: of its 2 pipes): the ramp's N = 2
    # and 4 run, its N = 6 cannot
    ("--train-samples 100 --rampup-batch-size 2 2 48 --pipeline-model-parallel-size 4 "
     "--chimera-pipes 2", 4, "the ramp's 6 micro-batches per iteration"),
    ("--train-samples 100 --rampup-batch-size 4 4 48 --pipeline-model-parallel-size 4 "
     "--pipeline-schedule chimera-zb --profile-iterations 2", 4, "--profile-iterations 2"),
    ("--train-samples 100 --rampup-batch-size 4 4", 1, "--rampup-batch-size"),
])
def test_errors_name_the_flag(extra, world_size, message):
    with pytest.raises(ConfigError) as info:
        parse(extra, world_size)
    text = str(info.value)
    assert "--rampup-batch-size" in text and message in text and "\n" not in text


def test_split_backward_schedules_do_not_profile_during_a_ramp():
    config = parse("--train-samples 120 --rampup-batch-size 4 4 48 "
                   "--pipeline-model-parallel-size 4 --pipeline-schedule chimera-zb", 4)
    assert config.training.profile_iterations == 0
    assert config.training.microbatch_counts() == [4, 8, 12, 16]
