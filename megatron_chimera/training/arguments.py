"""Megatron's command-line flags parsed into frozen configuration dataclasses.

The flags are declared on the configuration fields (:mod:`megatron_chimera.config.flag`) and
gathered into a parser by :mod:`.argument_parser`; this module validates the parsed namespace and
builds the configuration from it.

``parse_args(argv, world_size)`` returns a validated :class:`~megatron_chimera.config.TrainConfig`;
``parse_args_and_schedule`` also returns the run's schedule, built once during validation.
Validation runs on every rank before any process group exists: an inconsistent setting raises
:class:`~megatron_chimera.config.ConfigError` whose one-line message names the flag, so all ranks
fail the same way without blocking. Entry scripts turn it into ``error: <message>`` and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence

from megatron_chimera.checkpoint.megatron_format import refuse_megatron_checkpoint
from megatron_chimera.checkpoint.saved_args import read_common, saved_run_flags
from megatron_chimera.config import (
    DEFAULT_PROFILE_ITERATIONS,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    DDPConfig,
    LayerSplit,
    LoggingConfig,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainConfig,
    TrainingConfig,
)
from megatron_chimera.data.sft_dataset import check_sft_data
from megatron_chimera.layout import ParallelLayout
from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.registry import SPLIT_BACKWARD_SCHEDULES, spec_and_options_from
from megatron_chimera.training.argument_parser import (
    HAND_FLAGS,
    add_architecture_arguments,
    build_parser,
    field_flags,
)
from megatron_chimera.training.config_checks import (
    build_schedule_for,
    check_config_and_build_schedule,
)

__all__ = ["build_parser", "parse_args", "parse_args_and_schedule",
           "check_config_and_build_schedule",
           "build_schedule_for", "add_architecture_arguments", "architecture_fields"]

def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _require(args: argparse.Namespace) -> None:
    """Every flag declared ``required`` is given."""
    for _, field, spec in field_flags():
        if spec.required and getattr(args, field.name) is None:
            raise ConfigError(f"{spec.name} is required")


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
    return config, check_config_and_build_schedule(config, world_size)


def _checkpoint_flags(args: argparse.Namespace) -> list[str]:
    """``--use-checkpoint-args``: the model flags of ``--load``'s latest checkpoint (the command
    line, parsed after them, wins); none when it holds no checkpoint (a note, or the error of
    ``--exit-on-missing-checkpoint``)."""
    if args.load is None:
        raise ConfigError("--use-checkpoint-args requires --load")
    if not os.path.isdir(args.load):
        raise ConfigError(f"--load directory {args.load} does not exist")
    refuse_megatron_checkpoint(args.load)
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
    _require(args)
    _check_values(args)
    if args.fp16 and args.bf16:
        raise ConfigError("--fp16 and --bf16 are mutually exclusive")
    pipeline_size = args.pipeline_model_parallel_size
    data_parallel = ParallelLayout.from_world(world_size, args.tensor_model_parallel_size,
                                              pipeline_size,
                                              args.context_parallel_size).data
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
    if args.sft:  # Megatron's --sft: document masks and the global-token mean come with it
        check_sft_data(args.data_path, given, args.mock_data)
        args.reset_attention_mask = args.reset_position_ids = True
        args.calculate_per_token_loss = True
    return _pick(DataConfig, args, split=args.split or DataConfig.split)


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
    values = {name: tuple(v) if isinstance(v, list) else v for name, v in values.items()}
    values.update(overrides)
    return cls(**values)


def _check_values(args: argparse.Namespace) -> None:
    """Each flag's declared range check (positive, >= 0, a probability, ...), on given values."""
    checks = [(spec.name, field.name, spec.check) for _, field, spec in field_flags()
              if spec.check is not None]
    checks += [(f"--{dest.replace('_', '-')}", dest, check)
               for hand in HAND_FLAGS for dest, check in hand.checks]
    for name, dest, check in checks:
        value = getattr(args, dest)
        problem = check(value) if value is not None else None
        if problem:
            raise ConfigError(f"{name} {problem}")


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
    sliced = (getattr(args, "pipeline_sequence_slices", None) or 1) > 1
    if given is None:
        if (schedule not in SPLIT_BACKWARD_SCHEDULES or args.chimera_zb_costs is not None
                or args.rampup_batch_size is not None or sliced):
            return 0
        return max(0, min(DEFAULT_PROFILE_ITERATIONS, total - 1))
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
    comm = args.cp_comm_type  # Megatron: one value (every layer) or one per layer
    return _pick(ModelConfig, args, params_dtype=params_dtype, use_apex=use_apex,
                 vocab_size=args.vocab_size or ModelConfig.vocab_size,
                 cp_comm_type=comm if isinstance(comm, str) else
                 comm[0] if len(comm) == 1 else tuple(comm),
                 moe=_pick(MoEConfig, args), **architecture_fields(args))


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
    if args.initial_loss_scale <= 0 or args.min_loss_scale <= 0:
        raise ConfigError("--initial-loss-scale and --min-loss-scale must be positive")
    return _pick(OptimizerConfig, args, lr_decay_samples=decay, lr_warmup_samples=warmup,
                 use_apex=False if args.no_apex else None)


def _training_config(
    args: argparse.Namespace, global_batch: int, num_microbatches: int
) -> TrainingConfig:
    return _pick(TrainingConfig, args, global_batch_size=global_batch,
                 num_microbatches=num_microbatches, layer_split=_layer_split(args))


def _layer_split(args: argparse.Namespace) -> LayerSplit:
    """Megatron's uneven-stage flags; the combinations Megatron-LM refuses are refused here
    (a layout with any other split flag, first/last with the account-for flags), and any of
    them with a ``--partition-method`` other than uniform."""
    split = _pick(LayerSplit, args)
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

