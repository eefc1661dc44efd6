"""The W&B flags' errors (before any process group) and the writers behind the monitor."""

from __future__ import annotations

import importlib.util

import pytest

from megatron_chimera.config import ConfigError
from megatron_chimera.training import scalar_writers
from megatron_chimera.training.arguments import parse_args
from megatron_chimera.training.scalar_writers import ScalarWriters, WandbWriter

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 1 --lr 1e-3 --train-iters 2 --mock-data --vocab-size 100").split()


@pytest.mark.parametrize("extra,message", [
    ("--wandb-exp-name e", "--wandb-exp-name requires --wandb-project"),
    ("--wandb-save-dir /tmp/w", "--wandb-save-dir requires --wandb-project"),
    ("--wandb-project p", "--wandb-project requires --wandb-exp-name"),
    ("--wandb-project p --wandb-exp-name e", "--wandb-project needs --wandb-save-dir or --save"),
])
def test_flag_errors(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_args([*BASE, *extra.split()], world_size=1)


def test_flags_and_default_directory(tmp_path):
    config = parse_args([*BASE, "--wandb-project", "p", "--wandb-exp-name", "e", "--save",
                         str(tmp_path)], world_size=1)
    assert (config.logging.wandb_project, config.logging.wandb_exp_name) == ("p", "e")
    assert scalar_writers.wandb_dir(config.logging, config.checkpoint.save) == \
        str(tmp_path / "wandb")


def test_missing_package_is_one_error(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(scalar_writers.importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="needs the wandb package: pip install"):
        parse_args([*BASE, "--wandb-project", "p", "--wandb-exp-name", "e",
                    "--wandb-save-dir", str(tmp_path)], world_size=1)


class _Recorder:
    def __init__(self):
        self.calls = []

    def add_scalar(self, *args):
        self.calls.append(("scalar", *args))

    def add_text(self, *args):
        self.calls.append(("text", *args))

    def log(self, data, step):
        self.calls.append(("log", data, step))

    def flush(self):
        self.calls.append(("flush",))

    def close(self):
        self.calls.append(("close",))

    def finish(self):
        self.calls.append(("finish",))


def test_fan_out_and_wandb_steps():
    a, b = _Recorder(), _Recorder()
    writers = ScalarWriters([a, b])
    writers.add_scalar("lm loss", 2.0, 3)
    writers.add_text("schedule-rebuild", "line", 3)
    writers.flush()
    writers.close()
    assert a.calls == b.calls == [("scalar", "lm loss", 2.0, 3), ("text", "schedule-rebuild",
                                  "line", 3), ("flush",), ("close",)]
    run = _Recorder()
    wandb = WandbWriter.__new__(WandbWriter)  # no wandb.init: a recording run
    wandb.run = run
    wandb.add_scalar("lm loss", 2, 3)
    wandb.add_scalar("lm loss vs samples", 2.0, 96)  # step = samples: not sent to W&B
    wandb.close()
    assert run.calls == [("log", {"lm loss": 2.0}, 3), ("finish",)]
