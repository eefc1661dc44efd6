"""The MoE and expert-parallel flags build MoEConfig / ParallelConfig fields with Megatron's
defaults, round-trip through the model-flag writer, and every unsupported combination fails
before any process group with one message naming its flag."""

from __future__ import annotations

import pytest

from megatron_chimera.config import ConfigError, MoEConfig, flag_fields
from megatron_chimera.model.family import BERT, GPT2
from megatron_chimera.model.flags import model_flags
from megatron_chimera.training.arguments import parse_args
from megatron_chimera.training.flag_catalog import family_flag_errors

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 16 "
        "--micro-batch-size 2 --lr 1e-3 --train-iters 2 --mock-data --vocab-size 100").split()
MOE = ("--num-experts 8 --moe-router-topk 1 --moe-router-score-function sigmoid "
       "--moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 --moe-expert-capacity-factor 1.25 "
       "--moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 48 "
       "--moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type alltoall "
       "--moe-grouped-gemm --moe-per-layer-logging").split()


def test_moe_flags_build_the_config():
    config = parse_args([*BASE, *MOE, "--moe-layer-freq", "([1]*1+[0])*2",
                         "--expert-model-parallel-size", "2"], world_size=2)
    moe = config.model.moe
    assert (moe.num_experts, moe.moe_router_topk, moe.moe_router_score_function) == (
        8, 1, "sigmoid")
    assert (moe.moe_aux_loss_coeff, moe.moe_z_loss_coeff, moe.moe_expert_capacity_factor) == (
        0.01, 0.001, 1.25)
    assert (moe.moe_ffn_hidden_size, moe.moe_shared_expert_intermediate_size) == (32, 48)
    assert moe.moe_layers(4) == (True, False, True, False)
    assert (moe.moe_token_dispatcher_type, moe.moe_grouped_gemm) == ("alltoall", True)
    assert config.parallel.expert_model_parallel_size == 2
    assert config.parallel.layout.expert_parallel_ranks(0, 0) == [0, 1]
    assert family_flag_errors(config, GPT2) == []
    errors = family_flag_errors(config, BERT)  # BERT's entry script refuses every MoE flag
    assert any(e.startswith("--num-experts applies to") for e in errors)
    assert len(errors) == sum(w.startswith("--") for w in MOE) + 1  # + --moe-layer-freq


def test_tensor_parallel_moe_needs_sequence_parallelism():
    config = parse_args([*BASE, "--num-experts", "4", "--tensor-model-parallel-size", "2",
                         "--sequence-parallel", "--expert-model-parallel-size", "2"],
                        world_size=4)
    assert config.parallel.layout.expert_parallel_ranks(0, 0) == [0, 1]  # both tensor ranks


def test_megatron_defaults_and_model_flags_round_trip():
    assert parse_args(BASE, world_size=1).model.moe == MoEConfig()
    defaults = parse_args([*BASE, "--num-experts", "4"], world_size=1).model.moe
    assert (defaults.moe_router_topk, defaults.moe_router_load_balancing_type,
            defaults.moe_token_dispatcher_type, defaults.moe_layer_freq,
            defaults.moe_expert_capacity_factor) == (2, "aux_loss", "allgather", 1, None)
    model = parse_args([*BASE, *MOE, "--moe-layer-freq", "[0,1,1,0]"], world_size=1).model
    again = parse_args([*BASE, *model_flags(model)[6:]], world_size=1).model
    # what the model is round-trips; how it runs (dispatcher, GEMM, logging) is not written
    for field, spec in flag_fields(MoEConfig):
        if spec.model:
            assert getattr(again.moe, field.name) == getattr(model.moe, field.name), field.name
    assert again.moe.moe_token_dispatcher_type == "allgather"


@pytest.mark.parametrize("extra, world, flag", [
    ("--num-experts 6 --expert-model-parallel-size 4", 4, "--num-experts"),
    ("--num-experts 8 --expert-model-parallel-size 3", 3, "--expert-model-parallel-size"),
    ("--expert-model-parallel-size 2", 2, "--expert-model-parallel-size"),
    ("--num-experts 4 --tensor-model-parallel-size 2", 2, "--sequence-parallel"),
    ("--num-experts 4 --expert-tensor-parallel-size 2", 1, "--expert-tensor-parallel-size"),
    ("--num-experts 4 --context-parallel-size 2", 2, "--context-parallel-size"),
    ("--num-experts 4 --expert-model-parallel-size 2 --save /tmp/x --ckpt-format torch", 2,
     "--ckpt-format"),
    ("--num-experts 4 --moe-layer-freq [0,0,0,0]", 1, "--moe-layer-freq"),
    ("--num-experts 4 --moe-layer-freq [1,0]", 1, "--moe-layer-freq"),
    ("--num-experts 4 --moe-layer-freq __import__('os')", 1, "--moe-layer-freq"),
    ("--num-experts 4 --moe-router-topk 5", 1, "--moe-router-topk"),
    ("--num-experts 4 --moe-router-pre-softmax --moe-router-score-function sigmoid", 1,
     "--moe-router-pre-softmax"),
])
def test_unsupported_combinations_name_their_flag(extra, world, flag):
    with pytest.raises(ConfigError, match=flag.replace("-", r"\-")):
        parse_args([*BASE, *extra.split()], world_size=world)


def test_expert_parallel_checkpoints_are_accepted_in_torch_dist(tmp_path):
    config = parse_args([*BASE, *f"--num-experts 4 --expert-model-parallel-size 2 --save "
                         f"{tmp_path} --load {tmp_path}".split()], world_size=2)
    assert config.checkpoint.ckpt_format == "torch_dist"


def test_family_check_reads_nested_flag_sections_only():
    """A schedule's options record is a dataclass too, but not a flag section."""
    config = parse_args([*BASE, "--num-experts", "4", "--pipeline-model-parallel-size", "2",
                         "--pipeline-schedule", "chimera-zb", "--global-batch-size", "8"],
                        world_size=2)
    assert family_flag_errors(config, GPT2) == []
    assert family_flag_errors(config, BERT) == [
        e for e in family_flag_errors(config, BERT) if e.startswith("--num-experts")]
