"""The decoder-architecture flags (Megatron's names and defaults) become ModelConfig fields;
Megatron's refused combinations, and T not dividing the query groups, fail before any process
group with one line naming the flag; BERT's entry script refuses them."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_chimera.config import ConfigError
from megatron_chimera.model.family import BERT, GPT2
from megatron_chimera.model.flags import model_flags
from megatron_chimera.training.arguments import parse_args
from megatron_chimera.training.flag_catalog import family_flag_errors

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 8 --seq-length 16 "
        "--micro-batch-size 2 --lr 1e-3 --train-iters 2 --mock-data --vocab-size 100").split()
LLAMA = ("--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --group-query-attention "
         "--num-query-groups 2 --disable-bias-linear --position-embedding-type rope "
         "--rotary-base 500000 --use-rope-scaling --untie-embeddings-and-output-weights").split()


def test_llama_flags_build_the_model_config():
    model = parse_args([*BASE, *LLAMA], world_size=1).model
    assert (model.normalization, model.layernorm_epsilon, model.swiglu) == ("RMSNorm", 1e-6, True)
    assert (model.num_query_groups, model.add_bias_linear, model.add_qkv_bias) == (2, False, False)
    assert (model.position_embedding_type, model.rotary_base, model.use_rope_scaling) == (
        "rope", 500000, True)
    assert model.ffn_size == int(4 * 64 * 2 / 3 / 64) * 64
    assert family_flag_errors(parse_args([*BASE, *LLAMA], world_size=1), GPT2) == []


def test_defaults_are_megatrons():
    model = parse_args(BASE, world_size=1).model
    assert (model.normalization, model.swiglu, model.num_query_groups) == ("LayerNorm", False,
                                                                          None)
    assert (model.add_bias_linear, model.position_embedding_type) == (True, "learned_absolute")
    assert (model.rotary_base, model.rotary_percent, model.query_groups) == (10000, 1.0, 8)
    # --group-query-attention alone: Megatron's one query group
    assert parse_args([*BASE, "--group-query-attention"], world_size=1).model.query_groups == 1


def test_model_flags_write_every_architecture_setting():
    """The one writer (autotuner command, checkpoint hint) spells the model so that parsing its
    flags builds the same ModelConfig."""
    model = parse_args([*BASE, *LLAMA, "--kv-channels", "16", "--add-qkv-bias",
                        "--rotary-percent", "0.5", "--rope-scaling-factor", "16"],
                       world_size=1).model
    again = parse_args([*model_flags(model, seq_length=16), "--micro-batch-size", "2", "--lr",
                        "1e-3", "--train-iters", "2", "--mock-data", "--vocab-size", "100"],
                       world_size=1).model
    assert _canonical(again) == _canonical(model)


def _canonical(model):
    """The same model with its defaulted sizes spelled out."""
    return dataclasses.replace(model, ffn_hidden_size=model.ffn_size,
                               max_position_embeddings=model.max_positions)


@pytest.mark.parametrize("flags, message", [
    (["--num-query-groups", "2"], "--num-query-groups requires --group-query-attention"),
    (["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups 3 must divide"),
    (["--rotary-base", "500000"], "--rotary-base requires --position-embedding-type rope"),
    (["--norm-epsilon", "1e-6", "--layernorm-epsilon", "1e-6"], "not both"),
    (["--kv-channels", "0"], "--kv-channels must be positive"),
    (["--rotary-interleaved"], "--rotary-interleaved is not supported"),
    (["--swiglu", "--gelu", "erf"], "--gelu has no effect with --swiglu"),
    (["--swiglu", "--no-bias-gelu-fusion"], "--no-bias-gelu-fusion has no effect"),
])
def test_refused_combinations(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args([*BASE, *flags], world_size=1)


def test_tensor_parallel_size_must_divide_the_query_groups():
    with pytest.raises(ConfigError, match="--num-query-groups"):
        parse_args([*BASE, "--group-query-attention", "--num-query-groups", "1",
                    "--tensor-model-parallel-size", "2"], world_size=2)
    parse_args([*BASE, *LLAMA, "--tensor-model-parallel-size", "2", "--sequence-parallel"],
               world_size=2)


def test_bert_refuses_the_gpt_architecture_flags():
    config = parse_args([*BASE, "--swiglu", "--position-embedding-type", "rope"], world_size=1)
    errors = family_flag_errors(config, BERT)
    assert any("--swiglu" in e for e in errors)
    assert any("--position-embedding-type" in e for e in errors)
