"""Megatron's command-line flags parsed into frozen configuration dataclasses.

``parse_args(argv, world_size)`` returns a validated :class:`~megatron_chimera.config.TrainConfig`;
``parse_args_and_schedule`` also returns the run's schedule, built once during validation.
Validation runs on every rank before any process group exists: an inconsistent setting raises
:class:`~megatron_chimera.config.ConfigError` whose one-line message names the flag, so all ranks
fail the same way without blocking. Entry scripts turn it into ``error: <message>`` and exit 2.
The schedule flags (``--pipeline-schedule`` and each schedule's options) come from the schedule
registry (:mod:`megatron_chimera.schedules.registry`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence

from megatron_chimera.checkpoint.saved_args import read_common, saved_run_flags
from megatron_chimera.config import (
    GELU_VARIANTS,
    NORMALIZATIONS,
    POSITION_EMBEDDING_TYPES,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    DDPConfig,
    LayerSplit,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainConfig,
    TrainingConfig,
)
from megatron_chimera.data.tokenizers import TOKENIZER_TYPES
from megatron_chimera.errors import DEBUG_FLAG
from megatron_chimera.layout import ParallelLayout
from megatron_chimera.model.document_attention import IMPLEMENTATIONS as DOCUMENT_ATTENTIONS
from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.registry import (
    SPLIT_BACKWARD_SCHEDULES,
    add_schedule_arguments,
    spec_and_options_from,
)
from megatron_chimera.training.config_checks import build_schedule_for, validate
from megatron_chimera.training.flag_catalog import apply_help, refused_flag_message

__all__ = ["build_parser", "parse_args", "parse_args_and_schedule", "validate",
           "build_schedule_for", "add_architecture_arguments", "architecture_fields"]

PARTITION_METHODS = ("uniform", "parameters", "time")
DEFAULT_PROFILE_ITERATIONS = 3  # the first is a warm-up, the other two are measured


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(refused_flag_message(message) or message)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("network size")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true")
    g.add_argument("--bert-no-binary-head", action="store_false", dest="bert_binary_head")
    g.add_argument("--no-masked-softmax-fusion", action="store_false",
                   dest="masked_softmax_fusion")
    g.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion")
    g.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion")
    g.add_argument("--use-flash-attn", action="store_true")
    g.add_argument("--document-attention", choices=DOCUMENT_ATTENTIONS, default="auto")
    g.add_argument("--gelu", choices=GELU_VARIANTS, default="megatron",
                   help="megatron: tanh approximation in the MLP, exact in BERT's LM head; "
                        "tanh / erf: that form everywhere (Hugging Face's gelu_new / gelu)")
    g.add_argument("--no-apex", action="store_true",
                   help="use torch-native kernels even when NVIDIA Apex is importable")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    add_architecture_arguments(g)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)


def add_architecture_arguments(g: argparse._ActionsContainer) -> None:
    """Today's decoders (Megatron's flags and defaults): normalisation, SwiGLU, head sizes,
    grouped-query attention, biases, position embeddings."""
    g.add_argument("--normalization", choices=NORMALIZATIONS, default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=None, dest="norm_epsilon")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--position-embedding-type", choices=POSITION_EMBEDDING_TYPES,
                   default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--use-rope-scaling", action="store_true")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0)


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--no-async-tensor-model-parallel-allreduce", action="store_false",
                   dest="async_tensor_model_parallel_allreduce")
    g.add_argument("--no-scatter-gather-tensors-in-pipeline", action="store_true")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    add_schedule_arguments(g)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved: layers per model chunk (alternative to "
                        "--num-virtual-stages-per-pipeline-rank)")
    g.add_argument("--partition-method", choices=PARTITION_METHODS, default="uniform")
    g.add_argument("--pipeline-model-parallel-layout", default=None)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    g.add_argument("--profile-iterations", type=int, default=None)
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None)
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="accumulate and reduce gradients in fp32 buffers (always on with --bf16)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="reduce each gradient bucket as soon as it is final, during the stage's "
                        "last backward (otherwise each stage once its last backward is done)")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per gradient bucket (default: max(40M, 1M x stage-replica "
                        "group size) with --overlap-grad-reduce, else one bucket per stage)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard fp32 main parameters and optimizer state over each "
                        "stage-replica group (ZeRO-1)")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="all-gather updated parameters in the background; each stage waits "
                        "before its first forward (needs --use-distributed-optimizer)")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false",
                   dest="gradient_accumulation_fusion",
                   help="materialise each weight gradient and add it into the gradient buffer "
                        "in a hook, instead of computing it straight into main_grad")
    g.add_argument("--allow-cpu-training", action="store_true",
                   help="with --distributed-backend gloo on a machine with CUDA devices: train "
                        "on the CPU on purpose (refused otherwise)")


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"))
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--exit-signal-handler", action="store_true")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true", default=True)
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad",
                   help="no NaN/Inf check of the losses and gradients (Megatron-LM's flag)")
    g.add_argument("--max-consecutive-skipped-iterations", type=int, default=100)
    g = parser.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"),
                   default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=None)
    g.add_argument("--lr-warmup-samples", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", default=None)
    g.add_argument("--train-data-path", nargs="*", default=None)
    g.add_argument("--valid-data-path", nargs="*", default=None)
    g.add_argument("--test-data-path", nargs="*", default=None)
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-impl", choices=("mmap", "infer"), default="mmap")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--mask-prob", type=float, default=0.15)
    g.add_argument("--short-seq-prob", type=float, default=0.1)
    g.add_argument("--no-whole-word-masking", action="store_false", dest="whole_word_masking")
    g.add_argument("--masking-max-ngram", type=int, default=3)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")


def _add_checkpoint_and_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--use-checkpoint-args", action="store_true")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")
    g.add_argument("--ckpt-format", default="torch_dist", choices=("torch_dist", "torch"))
    g.add_argument("--async-save", action="store_true")
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--timing-log-level", type=int, default=0, choices=(0, 1, 2),
                   help="0: timers record CUDA events, read at logging iterations (no device "
                        "sync inside the step); 1 or 2: every timer synchronises the device at "
                        "start and stop (Megatron's accurate per-part timers; the same set of "
                        "timers at both levels)")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true")
    g.add_argument("--pipeline-trace", default=None, metavar="FILE")
    g.add_argument("--wandb-project", default=None)
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--wandb-save-dir", default=None)
    g.add_argument(DEBUG_FLAG, action="store_true")


def build_parser(
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
) -> argparse.ArgumentParser:
    """The full Megatron-style parser; ``extra_args_provider`` may add script-specific flags."""
    parser = _ArgumentParser(description="megatron_chimera arguments", allow_abbrev=False)
    _add_model_args(parser)
    _add_parallel_args(parser)
    _add_training_args(parser)
    _add_data_args(parser)
    _add_checkpoint_and_logging_args(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    apply_help(parser)
    return parser


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _require(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) is None:
            raise ConfigError(f"--{name.replace('_', '-')} is required")


def _known_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {action.dest for action in parser._actions}  # noqa: SLF001 (argparse has no API)


def parse_args(
    argv: Sequence[str] | None = None,
    world_size: int | None = None,
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
    defaults: dict[str, object] | None = None,
) -> TrainConfig:
    """Parse Megatron flags into a validated TrainConfig; raises ConfigError naming the flag.

    ``world_size`` defaults to torchrun's ``WORLD_SIZE`` (1 without torchrun). ``defaults``
    overrides flag defaults (as Megatron's ``args_defaults``), e.g. a tokenizer for BERT.
    """
    return parse_args_and_schedule(argv, world_size, extra_args_provider, defaults)[0]


def parse_args_and_schedule(
    argv: Sequence[str] | None = None,
    world_size: int | None = None,
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
    defaults: dict[str, object] | None = None,
) -> tuple[TrainConfig, Schedule]:
    """:func:`parse_args` and the run's validated schedule (built once, here)."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    base_parser = build_parser()
    parser = build_parser(extra_args_provider)
    if defaults:
        parser.set_defaults(**defaults)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.use_checkpoint_args:
        args = parser.parse_args([*_checkpoint_flags(args), *argv])
    extra_names = sorted(_known_flags(parser) - _known_flags(base_parser))
    extra = tuple((name, getattr(args, name)) for name in extra_names)
    config = _build_config(args, world_size, extra)
    return config, validate(config, world_size)


def _checkpoint_flags(args: argparse.Namespace) -> list[str]:
    """``--use-checkpoint-args``: the model flags of ``--load``'s latest checkpoint (the command
    line, parsed after them, wins); none when it holds no checkpoint (a note, or the error of
    ``--exit-on-missing-checkpoint``)."""
    if args.load is None:
        raise ConfigError("--use-checkpoint-args requires --load")
    if not os.path.isdir(args.load):
        raise ConfigError(f"--load directory {args.load} does not exist")
    common = read_common(args.load)
    flags = saved_run_flags(common) if common is not None else []
    if not flags and not args.exit_on_missing_checkpoint and os.environ.get("RANK", "0") == "0":
        print(f" --use-checkpoint-args: no checkpoint arguments in {args.load}; using the "
              "command line's", flush=True)
    return flags


def _build_config(
    args: argparse.Namespace, world_size: int, extra: tuple[tuple[str, object], ...]
) -> TrainConfig:
    """Namespace -> TrainConfig, checking the flags that must be present and derivations."""
    _require(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
             "micro_batch_size", "lr")
    _check_positive(args)
    if args.fp16 and args.bf16:
        raise ConfigError("--fp16 and --bf16 are mutually exclusive")
    pipeline_size = args.pipeline_model_parallel_size
    data_parallel = ParallelLayout.from_world(world_size, args.tensor_model_parallel_size,
                                              pipeline_size).data
    global_batch = args.global_batch_size or args.micro_batch_size * data_parallel
    if global_batch % (args.micro_batch_size * data_parallel):
        raise ConfigError(
            f"--global-batch-size {global_batch} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {data_parallel}"
        )
    num_microbatches = global_batch // (args.micro_batch_size * data_parallel)
    _check_rampup(args, global_batch, args.micro_batch_size * data_parallel)
    schedule, options = _schedule(args, pipeline_size)
    args.profile_iterations = _profile_iterations(args, schedule, global_batch)
    return TrainConfig(
        model=_model_config(args),
        parallel=_pick(ParallelConfig, args, data_parallel_size=data_parallel,
                       pipeline_schedule=schedule, schedule_options=options),
        optimizer=_optimizer_config(args, global_batch),
        data=_data_config(args),
        training=_training_config(args, global_batch, num_microbatches),
        checkpoint=_pick(CheckpointConfig, args),
        logging=_pick(LoggingConfig, args),
        ddp=_ddp_config(args),
        extra=extra,
    )


def _data_config(args: argparse.Namespace) -> DataConfig:
    """``--data-path`` with ``--split`` (default 969,30,1), or the per-split paths: never both."""
    per_split = {f"--{name}-data-path": getattr(args, f"{name}_data_path")
                 for name in ("train", "valid", "test")}
    given = [flag for flag, value in per_split.items() if value is not None]
    if given and args.data_path is not None:
        raise ConfigError(f"{given[0]} and --data-path are mutually exclusive (per-split files "
                          "or one corpus split by --split)")
    if given and args.split is not None:
        raise ConfigError(f"--split applies to --data-path, not to {given[0]} (each per-split "
                          "path is one whole split)")
    return _pick(DataConfig, args, split=args.split or DataConfig.split,
                 **{name: tuple(getattr(args, name)) if getattr(args, name) is not None else None
                    for name in ("data_path", "train_data_path", "valid_data_path",
                                 "test_data_path")})


def _check_rampup(args: argparse.Namespace, global_batch: int, per_microbatch: int) -> None:
    """``--rampup-batch-size START INCREMENT SAMPLES``: Megatron's conditions, and every batch
    of the ramp a whole number of micro-batches (micro batch x data-parallel size)."""
    if args.rampup_batch_size is None:
        return
    start, increment, samples = args.rampup_batch_size
    flag = f"--rampup-batch-size {start} {increment} {samples}"
    if args.train_samples is None:
        raise ConfigError(f"{flag} needs --train-samples (the ramp is in samples; Megatron "
                          "refuses it with --train-iters)")
    if start <= 0 or increment <= 0 or samples <= 0:
        raise ConfigError(f"{flag}: START, INCREMENT and SAMPLES must be positive")
    if start > global_batch or (global_batch - start) % increment:
        raise ConfigError(f"{flag}: --global-batch-size {global_batch} must be START plus a "
                          "whole number of INCREMENTs")
    if start % per_microbatch or increment % per_microbatch:
        raise ConfigError(f"{flag}: START and INCREMENT must be multiples of --micro-batch-size "
                          f"x data-parallel size = {per_microbatch}")
    if args.profile_iterations:
        raise ConfigError(f"{flag} and --profile-iterations {args.profile_iterations} exclude "
                          "each other (the rebuild is made for one number of micro-batches; "
                          "give --chimera-zb-costs instead)")


def _ddp_config(args: argparse.Namespace) -> DDPConfig:
    """Gradient-buffer and data-parallel flags (bf16 always accumulates in fp32, as Megatron)."""
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer")
    return DDPConfig(grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32 or args.bf16,
                     overlap_grad_reduce=args.overlap_grad_reduce,
                     bucket_size=args.ddp_bucket_size,
                     use_distributed_optimizer=args.use_distributed_optimizer,
                     overlap_param_gather=args.overlap_param_gather,
                     gradient_accumulation_fusion=args.gradient_accumulation_fusion)


def _pick(cls: type, args: argparse.Namespace, **overrides: object):
    """Build dataclass ``cls`` from the namespace entries named like its fields."""
    values = {name: getattr(args, name) for name in _field_names(cls) if hasattr(args, name)}
    values.update(overrides)
    return cls(**values)


def _check_positive(args: argparse.Namespace) -> None:
    positive = ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                "micro_batch_size", "global_batch_size", "train_iters", "train_samples",
                "pipeline_model_parallel_size", "tensor_model_parallel_size", "ffn_hidden_size",
                "chimera_max_inflight",
                "max_position_embeddings", "make_vocab_size_divisible_by", "log_interval",
                "eval_interval", "save_interval", "exit_interval", "exit_duration_in_mins",
                "vocab_size",
                "num_layers_per_virtual_pipeline_stage", "chimera_pipes",
                "num_virtual_stages_per_pipeline_rank", "ddp_bucket_size",
                "recompute_num_layers", "loss_scale_window", "hysteresis",
                "tensorboard_log_interval", "lr_decay_iters", "lr_decay_samples",
                "masking_max_ngram", "kv_channels", "num_query_groups")
    for name in positive:
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")
    non_negative = ("eval_iters", "num_workers", "lr", "min_lr", "weight_decay", "clip_grad",
                    "max_consecutive_skipped_iterations",
                    "lr_warmup_iters", "lr_warmup_samples", "distributed_timeout_minutes")
    for name in non_negative:
        value = getattr(args, name)
        if value is not None and value < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    if args.distributed_timeout_minutes == 0:
        raise ConfigError("--distributed-timeout-minutes must be positive")
    for name in ("hidden_dropout", "attention_dropout", "mask_prob", "short_seq_prob"):
        value = getattr(args, name)
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 1), got {value}")


