"""Preflight: --save writable with room, resume within --train-iters, splits with data."""

from __future__ import annotations

import os

import pytest

from megatron_chimera.config import ConfigError
from megatron_chimera.model.family import GPT2
from megatron_chimera.training.arguments import parse_args
from megatron_chimera.training.preflight import (
    PreflightError,
    check_resume_iteration,
    check_save_dir,
    check_splits,
    checkpoint_bytes,
)

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 1 --lr 1e-3 --train-iters 2 --mock-data --vocab-size 500").split()


def test_save_dir_is_created_and_probed(tmp_path):
    check_save_dir(str(tmp_path / "a" / "b"), 1)
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())


def test_save_under_a_file_fails(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(PreflightError, match="--save .*file/ckpt: cannot create"):
        check_save_dir(str(tmp_path / "file" / "ckpt"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_save_fails(tmp_path):
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o555)
    with pytest.raises(PreflightError, match="is not writable"):
        check_save_dir(str(tmp_path / "ro"))


def test_free_space_against_the_checkpoint_size(tmp_path):
    check_save_dir(str(tmp_path), 10**6, available=lambda path: 10**7)
    with pytest.raises(PreflightError, match=r"0\.00 GiB free, one checkpoint .* 0\.01 GiB"):
        check_save_dir(str(tmp_path), 10**7, available=lambda path: 10**6)


def test_checkpoint_bytes_counts_weights_and_optimizer():
    config = parse_args(BASE)
    with_optim = checkpoint_bytes(config, GPT2)
    without = checkpoint_bytes(parse_args([*BASE, "--no-save-optim"]), GPT2)
    assert with_optim == 3 * without  # fp32 weights + Adam's two moments


def test_resume_past_train_iters_blames_train_iters():
    config = parse_args(BASE)
    check_resume_iteration(2, config, "ckpt/iter_0000002")
    with pytest.raises(ConfigError, match=r"--train-iters 2 is below the iteration 4 of the "
                                          r"checkpoint ckpt/iter_0000004"):
        check_resume_iteration(4, config, "ckpt/iter_0000004")


def test_empty_training_split_is_named_and_empty_eval_splits_warn(tmp_path):
    for suffix in (".bin", ".idx"):
        (tmp_path / f"x{suffix}").write_bytes(b"")
    config = parse_args([*BASE[:-3], "--data-path", str(tmp_path / "x"), "--split", "100,0,0",
                         "--tokenizer-type", "NullTokenizer", "--vocab-size", "500"])
    with pytest.raises(PreflightError, match=r"--data-path .*x --split 100,0,0: the training "
                                             r"split is empty"):
        check_splits(config, None, None, None, remaining_iters=2, warn=None)
    warnings: list[str] = []
    check_splits(config, [1], None, None, remaining_iters=2, warn=warnings.append)
    assert len(warnings) == 2 and "validation split is empty" in warnings[0]
    assert "--eval-iters 0" in warnings[0] and "test split is empty" in warnings[1]
    warnings.clear()
    check_splits(parse_args([*BASE, "--eval-iters", "0"]), [1], None, None, 2, warnings.append)
    assert warnings == []
    check_splits(config, None, None, None, remaining_iters=0, warn=None)  # nothing to train
