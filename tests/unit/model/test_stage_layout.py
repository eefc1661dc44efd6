"""Megatron's uneven-stage flags: the layout string, first/last stage layers, embedding / loss
counted as layers -- parsed into layer ranges, or refused in one line naming the flag."""

from __future__ import annotations

import pytest

from megatron_chimera.config import ConfigError, LayerSplit
from megatron_chimera.model.stage_split import (
    expand_layout,
    format_layout,
    layout_partition,
    split_partition,
)
from megatron_chimera.training.arguments import parse_args, parse_args_and_schedule

BASE = ("--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 1 --global-batch-size 8 --lr 1e-3 --train-iters 2 --mock-data "
        "--vocab-size 500").split()
CHIMERA = ["--pipeline-model-parallel-size", "4", "--chimera-pipes", "2"]


def test_expand_megatron_syntax():
    assert expand_layout("Et*3|t*2|t*2|tL") == ["Ettt", "tt", "tt", "tL"]
    # Megatron's documented example (PP16 VPP2: 32 stages, commas cosmetic)
    stages = expand_layout("Et*3|(tt|)*29,m|L")
    assert len(stages) == 32 and stages[0] == "Ettt" and stages[-2:] == ["m", "L"]
    assert expand_layout("E(t(t|)*2)*2L") == ["Ett", "t", "tt", "t", "L"]  # nested groups


def test_layout_partition_and_round_trip():
    partition = layout_partition("Et*3|t*2|t*2|tL", 8, 4)
    assert partition == [(0, 3), (3, 5), (5, 7), (7, 8)]
    assert format_layout(partition) == "Et*3|t*2|t*2|tL"


@pytest.mark.parametrize("layout, message", [
    ("Et*3|t*2|t*2|L", "holds 7 transformer layers, --num-layers is 8"),
    ("Et*3|t*2|t*2|t", "the loss L must close the last stage"),
    ("t*3|Et*2|t*2|tL", "the embedding E must open the first stage"),
    ("Et*4|t*2|tL", "has 3 stages, the schedule has 4"),
    ("Et*3|t*2|t*2|tLL", "the loss L must close the last stage, once"),
    ("Et*4|t*3||tL", "stage 2 holds no transformer layer"),
    ("Et*3|t*2|t*2|x", "cannot read 'x'"),
    ("Et*3|t*2|t*2|mL", "multi-token prediction"),
])
def test_bad_layouts_are_refused_naming_the_flag(layout, message):
    with pytest.raises(ConfigError) as info:
        layout_partition(layout, 8, 4)
    text = str(info.value)
    assert text.startswith("--pipeline-model-parallel-layout") and message in text
    assert "\n" not in text


def test_first_last_and_account_flags():
    def split(**kw):
        return split_partition(LayerSplit(**kw), 8, 4, 4)
    assert split(decoder_first_pipeline_num_layers=2) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert split(decoder_first_pipeline_num_layers=5) == [(0, 5), (5, 6), (6, 7), (7, 8)]
    assert split(decoder_last_pipeline_num_layers=2, decoder_first_pipeline_num_layers=2) \
        == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # 7 layers + the loss = 8 over 4 stages: the last stage holds one layer less
    assert split_partition(LayerSplit(account_for_loss_in_pipeline_split=True), 7, 4, 4) \
        == [(0, 2), (2, 4), (4, 6), (6, 7)]
    # 8 layers + embedding + loss = 10: not divisible by 4 stages (Megatron's rule)
    with pytest.raises(ConfigError, match="--account-for-embedding-in-pipeline-split and "
                                          "--account-for-loss-in-pipeline-split"):
        split(account_for_loss_in_pipeline_split=True, account_for_embedding_in_pipeline_split=True)
    assert split_partition(LayerSplit(account_for_embedding_in_pipeline_split=True,
                                      account_for_loss_in_pipeline_split=True), 10, 4, 4) \
        == [(0, 2), (2, 5), (5, 8), (8, 10)]
    with pytest.raises(ConfigError, match="--decoder-first-pipeline-num-layers 3: the "
                                          "remaining 5 layers do not divide"):
        split(decoder_first_pipeline_num_layers=3)
    assert split() is None


def test_flags_reach_the_config_and_refusals_before_any_group():
    config, schedule = parse_args_and_schedule(
        [*BASE, *CHIMERA, "--pipeline-model-parallel-layout", "Et*3|t*2|t*2|tL"], world_size=4)
    assert config.training.layer_split.pipeline_model_parallel_layout == "Et*3|t*2|t*2|tL"
    assert schedule.num_stages == 4
    with pytest.raises(ConfigError, match="^--pipeline-model-parallel-layout 'Et\\*3\\|t\\*2\\|"
                                          "t\\*2\\|L' holds 7 transformer layers"):
        parse_args([*BASE, *CHIMERA, "--pipeline-model-parallel-layout", "Et*3|t*2|t*2|L"],
                   world_size=4)
    with pytest.raises(ConfigError, match="cannot be combined"):
        parse_args([*BASE, *CHIMERA, "--pipeline-model-parallel-layout", "Et*3|t*2|t*2|tL",
                    "--decoder-first-pipeline-num-layers", "3"], world_size=4)
    with pytest.raises(ConfigError, match="--partition-method parameters cannot be combined"):
        parse_args([*BASE, *CHIMERA, "--account-for-loss-in-pipeline-split",
                    "--partition-method", "parameters"], world_size=4)
    # interleaved: the layout lists all D x v virtual stages, in Megatron's order
    config = parse_args([*BASE, "--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                         "interleaved", "--num-virtual-stages-per-pipeline-rank", "2",
                         "--pipeline-model-parallel-layout", "Et*2|t*2|t*2|t*2L"], world_size=2)
    assert config.training.layer_split.given