def _schedule(args: argparse.Namespace, pipeline_size: int) -> tuple[str, object]:
    """The schedule name and its typed options from the registry's flags; Megatron's
    ``--num-layers-per-virtual-pipeline-stage`` becomes the virtual stages per rank."""
    per_chunk = args.num_layers_per_virtual_pipeline_stage
    if per_chunk is not None:
        if args.pipeline_schedule != "interleaved":
            raise ConfigError("--num-layers-per-virtual-pipeline-stage requires "
                              "--pipeline-schedule interleaved")
        if args.num_virtual_stages_per_pipeline_rank is not None:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage and "
                              "--num-virtual-stages-per-pipeline-rank are mutually exclusive")
        if args.num_layers % (per_chunk * pipeline_size):
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage {per_chunk} x "
                f"--pipeline-model-parallel-size {pipeline_size} does not divide "
                f"--num-layers {args.num_layers}")
        args.num_virtual_stages_per_pipeline_rank = args.num_layers // (per_chunk * pipeline_size)
    try:
        spec, options = spec_and_options_from(args)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if spec.name == "interleaved" and args.num_virtual_stages_per_pipeline_rank is None:
        raise ConfigError("--pipeline-schedule interleaved requires "
                          "--num-layers-per-virtual-pipeline-stage or "
                          "--num-virtual-stages-per-pipeline-rank")
    return spec.name, options


