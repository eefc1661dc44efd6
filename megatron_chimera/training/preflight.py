"""Checks run before the first iteration, so a run fails in seconds instead of after hours.

* ``--save`` must be writable (a probe file is created and removed) and, where the filesystem
  says so, have room for one checkpoint of this model (weights + optimizer state, estimated
  from the analytic parameter count) -- otherwise the first save fails after ``--save-interval``
  iterations of lost work.
* A checkpoint past ``--train-iters`` is an error naming ``--train-iters``.
* An empty training split is an error naming ``--data-path`` and ``--split``; an empty
  validation or test split while evaluation is requested is a warning (Megatron silently skips
  the evaluation; recipes with ``--split 100,0,0`` rely on that, so it stays allowed).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from megatron_chimera.atomic import temp_path_beside
from megatron_chimera.config import ConfigError, TrainConfig
from megatron_chimera.errors import UserError
from megatron_chimera.model.family import ModelFamily
from megatron_chimera.model.memory import bytes_per_parameter
from megatron_chimera.model.partition import count_parameters


class PreflightError(UserError):
    """An output location or input split that would make the run fail later; names the flag."""


def free_bytes(path: str) -> int:
    """Bytes available to this user on the filesystem of ``path``."""
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def checkpoint_bytes(config: TrainConfig, family: ModelFamily) -> int:
    """About the size of one checkpoint: every parameter in the model's dtype (the tied
    embedding twice when pipelined), plus the optimizer state unless ``--no-save-optim``."""
    model = config.model
    params = count_parameters(model, family)
    if config.parallel.pipeline_model_parallel_size > 1:
        params += model.padded_vocab_size * model.hidden_size  # the last stage's tied copy
    per = bytes_per_parameter(model.params_dtype, config.optimizer.optimizer,
                              config.optimizer.sgd_momentum)
    width = per["param"] + (0 if config.checkpoint.no_save_optim else per["optimizer"])
    return params * width


def _gib(count: int) -> str:
    return f"{count / 2**30:.2f} GiB"


def check_save_dir(save: str, expected_bytes: int = 0,
                   available: Callable[[str], int] = free_bytes) -> None:
    """Create ``save`` if missing, prove it writable, and check it has ``expected_bytes`` free."""
    try:
        os.makedirs(save, exist_ok=True)
    except OSError as exc:
        raise PreflightError(f"--save {save}: cannot create the directory "
                             f"({exc.strerror or exc})") from None
    probe = temp_path_beside(os.path.join(save, ".write-probe"))
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.write(fd, b"probe")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise PreflightError(
            f"--save {save} is not writable ({exc.strerror or exc}): the first checkpoint "
            "would fail after --save-interval iterations") from None
    if expected_bytes > 0:
        try:
            room = available(save)
        except OSError:
            return  # no figure to compare with
        if room < expected_bytes:
            raise PreflightError(
                f"--save {save}: {_gib(room)} free, one checkpoint of this model needs about "
                f"{_gib(expected_bytes)}")


def check_outputs(config: TrainConfig, family: ModelFamily) -> None:
    """The output checks of a run (today: ``--save``), on every rank before distributed start."""
    if config.checkpoint.save is not None:
        check_save_dir(config.checkpoint.save, checkpoint_bytes(config, family))


def check_resume_iteration(iteration: int, config: TrainConfig, path: str) -> None:
    """A loaded checkpoint must not be past the run's last iteration."""
    training = config.training
    total = training.total_train_iters
    if iteration > total:
        flag = (f"--train-iters {training.train_iters}" if training.train_iters is not None
                else f"--train-samples {training.train_samples} ({total} iterations)")
        raise ConfigError(
            f"{flag} is below the iteration {iteration} of the checkpoint {path}: raise it to "
            f"train further (or --finetune to restart the count)")


def _data_source(data) -> str:
    """The flags that name the run's data, for messages."""
    if data.mock_data:
        return "--mock-data"
    if data.split_data_paths is not None:
        return " ".join(f"--{name}-data-path {' '.join(paths)}" for name, paths in
                        zip(("train", "valid", "test"), data.split_data_paths) if paths)
    return f"--data-path {' '.join(data.data_path)} --split {data.split}"


def check_splits(config: TrainConfig, train_ds, valid_ds, test_ds, remaining_iters: int,
                 warn: Callable[[str], None] | None) -> None:
    """Fail on an empty training split (when iterations remain); warn (``warn``, on one rank)
    about requested evaluation that has no data."""
    data, training = config.data, config.training
    source = _data_source(data)
    if remaining_iters > 0 and (train_ds is None or len(train_ds) == 0):
        fix = ("give --train-data-path" if data.split_data_paths and not data.mock_data
               else "change --split or check the data")
        raise PreflightError(f"{source}: the training split is empty (no documents); {fix}")
    if warn is None or training.eval_iters == 0:
        return
    if valid_ds is None and training.eval_interval:
        warn(f"warning: {source}: the validation split is empty, so the evaluation every "
             f"--eval-interval {training.eval_interval} iterations is skipped "
             "(--eval-iters 0 silences this)")
    if test_ds is None:
        warn(f"warning: {source}: the test split is empty, so the test evaluation at the end "
             "is skipped (--eval-iters 0 silences this)")
