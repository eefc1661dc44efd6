"""Cross-flag validation of a TrainConfig, run on every rank before any process group exists.

Every inconsistency raises :class:`~megatron_chimera.config.ConfigError` with one line naming
the flag. The schedule is built here (once per run): the generator's own size checks (odd D for
Chimera, micro-batches not divisible by the pipes, ...) surface as ConfigErrors too. Each rule
has one owner: data paths and splits are checked by the dataset builders' own parsers.
"""

from __future__ import annotations

import os

from megatron_chimera.config import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    TrainConfig,
)
from megatron_chimera.data.dataset_utils import parse_data_paths, parse_split
from megatron_chimera.data.tokenizers import check_tokenizer_args
from megatron_chimera.model.stage_layout import split_partition
from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.fallback import FallbackRefused, decide, of_schedule
from megatron_chimera.schedules.registry import get_spec
from megatron_chimera.schedules.validate import validate as validate_schedule
from megatron_chimera.training.initialize import check_backend


def never_slower_than_unsplit(schedule: Schedule, options: object) -> Schedule:
    """A split-backward schedule whose costs are given (``--chimera-zb-costs``) against 1F1B and
    Chimera under those costs (:func:`~megatron_chimera.schedules.fallback.decide`, any
    placement: no process group exists yet). Returns the schedule to run; a replacement names
    what it replaces in ``meta["replaces"]``. FallbackRefused under ``--chimera-zb-fallback
    refuse``."""
    costs = getattr(options, "costs", None)
    if not schedule.split_backward or costs is None:
        return schedule
    stage_costs = StageCosts.of(costs, schedule.num_stages)
    decision = decide(of_schedule(schedule, stage_costs), stage_costs,
                      getattr(options, "fallback", None))
    if not decision.fell_back:
        return schedule
    chosen = decision.chosen.schedule
    assert chosen is not None
    chosen.meta["replaces"] = (f"{schedule.name} (predicted slower under --chimera-zb-costs: "
                               f"{decision.figures()})")
    return chosen


def build_schedule_for(config: TrainConfig) -> Schedule:
    """The validated schedule of this run; a generator's ValueError becomes a ConfigError. A
    split-backward schedule with given costs is never slower than 1F1B or Chimera under them
    (:func:`never_slower_than_unsplit`)."""
    parallel = config.parallel
    try:
        spec = get_spec(parallel.pipeline_schedule)
        options = parallel.schedule_options
        schedule = spec.build(parallel.pipeline_model_parallel_size,
                              config.training.num_microbatches, options)
        validate_schedule(schedule)
        schedule = never_slower_than_unsplit(schedule, options)
    except FallbackRefused as exc:
        raise ConfigError(str(exc)) from None
    except ValueError as exc:
        first_line = str(exc).splitlines()[0]
        raise ConfigError(f"--pipeline-schedule {parallel.pipeline_schedule}: {first_line}") \
            from None
    if config.model.num_layers < schedule.num_stages:
        raise ConfigError(
            f"--num-layers {config.model.num_layers} is smaller than the {schedule.num_stages} "
            f"pipeline stages"
        )
    split_partition(config.training.layer_split, config.model.num_layers, schedule.num_stages,
                    parallel.pipeline_model_parallel_size)
    return schedule


def validate(config: TrainConfig, world_size: int) -> Schedule:
    """Cross-flag consistency checks (no process group needed); returns the run's schedule."""
    parallel = config.parallel
    parallel.layout.check_world(world_size)
    _validate_model(config.model)
    parallel.layout.check_model(config.model)
    schedule = build_schedule_for(config)
    _validate_data(config.data)
    _validate_checkpoint(config.checkpoint)
    _validate_logging(config.logging)
    _validate_attention(config.model, config.data)
    check_backend(parallel)
    return schedule


def _validate_model(model: ModelConfig) -> None:
    if model.seq_length > model.max_positions:
        raise ConfigError(
            f"--seq-length {model.seq_length} exceeds --max-position-embeddings "
            f"{model.max_position_embeddings}"
        )
    if model.hidden_size % model.num_attention_heads:
        raise ConfigError(
            f"--hidden-size {model.hidden_size} is not divisible by --num-attention-heads "
            f"{model.num_attention_heads}"
        )
    granularity, method = model.recompute_granularity, model.recompute_method
    if granularity == "full" and method is None:
        raise ConfigError("--recompute-granularity full requires --recompute-method")
    if method is not None and granularity != "full":
        raise ConfigError("--recompute-method requires --recompute-granularity full")
    if method is not None and model.recompute_num_layers is None:
        raise ConfigError("--recompute-method requires --recompute-num-layers")
    if model.recompute_num_layers is not None and method is None:
        raise ConfigError("--recompute-num-layers requires --recompute-method")


def _validate_data(data: DataConfig) -> None:
    if not data.mock_data and not data.data_path:
        raise ConfigError("--data-path is required unless --mock-data is given")
    if data.data_path and not data.mock_data:
        prefixes, _ = parse_data_paths(data.data_path)
        for prefix in prefixes:
            for suffix in (".bin", ".idx"):
                if not os.path.isfile(prefix + suffix):
                    raise ConfigError(f"--data-path: {prefix + suffix} does not exist")
    parse_split(data.split)
    tokenizer = data.tokenizer_type
    if tokenizer is None:
        if not data.mock_data:
            raise ConfigError("--tokenizer-type is required with --data-path")
        if data.vocab_size is None:
            raise ConfigError("--mock-data without --tokenizer-type requires --vocab-size")
        return
    check_tokenizer_args(tokenizer, data.tokenizer_model, data.vocab_file, data.merge_file,
                         data.vocab_size)


def _validate_checkpoint(checkpoint: CheckpointConfig) -> None:
    if checkpoint.load is not None and not os.path.isdir(checkpoint.load):
        raise ConfigError(f"--load directory {checkpoint.load} does not exist")
    if checkpoint.finetune and checkpoint.load is None:
        raise ConfigError("--finetune requires --load")
    if checkpoint.save_interval is not None and checkpoint.save is None:
        raise ConfigError("--save-interval requires --save")


def _validate_logging(logging: LoggingConfig) -> None:
    """Flags that only write TensorBoard scalars need a place to write them."""
    if logging.tensorboard_dir is None:
        for flag, on in (("--log-timers-to-tensorboard", logging.log_timers_to_tensorboard),
                         ("--log-memory-to-tensorboard", logging.log_memory_to_tensorboard)):
            if on:
                raise ConfigError(f"{flag} requires --tensorboard-dir")


def _validate_attention(model: ModelConfig, data: DataConfig) -> None:
    """Attention flags that contradict each other or have nothing to act on."""
    if model.use_flash_attn and not model.masked_softmax_fusion:
        raise ConfigError("--use-flash-attn and --no-masked-softmax-fusion exclude each other "
                          "(the unfused softmax is not a flash kernel)")
    impl = model.document_attention
    if impl == "auto":
        return
    if not data.reset_attention_mask:
        raise ConfigError(f"--document-attention {impl} requires --reset-attention-mask")
    if impl in ("varlen", "flex") and model.attention_dropout > 0:
        raise ConfigError(f"--document-attention {impl} has no attention dropout: add "
                          "--attention-dropout 0, or use --document-attention loop")
    if impl == "varlen" and model.params_dtype == "fp32":
        raise ConfigError("--document-attention varlen needs --fp16 or --bf16 (FlashAttention)")
