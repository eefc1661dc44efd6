"""Checkpointing and logging settings, and the record of everything one run needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_chimera.config.data import DataConfig
from megatron_chimera.config.flag import flag, positive
from megatron_chimera.config.model import ModelConfig
from megatron_chimera.config.moe import MoEConfig
from megatron_chimera.config.parallel import DDPConfig, ParallelConfig
from megatron_chimera.config.training import LayerSplit, OptimizerConfig, TrainingConfig


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoint directories and what to save / load."""

    FLAG_GROUP: ClassVar[str] = "checkpointing"

    save: str | None = flag(None, "--save", help="checkpoint directory to write")
    load: str | None = flag(None, "--load", help="checkpoint directory to resume from")
    save_interval: int | None = flag(None, "--save-interval", type=int, check=positive,
                                     help="save every this many iterations")
    no_save_optim: bool = flag(False, "--no-save-optim", help="do not save the optimizer state")
    no_load_optim: bool = flag(False, "--no-load-optim", help="do not load the optimizer state")
    no_load_rng: bool = flag(False, "--no-load-rng",
                             help="do not restore the random-number generator states")
    finetune: bool = flag(False, "--finetune", help="load weights only and start at iteration 0")
    # a --load without a checkpoint is an error instead of training from scratch
    exit_on_missing_checkpoint: bool = flag(
        False, "--exit-on-missing-checkpoint",
        help="a --load directory without a checkpoint is an error (exit code 2, before any "
             "process group) instead of training from scratch")
    # torch_dist: every rank writes its own pieces (DCP); torch: one file per stage
    ckpt_format: str = flag(
        "torch_dist", "--ckpt-format", choices=("torch_dist", "torch"),
        help="torch_dist: every rank saves and loads only its own shards through "
             "torch.distributed.checkpoint (any layout loads); torch: one file per stage with "
             "full tensors. Loading reads either")
    # --async-save: torch_dist checkpoints written in the background (checkpoint/async_save.py)
    async_save: bool = flag(
        False, "--async-save",
        help="torch_dist: stage each checkpoint in host memory and write it in the background "
             "while training goes on (the next save and the exit wait for it)")


@dataclass(frozen=True)
class LoggingConfig:
    """stdout and TensorBoard logging cadence and content."""

    FLAG_GROUP: ClassVar[str] = "logging"

    log_interval: int = flag(100, "--log-interval", check=positive,
                             help="print the log line every this many iterations")
    tensorboard_dir: str | None = flag(None, "--tensorboard-dir",
                                       help="write TensorBoard scalars here")
    tensorboard_log_interval: int = flag(
        1, "--tensorboard-log-interval", check=positive,
        help="write TensorBoard scalars every this many iterations")
    log_throughput: bool = flag(
        False, "--log-throughput",
        help="TFLOP/s per GPU in the log line and TensorBoard (throughput)")
    log_timers_to_tensorboard: bool = flag(
        False, "--log-timers-to-tensorboard",
        help="timers in TensorBoard under Megatron's names (forward-backward-time, "
             "optimizer-time, ...)")
    # --timing-log-level: >= 1 synchronises the device in every timer (training/monitor.py)
    timing_log_level: int = flag(
        0, "--timing-log-level", choices=(0, 1, 2),
        help="0: timers record CUDA events, read at logging iterations (no device sync inside "
             "the step); 1 or 2: every timer synchronises the device at start and stop "
             "(Megatron's accurate per-part timers; the same set of timers at both levels)")
    log_memory_to_tensorboard: bool = flag(
        False, "--log-memory-to-tensorboard",
        help="allocated / reserved CUDA memory (CPU: resident set size) of every rank in "
             "TensorBoard")
    log_bubble_ratio: bool = True
    log_straggler: bool = flag(
        False, "--log-straggler",
        help="name a rank whose compute runs persistently slower than the schedule predicts "
             "relative to the other ranks (from the busy times the log gathers; no extra "
             "collective), with a TensorBoard scalar per rank")
    straggler_minmax_count: int = flag(
        1, "--straggler-minmax-count", check=positive,
        help="how many slowest and fastest ranks the straggler line shows")
    # write the measured timeline (Chrome / Perfetto JSON)
    pipeline_trace: str | None = flag(
        None, "--pipeline-trace", metavar="FILE",
        help="write the measured per-rank timeline of two iterations (after a warm-up one) to "
             "FILE as a Chrome / Perfetto trace: compute actions, sends, waits for messages, "
             "gradient reductions, optimizer step (tools/plot_schedule.py --measured FILE draws "
             "it)")
    # Weights & Biases (training/scalar_writers.py): the same scalars as TensorBoard
    wandb_project: str | None = flag(
        None, "--wandb-project",
        help="Weights & Biases project: the logging rank writes the TensorBoard scalars there "
             "too (needs --wandb-exp-name and the wandb package; WANDB_MODE=offline works "
             "without a network)")
    wandb_exp_name: str | None = flag(None, "--wandb-exp-name",
                                      help="Weights & Biases run name (with --wandb-project)")
    wandb_save_dir: str | None = flag(None, "--wandb-save-dir",
                                      help="directory of the W&B files (default <--save>/wandb)")


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs, built by ``arguments.parse_args`` and validated."""

    model: ModelConfig
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    data: DataConfig
    training: TrainingConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    ddp: DDPConfig = DDPConfig()
    extra: tuple[tuple[str, object], ...] = ()  # flags added by an extra_args_provider

    def extra_arg(self, name: str, default: object = None) -> object:
        """Value of a flag registered by the entry script's ``extra_args_provider``."""
        return dict(self.extra).get(name, default)


# The sections that declare flags, in the order the parser reads them.
FLAG_SECTIONS: tuple[type, ...] = (ModelConfig, MoEConfig, ParallelConfig, TrainingConfig,
                                   LayerSplit, OptimizerConfig, DDPConfig, DataConfig,
                                   CheckpointConfig, LoggingConfig)