def _profile_iterations(args: argparse.Namespace, schedule: str, global_batch: int) -> int:
    """``--profile-iterations`` resolved: the default for a split-backward schedule whose costs
    are not fixed by hand (at most the iterations but one), else 0; an explicit K must leave an
    iteration to run the rebuilt order and needs a split-backward schedule."""
    given = args.profile_iterations
    total = args.train_iters if args.train_iters is not None else \
        (args.train_samples or 0) // global_batch
    if given is None:
        if (schedule not in SPLIT_BACKWARD_SCHEDULES or args.chimera_zb_costs is not None
                or args.rampup_batch_size is not None):
            return 0
        return max(0, min(DEFAULT_PROFILE_ITERATIONS, total - 1))
    if given < 0:
        raise ConfigError(f"--profile-iterations must be >= 0, got {given}")
    if given and schedule not in SPLIT_BACKWARD_SCHEDULES:
        raise ConfigError(f"--profile-iterations applies to split-backward schedules "
                          f"({', '.join(SPLIT_BACKWARD_SCHEDULES)}), not --pipeline-schedule "
                          f"{schedule}")
    if total and given >= total:  # (no iterations at all is --train-iters' error)
        raise ConfigError(f"--profile-iterations {given} must be smaller than the {total} "
                          f"training iterations (the rebuilt order runs after them)")
    return given


