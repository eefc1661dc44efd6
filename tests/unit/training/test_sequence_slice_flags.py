"""--pipeline-sequence-slices k: the sliced schedule it builds, the loop's sizes (sequences, not
units) and every refusal, naming the flag."""

from __future__ import annotations

import pytest

from megatron_chimera.config import ConfigError
from megatron_chimera.model.dropout_rng import KeyedMicrobatch
from megatron_chimera.model.sequence_slices import SLICE
from megatron_chimera.training.arguments import parse_args_and_schedule
from megatron_chimera.training.running_schedule import needed_microbatches, p2p_tensor_shape
from megatron_chimera.training.training import sliced_units

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 1 --global-batch-size 4 --lr 1e-3 --train-iters 2 --mock-data "
        "--vocab-size 500 --hidden-dropout 0 --attention-dropout 0 "
        "--pipeline-model-parallel-size 2").split()


def parse(extra: str, world_size: int = 2):
    return parse_args_and_schedule(BASE + extra.split(), world_size=world_size)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "chimera", "chimera-zb"])
def test_sliced_schedule_counts_units_and_sequences(name):
    config, schedule = parse(f"--pipeline-schedule {name} --pipeline-sequence-slices 4")
    assert config.parallel.pipeline_sequence_slices == 4
    assert (schedule.sequence_slices, schedule.num_microbatches, schedule.num_sequences) == (
        4, 16, 4)
    assert config.training.num_microbatches == 4  # sequences: what the data gives
    assert p2p_tensor_shape(config) == (8, 1, 64)  # one slice's tokens
    assert needed_microbatches(schedule, 1, all_stages=False) is None  # every stage: the cache
    assert config.training.profile_iterations == 0  # the rebuild of a sliced order: opt-in


def test_units_are_slices_of_the_read_sequences_each_keyed():
    import torch
    batch = {"text": torch.arange(9).view(1, 9), "loss_mask": torch.ones(1, 8),
             "position_ids": torch.arange(8).view(1, 8)}
    units = sliced_units([KeyedMicrobatch(7, batch), KeyedMicrobatch(8, None)], 2)
    assert len(units) == 4 and units[2].batch is None and units[3].batch is None
    assert units[0].batch["text"].tolist() == [[0, 1, 2, 3, 4]]
    assert units[1].batch["position_ids"].tolist() == [[4, 5, 6, 7]]
    assert units[0].batch[SLICE].cache is units[1].batch[SLICE].cache
    assert len({u.key for u in units}) == 4  # every slice draws its own dropout masks


@pytest.mark.parametrize("extra,world,message", [
    ("--pipeline-schedule gpipe --pipeline-sequence-slices 2", 2, "--pipeline-schedule gpipe"),
    ("--pipeline-schedule chimera --chimera-concat direct --global-batch-size 8 "
     "--pipeline-sequence-slices 2", 2, "--chimera-concat"),
    ("--pipeline-sequence-slices 3", 2, "--seq-length 32"),
    ("--pipeline-sequence-slices 2 --context-parallel-size 2", 4, "--context-parallel-size"),
    ("--pipeline-schedule 1f1b --pipeline-sequence-slices 2 --profile-iterations 1 "
     "--train-iters 3", 2, "--profile-iterations applies to split-backward"),
    ("--pipeline-sequence-slices 0", 2, "--pipeline-sequence-slices"),
])
def test_refusals_name_the_flag(extra, world, message, capsys):
    with pytest.raises((ConfigError, SystemExit)) as info:
        parse(extra, world)
    text = str(info.value) if info.type is ConfigError else capsys.readouterr().err
    assert message in text
