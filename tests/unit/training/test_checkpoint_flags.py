"""--use-checkpoint-args (the model flags from --load's checkpoint, the command line winning)
and --exit-on-missing-checkpoint (no checkpoint under --load: one error, not a fresh start)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_chimera.checkpoint.checkpointing import (
    COMMON_FILENAME,
    TRACKER_FILENAME,
    atomic_torch_save,
    checkpoint_dir,
)
from megatron_chimera.config import ConfigError
from megatron_chimera.training.arguments import parse_args

TRAINING = ("--micro-batch-size 2 --global-batch-size 16 --lr 1e-3 --train-iters 20 "
            "--mock-data").split()
MODEL = ("--num-layers 3 --hidden-size 48 --num-attention-heads 6 --seq-length 24 "
         "--ffn-hidden-size 100 --layernorm-epsilon 1e-6 --gelu erf "
         "--untie-embeddings-and-output-weights --vocab-size 300").split()


def fake_checkpoint(root, argv, iteration=5, family="gpt2"):
    """A checkpoint directory whose common.pt records the configuration ``argv`` parses to (and
    model family ``family``)."""
    config = parse_args(argv, world_size=1)
    path = checkpoint_dir(str(root), iteration)
    (root / f"iter_{iteration:07d}").mkdir(parents=True)
    atomic_torch_save({"iteration": iteration, "args": {**dataclasses.asdict(config),
                                                        "model_family": family}},
                      f"{path}/{COMMON_FILENAME}")
    (root / TRACKER_FILENAME).write_text(f"{iteration}\n")
    return config


def test_use_checkpoint_args_takes_the_model_flags(tmp_path):
    saved = fake_checkpoint(tmp_path, [*TRAINING, *MODEL])
    config = parse_args([*TRAINING, "--load", str(tmp_path), "--use-checkpoint-args"],
                        world_size=1)
    # the same model (positions spelled out: --max-position-embeddings 24 = --seq-length 24)
    assert config.model == dataclasses.replace(saved.model, max_position_embeddings=24)
    assert config.data.vocab_size == 300
    # a flag given on the command line wins (the load then checks it against the checkpoint)
    mine = parse_args([*TRAINING, "--load", str(tmp_path), "--use-checkpoint-args",
                       "--seq-length", "16", "--hidden-dropout", "0"], world_size=1)
    assert mine.model.seq_length == 16 and mine.model.hidden_dropout == 0
    assert mine.model.max_positions == 24  # the checkpoint's position embeddings
    assert mine.model.num_layers == 3 and mine.model.gelu == "erf"


def test_without_the_flag_the_model_flags_are_required(tmp_path):
    fake_checkpoint(tmp_path, [*TRAINING, *MODEL])
    with pytest.raises(ConfigError, match="--num-layers is required"):
        parse_args([*TRAINING, "--load", str(tmp_path)], world_size=1)


@pytest.mark.parametrize("extra,message", [
    (["--use-checkpoint-args"], "--use-checkpoint-args requires --load"),
    (["--exit-on-missing-checkpoint"], "--exit-on-missing-checkpoint requires --load"),
])
def test_flags_need_load(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_args([*TRAINING, *MODEL, *extra], world_size=1)


def test_missing_checkpoint(tmp_path, capsys):
    empty = str(tmp_path)
    # without the flag: from scratch (the load says so); with it: one error naming it
    assert parse_args([*TRAINING, *MODEL, "--load", empty], world_size=1).checkpoint.load == empty
    with pytest.raises(ConfigError) as info:
        parse_args([*TRAINING, *MODEL, "--load", empty, "--exit-on-missing-checkpoint"],
                   world_size=1)
    assert "--exit-on-missing-checkpoint" in str(info.value) and empty in str(info.value)
    # --use-checkpoint-args on an empty directory: the command line's model, with a note
    config = parse_args([*TRAINING, *MODEL, "--load", empty, "--use-checkpoint-args"],
                        world_size=1)
    assert config.model.num_layers == 3 and "no checkpoint arguments" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--exit-on-missing-checkpoint"):
        parse_args([*TRAINING, *MODEL, "--load", empty, "--use-checkpoint-args",
                    "--exit-on-missing-checkpoint"], world_size=1)
    fake_checkpoint(tmp_path, [*TRAINING, *MODEL])
    assert parse_args([*TRAINING, "--load", empty, "--use-checkpoint-args",
                       "--exit-on-missing-checkpoint"], world_size=1).model.num_layers == 3


@pytest.mark.parametrize("extra,message", [
    (["--async-save"], "--async-save requires --save"),
    (["--async-save", "--save", "x", "--ckpt-format", "torch"],
     "--async-save requires --ckpt-format torch_dist"),
])
def test_async_save_needs_save_and_torch_dist(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_args([*TRAINING, *MODEL, *extra], world_size=1)


def test_ckpt_format_defaults_to_torch_dist():
    config = parse_args([*TRAINING, *MODEL], world_size=1)
    assert config.checkpoint.ckpt_format == "torch_dist" and not config.checkpoint.async_save


@pytest.mark.parametrize("script,saved,message", [
    ("pretrain_bert", "gpt2", "holds a GPT-family model: train it with pretrain_gpt2.py, not "
                              "pretrain_bert.py"),
    ("pretrain_gpt2", "bert", "holds a BERT model: train it with pretrain_bert.py, not "
                              "pretrain_gpt2.py"),
])
def test_a_checkpoint_of_the_other_family_names_its_entry_script(tmp_path, script, saved,
                                                                 message):
    import importlib

    # GPT's untied output layer is a flag BERT refuses: the checkpoint is named, not the flag
    fake_checkpoint(tmp_path, [*TRAINING, *MODEL], family=saved)
    main = importlib.import_module(script).main
    with pytest.raises(ConfigError) as info:
        main([*TRAINING, "--load", str(tmp_path), "--use-checkpoint-args"])
    assert str(info.value) == f"--load {tmp_path} {message}"