def _model_config(args: argparse.Namespace) -> ModelConfig:
    params_dtype = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    use_apex = False if args.no_apex else None
    # The vocabulary is known only once the tokenizer is built (pretrain replaces it).
    return _pick(ModelConfig, args, params_dtype=params_dtype, use_apex=use_apex,
                 vocab_size=args.vocab_size or ModelConfig.vocab_size,
                 **architecture_fields(args))


def architecture_fields(args: argparse.Namespace) -> dict[str, object]:
    """ModelConfig fields of :func:`add_architecture_arguments`' flags that are not read by
    name: the query groups and the norm epsilon (either spelling)."""
    return {"num_query_groups": _query_groups(args), "layernorm_epsilon": _norm_epsilon(args)}


def _query_groups(args: argparse.Namespace) -> int | None:
    """``--num-query-groups`` (Megatron's default 1) with ``--group-query-attention``, else None
    (one key/value head per attention head)."""
    if not args.group_query_attention:
        if args.num_query_groups is not None:
            raise ConfigError("--num-query-groups requires --group-query-attention")
        return None
    return 1 if args.num_query_groups is None else args.num_query_groups


def _norm_epsilon(args: argparse.Namespace) -> float:
    """``--norm-epsilon`` (Megatron's current name) or ``--layernorm-epsilon`` (its older one)."""
    older = getattr(args, "layernorm_epsilon", ModelConfig.layernorm_epsilon)
    if args.norm_epsilon is None:
        return older
    if older != ModelConfig.layernorm_epsilon:
        raise ConfigError("give --norm-epsilon or --layernorm-epsilon, not both")
    return args.norm_epsilon


