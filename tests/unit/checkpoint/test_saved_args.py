"""check_checkpoint_args: model-defining arguments must match, layout and training may change."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_chimera.checkpoint.checkpointing import (
    CheckpointContents,
    CheckpointError,
    StageSlice,
    save_checkpoint,
)
from megatron_chimera.checkpoint.loading import CheckpointTarget, load_checkpoint
from megatron_chimera.checkpoint.saved_args import (
    CheckpointArgsError,
    check_checkpoint_args,
    checkpoint_args_mismatches,
)
from megatron_chimera.config import ConfigError
from megatron_chimera.model.family import GPT2
from megatron_chimera.model.gpt2 import GPTModel
from megatron_chimera.training.arguments import parse_args

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 1 --lr 1e-3 --train-iters 2 --mock-data --vocab-size 500").split()


def config(*flags: str, world_size: int = 1):
    return parse_args([*BASE, *flags], world_size=world_size)


def saved(*flags: str, world_size: int = 1) -> dict:
    return dataclasses.asdict(config(*flags, world_size=world_size))


def test_same_model_other_layout_and_training_flags_pass():
    args = saved("--pipeline-model-parallel-size", "4", "--chimera-pipes", "2",
                 "--global-batch-size", "8", world_size=8)
    now = config("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b",
                 "--hidden-dropout", "0", "--lr", "5e-4", "--bf16", "--seq-length", "8",
                 "--max-position-embeddings", "16", world_size=2)
    assert checkpoint_args_mismatches(args, now) == []
    check_checkpoint_args(now, args, "ckpt/iter_0000003")


@pytest.mark.parametrize("flags,needle", [
    (["--num-layers", "2"], "--num-layers: 4 in the checkpoint, 2 now"),
    (["--num-attention-heads", "8"], "--num-attention-heads: 4 in the checkpoint, 8 now"),
    (["--hidden-size", "128"], "--hidden-size: 64 in the checkpoint, 128 now"),
    (["--ffn-hidden-size", "128"], "--ffn-hidden-size: 256 in the checkpoint, 128 now"),
    (["--max-position-embeddings", "32"], "--max-position-embeddings: 16 in the checkpoint"),
    (["--vocab-size", "700"], "padded vocabulary"),
    (["--untie-embeddings-and-output-weights"], "--untie-embeddings-and-output-weights"),
])
def test_each_model_defining_flag_is_named(flags, needle):
    with pytest.raises(CheckpointError, match="saved from a different model") as err:
        check_checkpoint_args(config(*flags), saved(), "ckpt/iter_0000003")
    assert needle in str(err.value) and "ckpt/iter_0000003" in str(err.value)


def test_every_mismatch_in_one_error():
    mismatches = checkpoint_args_mismatches(saved(), config("--num-layers", "2",
                                                            "--num-attention-heads", "8"))
    assert len(mismatches) == 2


def test_a_4_layer_checkpoint_does_not_load_into_2_layers(tmp_path):
    four, two = config(), config("--num-layers", "2")
    model4 = GPTModel(dataclasses.replace(four.model, vocab_size=500))
    save_checkpoint(str(tmp_path), CheckpointContents(1, [StageSlice(0, (0, 4), model4)], [(0, 4)],
                                                      consumed_train_samples=1,
                                                      args=dataclasses.asdict(four),
                                                      save_optim=False), rank=0, world_size=1)
    model2 = GPTModel(dataclasses.replace(two.model, vocab_size=500))
    stage = [StageSlice(0, (0, 2), model2)]
    # the shapes fit: without the check this loads silently
    load_checkpoint(str(tmp_path), CheckpointTarget(stage, 1), rank=0, world_size=1)
    def check(args, path):
        check_checkpoint_args(two, args, path)

    with pytest.raises(CheckpointError, match="--num-layers: 4 in the checkpoint, 2 now"):
        load_checkpoint(str(tmp_path), CheckpointTarget(stage, 1, check_args=check),
                        rank=0, world_size=1)


# ----------------------------------------------------------------- one check for every checkpoint
@pytest.mark.parametrize("flags,needle", [
    (["--gelu", "erf"], "--gelu: megatron in the checkpoint, erf now"),
    (["--layernorm-epsilon", "1e-12"], "--layernorm-epsilon: 1e-05 in the checkpoint, 1e-12 now"),
    ([], "--tokenizer-type: NullTokenizer in the checkpoint, GPT2BPETokenizer now"),
])
def test_numerics_and_tokenizer_are_checked(flags, needle):
    now = config(*flags)
    if not flags:  # another tokenizer (its files are not read here)
        now = dataclasses.replace(now, data=dataclasses.replace(
            now.data, tokenizer_type="GPT2BPETokenizer"))
    with pytest.raises(CheckpointArgsError, match="saved from a different model") as err:
        check_checkpoint_args(now, saved(), "ckpt/iter_0000003")
    assert needle in str(err.value)
    assert "the checkpoint's model flags: --num-layers 4 --hidden-size 64" in str(err.value)
    # a flag problem (exit code 2) and a checkpoint problem alike
    assert isinstance(err.value, ConfigError) and isinstance(err.value, CheckpointError)
    assert err.value.exit_code == 2


def test_model_family_is_checked():
    bert = {**saved(), "model_family": "bert"}
    assert checkpoint_args_mismatches(bert, config(), family=GPT2) == [
        "the model family (pretrain_gpt2.py / pretrain_bert.py): bert in the checkpoint, gpt2 now"]
    assert checkpoint_args_mismatches(bert, config()) == []  # no family given: not compared
    assert checkpoint_args_mismatches({**saved(), "model_family": "gpt"}, config(),
                                      family=GPT2) == []  # earlier checkpoints' name


def test_model_config_only_and_imported_checkpoints():
    """Tools pass only a ModelConfig (no tokenizer compared); an imported checkpoint without a
    tokenizer records none, so any --tokenizer-type may train it."""
    assert checkpoint_args_mismatches(saved(), config("--gelu", "tanh").model) == [
        "--gelu: megatron in the checkpoint, tanh now"]
    imported = {**saved(), "imported_from": {"hf_dir": "x"}}
    imported["data"] = {**imported["data"], "tokenizer_type": None}
    now = config()
    now = dataclasses.replace(now, data=dataclasses.replace(now.data,
                                                            tokenizer_type="GPT2BPETokenizer"))
    assert checkpoint_args_mismatches(imported, now) == []


def test_older_checkpoints_without_a_field_are_not_refused():
    old = saved()
    old["model"] = {k: v for k, v in old["model"].items() if k not in ("gelu", "ffn_hidden_size")}
    assert checkpoint_args_mismatches(old, config("--gelu", "erf")) == []
