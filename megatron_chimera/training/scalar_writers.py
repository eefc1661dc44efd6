"""Where the monitor's scalars go: TensorBoard (``--tensorboard-dir``) and Weights & Biases
(``--wandb-project``, ``--wandb-exp-name``, ``--wandb-save-dir``), behind one writer interface
(``add_scalar``, ``add_text``, ``flush``, ``close``), created on the logging rank only.

W&B gets the same names and values at the same iterations as TensorBoard. Its x-axis is the
iteration (steps must not go back), so TensorBoard's ``<name> vs samples`` copies, whose step is
the consumed samples, are not sent (W&B plots any scalar against another). ``wandb`` is an
optional dependency (``pip install megatron_chimera[wandb]``); offline mode
(``WANDB_MODE=offline``) writes the run under the save directory without a network.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

from megatron_chimera.config import ConfigError, LoggingConfig

VS_SAMPLES = " vs samples"  # TensorBoard's copy of a scalar over consumed samples
WANDB_INSTALL = "pip install 'megatron_chimera[wandb]' (or pip install wandb)"


def wandb_dir(logging: LoggingConfig, save: str | None) -> str:
    """``--wandb-save-dir``, else ``<--save>/wandb`` (Megatron's default)."""
    if logging.wandb_save_dir:
        return logging.wandb_save_dir
    if save is None:
        raise ConfigError("--wandb-project needs --wandb-save-dir or --save (the W&B files go "
                          "to <save>/wandb)")
    return os.path.join(save, "wandb")


def check_wandb_flags(logging: LoggingConfig, save: str | None) -> None:
    """The W&B flags' errors, before any process group: the other two need ``--wandb-project``,
    which needs ``--wandb-exp-name``, a directory and the ``wandb`` package."""
    if logging.wandb_project is None:
        for flag, value in (("--wandb-exp-name", logging.wandb_exp_name),
                            ("--wandb-save-dir", logging.wandb_save_dir)):
            if value is not None:
                raise ConfigError(f"{flag} requires --wandb-project")
        return
    if not logging.wandb_exp_name:
        raise ConfigError("--wandb-project requires --wandb-exp-name (the run's name)")
    wandb_dir(logging, save)
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"--wandb-project needs the wandb package: {WANDB_INSTALL}")


class WandbWriter:
    """The TensorBoard writer's interface over one W&B run (``wandb.init`` on creation)."""

    def __init__(self, logging: LoggingConfig, save: str | None, config: Any) -> None:
        import wandb

        directory = wandb_dir(logging, save)
        os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(project=logging.wandb_project, name=logging.wandb_exp_name,
                              dir=directory, config=dataclasses.asdict(config))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """``tag`` = ``value`` at iteration ``step`` (``... vs samples`` copies are dropped)."""
        if not tag.endswith(VS_SAMPLES):
            self.run.log({tag: float(value)}, step=int(step))

    def add_text(self, tag: str, text: str, step: int) -> None:
        """A text entry, as W&B's run summary line of ``tag`` at ``step``."""
        self.run.log({tag: text}, step=int(step))

    def flush(self) -> None:
        """Nothing to do: W&B writes in its own process."""

    def close(self) -> None:
        """Finish the run (its files complete)."""
        self.run.finish()


class ScalarWriters:
    """Several writers behind one: every call goes to each."""

    def __init__(self, writers: list[Any]) -> None:
        self.writers = writers

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """Write one scalar to every writer."""
        for writer in self.writers:
            writer.add_scalar(tag, value, step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        """Write one text entry to every writer."""
        for writer in self.writers:
            writer.add_text(tag, text, step)

    def flush(self) -> None:
        """Flush every writer."""
        for writer in self.writers:
            writer.flush()

    def close(self) -> None:
        """Close every writer."""
        for writer in self.writers:
            writer.close()


def create_writer(config: Any) -> ScalarWriters | None:
    """The logging rank's writer for ``config`` (a TrainConfig): TensorBoard and / or W&B, or
    None when neither is asked for."""
    logging = config.logging
    writers: list[Any] = []
    if logging.tensorboard_dir:
        from torch.utils.tensorboard import SummaryWriter

        writers.append(SummaryWriter(log_dir=logging.tensorboard_dir, max_queue=1000))
    if logging.wandb_project:
        writers.append(WandbWriter(logging, config.checkpoint.save, config))
    return ScalarWriters(writers) if writers else None