def _optimizer_config(args: argparse.Namespace, global_batch: int) -> OptimizerConfig:
    """Iteration-based LR flags become samples (as Megatron does)."""
    if args.lr_warmup_fraction is not None and (
        args.lr_warmup_iters is not None or args.lr_warmup_samples is not None
    ):
        raise ConfigError(
            "--lr-warmup-fraction cannot be combined with --lr-warmup-iters / --lr-warmup-samples"
        )
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction <= 1.0:
        raise ConfigError(f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}")
    if args.train_iters is not None and args.train_samples is not None:
        raise ConfigError("--train-iters and --train-samples are mutually exclusive")
    if args.train_iters is None and args.train_samples is None:
        raise ConfigError("--train-iters or --train-samples is required")
    iteration_based = args.train_iters is not None
    sample_flags = (("--lr-decay-samples", args.lr_decay_samples),
                    ("--lr-warmup-samples", args.lr_warmup_samples))
    iter_flags = (("--lr-decay-iters", args.lr_decay_iters),
                  ("--lr-warmup-iters", args.lr_warmup_iters))
    for flag, value in sample_flags if iteration_based else iter_flags:
        if value is not None:
            other = "--train-iters" if iteration_based else "--train-samples"
            raise ConfigError(f"{flag} cannot be combined with {other}")
    if iteration_based:
        decay = (args.lr_decay_iters or args.train_iters) * global_batch
        warmup = (args.lr_warmup_iters or 0) * global_batch
    else:
        decay = args.lr_decay_samples or args.train_samples
        warmup = args.lr_warmup_samples or 0
    if args.lr_warmup_fraction is not None:
        warmup = int(args.lr_warmup_fraction * decay)
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    if warmup > decay:
        raise ConfigError(
            f"--lr-warmup-iters/--lr-warmup-samples ({warmup} samples) exceed the decay "
            f"period ({decay} samples)"
        )
    if args.loss_scale is not None and args.loss_scale <= 0:
        raise ConfigError(f"--loss-scale must be positive, got {args.loss_scale}")
    if args.initial_loss_scale <= 0 or args.min_loss_scale <= 0:
        raise ConfigError("--initial-loss-scale and --min-loss-scale must be positive")
    return _pick(OptimizerConfig, args, lr_decay_samples=decay, lr_warmup_samples=warmup,
                 use_apex=False if args.no_apex else None)


