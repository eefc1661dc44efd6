"""Batch sizes, iteration counts and stage splits of a run, and its optimizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_chimera.config.flag import flag, non_negative, positive
from megatron_chimera.config.model import GPT

PARTITION_METHODS = ("uniform", "parameters", "time")  # --partition-method
DEFAULT_PROFILE_ITERATIONS = 3  # the first is a warm-up, the other two are measured


@dataclass(frozen=True)
class LayerSplit:
    """Megatron's uneven-stage flags (resolved by :mod:`megatron_chimera.model.stage_split`):
    a layout string, the first / last stage's layers, or the embedding / loss counted as layers.
    All unset: ``--partition-method`` splits."""

    FLAG_GROUP: ClassVar[str] = "distributed"

    pipeline_model_parallel_layout: str | None = flag(
        None, "--pipeline-model-parallel-layout", after="--partition-method",
        help="uneven stages as Megatron's layout string: E embedding, t layer, L loss, | stage "
             "boundary, x*k and (...)*k repeat, e.g. \"Et*3|t*2|t*2|tL\" (Chimera: one pipe's "
             "stages, the mirror pipe holds the same)")
    decoder_first_pipeline_num_layers: int | None = flag(
        None, "--decoder-first-pipeline-num-layers", type=int,
        help="transformer layers of the first stage (the other layers split evenly over the "
             "remaining stages)")
    decoder_last_pipeline_num_layers: int | None = flag(
        None, "--decoder-last-pipeline-num-layers", type=int,
        help="transformer layers of the last stage (the other layers split evenly over the "
             "remaining stages)")
    account_for_embedding_in_pipeline_split: bool = flag(
        False, "--account-for-embedding-in-pipeline-split",
        help="count the embedding as one layer when splitting: the first stage holds one layer "
             "less")
    account_for_loss_in_pipeline_split: bool = flag(
        False, "--account-for-loss-in-pipeline-split",
        help="count the loss (final norm, head) as one layer when splitting: the last stage "
             "holds one layer less")

    @property
    def given(self) -> bool:
        """Whether any of the flags is set."""
        return self != LayerSplit()


@dataclass(frozen=True)
class TrainingConfig:
    """Batch sizes, iteration counts, evaluation cadence, seed; ``num_microbatches`` derived."""

    FLAG_GROUP: ClassVar[str] = "training"

    micro_batch_size: int = flag(1, "--micro-batch-size", help="samples per micro-batch",
                                 required=True, check=positive)
    global_batch_size: int = flag(
        1, "--global-batch-size", derived=True, check=positive,
        help="samples per iteration (default micro batch x data-parallel size)")
    # --rampup-batch-size START INCREMENT SAMPLES: the global batch grows from START by
    # INCREMENT over the first SAMPLES samples (Megatron's ramp; needs --train-samples)
    rampup_batch_size: tuple[int, int, int] | None = flag(
        None, "--rampup-batch-size", type=int, nargs=3,
        metavar=("START", "INCREMENT", "SAMPLES"),
        help="START INCREMENT SAMPLES: the global batch grows from START by INCREMENT over the "
             "first SAMPLES samples to --global-batch-size (needs --train-samples; one schedule "
             "per number of micro-batches, built once; no --profile-iterations)")
    allow_data_order_change: bool = flag(
        False, "--allow-data-order-change",
        help="resume although --global-batch-size differs from the checkpoint's (no ramp-up): "
             "no sample is skipped or repeated, but global batches group them differently "
             "from the uninterrupted run (logged)")
    calculate_per_token_loss: bool = flag(
        False, "--calculate-per-token-loss", family=GPT,
        help="the loss is the mean over the global batch's trained tokens (every micro-batch, "
             "data-parallel rank and pipe; counted at each iteration's start) instead of the "
             "mean of each micro-batch's token mean")
    num_microbatches: int = 1  # N = global batch / (micro batch x data-parallel size)
    train_iters: int | None = flag(None, "--train-iters", type=int, check=positive,
                                   help="iterations to train")
    train_samples: int | None = flag(None, "--train-samples", type=int, check=positive,
                                     help="samples to train (instead of --train-iters)")
    exit_interval: int | None = flag(None, "--exit-interval", type=int, check=positive,
                                     help="save and exit after this many iterations")
    # save and exit once the job's wall clock passes this many minutes (agreed across ranks)
    exit_duration_in_mins: float | None = flag(
        None, "--exit-duration-in-mins", type=float, check=positive,
        help="save and exit (status 0) at the first iteration boundary after the job has run "
             "this many minutes (wall clock from the earliest rank's start, agreed across ranks)")
    exit_signal_handler: bool = flag(
        False, "--exit-signal-handler",
        help="on SIGTERM to any rank (scancel, preemption, torchrun): save at the next iteration "
             "boundary (the ranks agree) and exit 0")
    eval_interval: int = flag(1000, "--eval-interval", check=positive,
                              help="validate every this many iterations")
    eval_iters: int = flag(100, "--eval-iters", check=non_negative,
                           help="iterations per validation / test evaluation")
    seed: int = flag(1234, "--seed", help="random seed (weights, dropout, data order)")
    # stop on a NaN/Inf loss or gradient (Megatron's --check-for-nan-in-loss-and-grad, on)
    check_for_nan_in_loss_and_grad: bool = flag(
        True, "--no-check-for-nan-in-loss-and-grad",
        help="no NaN/Inf check of the losses and gradients (Megatron-LM's flag)")
    max_consecutive_skipped_iterations: int = flag(
        100, "--max-consecutive-skipped-iterations", check=non_negative,
        help="stop when the optimizer skips this many iterations in a row (fp16 overflow at "
             "every loss scale); 0: no bound")
    partition_method: str = flag(
        "uniform", "--partition-method", choices=PARTITION_METHODS, group="distributed",
        after="--num-layers-per-virtual-pipeline-stage",
        help="layers per stage: uniform counts, balanced parameters, or balanced measured time "
             "(embedding and LM head included; for Chimera the time of each rank's stage "
             "replicas together)")
    layer_split: LayerSplit = LayerSplit()  # uneven stages by Megatron's flags (else the method)
    # split-backward schedules: time F/B/W during the first K iterations, then rebuild the
    # order for the measured costs (0: never; resolved from --profile-iterations)
    profile_iterations: int = flag(
        0, "--profile-iterations", type=int, derived=True, check=non_negative,
        group="distributed", after="--account-for-loss-in-pipeline-split",
        help="split-backward schedules (chimera-zb, zb-h1): time F, B, W per stage during the "
             "first K iterations (the first one a warm-up when K > 1), then rebuild the order "
             f"for the measured costs; 0 turns it off (default {DEFAULT_PROFILE_ITERATIONS}, or "
             "0 with --chimera-zb-costs)")

    @property
    def total_train_iters(self) -> int:
        """Iterations to run: ``--train-iters``, or ``--train-samples`` / global batch (the
        ramp-up's iterations counted as Megatron does: the ramp, then the constant batch)."""
        if self.train_iters is not None:
            return self.train_iters
        if self.rampup_batch_size is None:
            return (self.train_samples or 0) // self.global_batch_size
        iterations, consumed = self._rampup_phase()
        return iterations + ((self.train_samples or 0) - consumed) // self.global_batch_size

    @property
    def total_train_samples(self) -> int:
        """The samples all iterations consume (datasets and the LR schedule are sized by it)."""
        if self.rampup_batch_size is None:
            return self.total_train_iters * self.global_batch_size
        iterations, consumed = self._rampup_phase()
        return consumed + (self.total_train_iters - iterations) * self.global_batch_size

    def _rampup_phase(self) -> tuple[int, int]:
        """(iterations, samples) of the ramp: Megatron counts every iteration that starts at
        or before SAMPLES consumed samples."""
        assert self.rampup_batch_size is not None
        iterations = consumed = 0
        while consumed <= self.rampup_batch_size[2]:
            consumed += self.global_batch_at(consumed)
            iterations += 1
        return iterations, consumed

    def global_batch_at(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after ``consumed_samples`` samples:
        START + INCREMENT x (consumed / (SAMPLES / increments)) during the ramp (Megatron's
        rule), the full ``global_batch_size`` after it."""
        if self.rampup_batch_size is None:
            return self.global_batch_size
        start, increment, samples = self.rampup_batch_size
        increments = (self.global_batch_size - start) // increment
        if consumed_samples > samples or increments == 0:
            return self.global_batch_size
        steps = int(consumed_samples / (samples / increments))
        return min(start + steps * increment, self.global_batch_size)

    def num_microbatches_at(self, consumed_samples: int) -> int:
        """N of the iteration that starts after ``consumed_samples`` samples."""
        per_microbatch = self.global_batch_size // self.num_microbatches  # micro batch x W
        return self.global_batch_at(consumed_samples) // per_microbatch

    def microbatch_counts(self) -> list[int]:
        """Every N the run uses, the final one last (one schedule each)."""
        if self.rampup_batch_size is None:
            return [self.num_microbatches]
        start, increment, _ = self.rampup_batch_size
        per_microbatch = self.global_batch_size // self.num_microbatches
        return [batch // per_microbatch
                for batch in range(start, self.global_batch_size + 1, increment)]



@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer, learning-rate schedule, clipping and mixed-precision loss scaling."""

    FLAG_GROUP: ClassVar[str] = "optimizer"

    optimizer: str = flag("adam", "--optimizer", choices=("adam", "sgd"),
                          help="adam (AdamW semantics, as Megatron) or sgd")
    lr: float = flag(1e-4, "--lr", help="peak learning rate", required=True, check=non_negative)
    min_lr: float = flag(0.0, "--min-lr", help="learning rate floor of the decay",
                         check=non_negative)
    lr_decay_style: str = flag("linear", "--lr-decay-style",
                               choices=("constant", "linear", "cosine"),
                               help="constant, linear or cosine")
    lr_decay_samples: int | None = flag(
        None, "--lr-decay-samples", type=int, check=positive,
        help="decay period in samples (default --train-samples)")
    lr_warmup_samples: int = flag(0, "--lr-warmup-samples", derived=True, check=non_negative,
                                  help="linear warmup in samples")
    # of the decay samples; overrides lr_warmup_samples
    lr_warmup_fraction: float | None = flag(
        None, "--lr-warmup-fraction", type=float,
        help="linear warmup as a fraction of the decay period")
    weight_decay: float = flag(0.01, "--weight-decay", check=non_negative,
                               help="decoupled weight decay (not on biases and layer norms)")
    adam_beta1: float = flag(0.9, "--adam-beta1", help="Adam beta1")
    adam_beta2: float = flag(0.999, "--adam-beta2", help="Adam beta2")
    adam_eps: float = flag(1e-8, "--adam-eps", help="Adam epsilon")
    sgd_momentum: float = flag(0.9, "--sgd-momentum", help="SGD momentum")
    clip_grad: float = flag(1.0, "--clip-grad", check=non_negative,
                            help="clip the global gradient norm to this (0: off)")
    fp16: bool = flag(False, "--fp16", group="mixed precision",
                      help="fp16 model with fp32 main parameters and loss scaling")
    bf16: bool = flag(False, "--bf16", group="mixed precision",
                      help="bf16 model with fp32 main parameters")
    # constant scale when set, dynamic otherwise (fp16)
    loss_scale: float | None = flag(None, "--loss-scale", type=float, group="mixed precision",
                                    check=positive,
                                    help="constant fp16 loss scale (default dynamic)")
    initial_loss_scale: float = flag(2.0**32, "--initial-loss-scale", group="mixed precision",
                                     help="initial dynamic loss scale")
    min_loss_scale: float = flag(1.0, "--min-loss-scale", group="mixed precision",
                                 help="floor of the dynamic loss scale")
    loss_scale_window: int = flag(1000, "--loss-scale-window", group="mixed precision",
                                  check=positive,
                                  help="iterations without overflow before the scale doubles")
    hysteresis: int = flag(2, "--hysteresis", group="mixed precision", check=positive,
                           help="overflows tolerated before the scale halves")
    use_apex: bool | None = None  # False with --no-apex