def _training_config(
    args: argparse.Namespace, global_batch: int, num_microbatches: int
) -> TrainingConfig:
    ramp = tuple(args.rampup_batch_size) if args.rampup_batch_size is not None else None
    return _pick(TrainingConfig, args, global_batch_size=global_batch,
                 num_microbatches=num_microbatches, rampup_batch_size=ramp,
                 layer_split=_layer_split(args))


def _layer_split(args: argparse.Namespace) -> LayerSplit:
    """Megatron's uneven-stage flags; the combinations Megatron-LM refuses are refused here
    (a layout with any other split flag, first/last with the account-for flags), and any of
    them with a ``--partition-method`` other than uniform."""
    split = LayerSplit(
        pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
        decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split)
    if not split.given:
        return split
    first_last = (split.decoder_first_pipeline_num_layers is not None
                  or split.decoder_last_pipeline_num_layers is not None)
    account = (split.account_for_embedding_in_pipeline_split
               or split.account_for_loss_in_pipeline_split)
    if split.pipeline_model_parallel_layout is not None and (first_last or account):
        raise ConfigError("--pipeline-model-parallel-layout cannot be combined with "
                          "--decoder-first/last-pipeline-num-layers or --account-for-*")
    if first_last and account:
        raise ConfigError("--decoder-first/last-pipeline-num-layers cannot be combined with "
                          "--account-for-embedding/loss-in-pipeline-split")
    if args.partition_method != "uniform":
        raise ConfigError(f"--partition-method {args.partition_method} cannot be combined with "
                          f"--pipeline-model-parallel-layout, --decoder-first/last-pipeline-"
                          f"num-layers or --account-for-*")
    return split

