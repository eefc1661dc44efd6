"""Cross-flag validation of a TrainConfig, run on every rank before any process group exists.

Every inconsistency raises :class:`~megatron_chimera.config.ConfigError` with one line naming
the flag. The schedule is built here (once per run): the generator's own size checks (odd D for
Chimera, micro-batches not divisible by the pipes, ...) surface as ConfigErrors too. Each rule
has one owner: data paths and splits are checked by the dataset builders' own parsers.
"""

from __future__ import annotations

import dataclasses
import os

from megatron_chimera.checkpoint.checkpointing import TRACKER_FILENAME, read_tracker
from megatron_chimera.checkpoint.megatron_format import refuse_megatron_checkpoint
from megatron_chimera.config import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)
from megatron_chimera.data.dataset_utils import SPLIT_NAMES, parse_data_paths, parse_split
from megatron_chimera.data.tokenizers import check_tokenizer_args
from megatron_chimera.model.architecture import check_architecture
from megatron_chimera.model.context_parallel import COMM_TYPES
from megatron_chimera.model.context_parallel.gathered import check_heads
from megatron_chimera.model.moe.layer import check_moe
from megatron_chimera.model.moe.router import check_router
from megatron_chimera.model.stage_split import split_partition
from megatron_chimera.model.transformer import validate_recompute
from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.fallback import FallbackRefused, decide, of_schedule
from megatron_chimera.schedules.registry import get_spec
from megatron_chimera.schedules.slices import SLICED_SCHEDULES, sliced_schedule
from megatron_chimera.schedules.validate import validate as validate_schedule
from megatron_chimera.training.initialize import check_backend
from megatron_chimera.training.scalar_writers import check_wandb_flags
from megatron_chimera.training.varlen import check_variable_seq_lengths


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
        if parallel.pipeline_sequence_slices > 1:
            schedule = _sliced_schedule_for(config, spec, options)
        else:
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


def attention_fraction(model: ModelConfig) -> float:
    """The fraction of a causal sequence's forward work in the attention scores and their
    product with the values (per token and layer ``2 s h`` multiply-adds, causal, against
    ``12 h^2`` in the linear layers, ``h`` the hidden size): ``s / (s + 12 h)``. The sliced
    orders are built for it (later slices attend to more keys)."""
    return model.seq_length / (model.seq_length + 12 * model.hidden_size)


def _sliced_schedule_for(config: TrainConfig, spec: object, options: object) -> Schedule:
    """``--pipeline-sequence-slices k``: the sliced order of ``spec`` (ValueError naming the
    flag it cannot take: a schedule or an option the sliced orders do not have)."""
    k = config.parallel.pipeline_sequence_slices
    name = spec.name  # type: ignore[attr-defined]
    if name not in SLICED_SCHEDULES:
        raise ValueError(f"--pipeline-sequence-slices {k} is built for --pipeline-schedule "
                         f"{', '.join(SLICED_SCHEDULES)}, not {name}")
    for f in dataclasses.fields(options) if options is not None else ():
        value = getattr(options, f.name)
        if value is not None and value != f.default:
            raise ValueError(f"--pipeline-sequence-slices {k} does not take "
                             f"{f.metadata['flag']} (the sliced orders are built by list "
                             "scheduling on the slices' attention work: 2 pipes, cap D x k)")
    return sliced_schedule(name, config.parallel.pipeline_model_parallel_size,
                           config.training.num_microbatches, k,
                           attention_fraction=attention_fraction(config.model))


def _validate_sequence_slices(config: TrainConfig) -> None:
    """--pipeline-sequence-slices: what the slices' key/value cache cannot run with yet."""
    k = config.parallel.pipeline_sequence_slices
    if k == 1:
        return
    model = config.model
    flag = f"--pipeline-sequence-slices {k}"
    if model.seq_length % k:
        raise ConfigError(f"{flag} does not divide --seq-length {model.seq_length} into equal "
                          "slices")
    if config.parallel.context_parallel_size > 1:
        raise ConfigError(f"{flag} does not run with --context-parallel-size > 1 yet (the "
                          "context-parallel kernels have no slice key/value cache)")
    if model.document_attention not in ("auto",):
        raise ConfigError(f"{flag} does not take --document-attention "
                          f"{model.document_attention}: the slice mask covers the documents")


def schedule_for_microbatches(config: TrainConfig, num_microbatches: int) -> Schedule:
    """:func:`build_schedule_for` with ``num_microbatches`` micro-batches (one step of
    ``--rampup-batch-size``)."""
    training = dataclasses.replace(config.training, num_microbatches=num_microbatches)
    return build_schedule_for(dataclasses.replace(config, training=training))


def _validate_rampup(config: TrainConfig) -> None:
    """Every N of the batch-size ramp must make a valid schedule (built once each here)."""
    for n in config.training.microbatch_counts()[:-1]:
        try:
            schedule_for_microbatches(config, n)
        except ConfigError as exc:
            raise ConfigError(f"--rampup-batch-size: the ramp's {n} micro-batches per "
                              f"iteration: {exc}") from None


def check_config_and_build_schedule(config: TrainConfig, world_size: int) -> Schedule:
    """Cross-flag consistency checks (no process group needed); returns the run's schedule."""
    parallel = config.parallel
    parallel.layout.check_world(world_size)
    _validate_model(config.model)
    parallel.layout.check_model(config.model)
    _validate_experts(config)
    schedule = build_schedule_for(config)
    _validate_rampup(config)
    _validate_data(config.data)
    _validate_checkpoint(config.checkpoint)
    _validate_logging(config.logging)
    check_wandb_flags(config.logging, config.checkpoint.save)
    _validate_attention(config.model, config.data)
    check_variable_seq_lengths(config)
    _validate_context_parallel(config.model, parallel)
    _validate_sequence_slices(config)
    check_backend(parallel)
    return schedule


def _validate_experts(config: TrainConfig) -> None:
    """MoE and expert parallelism: EP divides the experts; what is not supported yet is
    rejected naming its flag."""
    parallel, moe = config.parallel, config.model.moe
    if not moe.enabled:
        if parallel.expert_model_parallel_size > 1:
            raise ConfigError("--expert-model-parallel-size > 1 needs --num-experts")
        return
    check_moe(parallel.tensor_model_parallel_size, parallel.expert_tensor_parallel_size,
              config.model.sequence_parallel)
    if parallel.context_parallel_size > 1:
        raise ConfigError("--num-experts with --context-parallel-size > 1 is not supported yet "
                          "(the load-balancing counts would have to span the context ranks)")
    check_router(config.model)
    parallel.layout.check_experts(moe.num_experts)
    if parallel.expert_model_parallel_size > 1 and config.checkpoint.save and \
            config.checkpoint.ckpt_format != "torch_dist":
        raise ConfigError("--ckpt-format torch with --expert-model-parallel-size > 1 is not "
                          "supported (a stage's file would hold only its writer's experts); "
                          "use --ckpt-format torch_dist, which saves the experts as chunks of "
                          "the whole layer and loads into any expert-parallel size")
    if not any(moe.moe_layers(config.model.num_layers)):
        raise ConfigError(f"--moe-layer-freq {moe.moe_layer_freq!r} makes no layer an MoE layer")


def _validate_model(model: ModelConfig) -> None:
    if model.learned_positions and model.seq_length > model.max_positions:
        raise ConfigError(
            f"--seq-length {model.seq_length} exceeds --max-position-embeddings "
            f"{model.max_position_embeddings}"
        )
    check_architecture(model)
    validate_recompute(model)


def _check_data_files(paths: tuple[str, ...] | None, flag: str) -> None:
    """Each prefix of ``paths`` (``flag``'s value) has its .bin and .idx: else one error."""
    if paths is None:
        return
    prefixes, _ = parse_data_paths(paths, flag)
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            if not os.path.isfile(prefix + suffix):
                raise ConfigError(f"{flag}: {prefix + suffix} does not exist")


def _validate_data(data: DataConfig) -> None:
    per_split = data.split_data_paths
    if not data.mock_data and not data.data_path and per_split is None:
        raise ConfigError("--data-path (or --train-data-path / --valid-data-path / "
                          "--test-data-path) is required unless --mock-data is given")
    if not data.mock_data:
        _check_data_files(data.data_path, "--data-path")
        for name, paths in zip(SPLIT_NAMES, per_split or ()):
            _check_data_files(paths, f"--{name}-data-path")
    parse_split(data.split)
    tokenizer = data.tokenizer_type
    if tokenizer is None:
        if not data.mock_data:
            source = "--data-path" if data.data_path else "per-split data paths"
            raise ConfigError(f"--tokenizer-type is required with {source}")
        if data.vocab_size is None:
            raise ConfigError("--mock-data without --tokenizer-type requires --vocab-size")
        return
    check_tokenizer_args(tokenizer, data.tokenizer_model, data.vocab_file, data.merge_file,
                         data.vocab_size)


def _validate_checkpoint(checkpoint: CheckpointConfig) -> None:
    if checkpoint.load is not None and not os.path.isdir(checkpoint.load):
        raise ConfigError(f"--load directory {checkpoint.load} does not exist")
    refuse_megatron_checkpoint(checkpoint.load)
    if checkpoint.finetune and checkpoint.load is None:
        raise ConfigError("--finetune requires --load")
    if checkpoint.exit_on_missing_checkpoint:
        if checkpoint.load is None:
            raise ConfigError("--exit-on-missing-checkpoint requires --load")
        if read_tracker(checkpoint.load) is None:
            raise ConfigError(
                f"--load {checkpoint.load} holds no checkpoint (no {TRACKER_FILENAME}) and "
                "--exit-on-missing-checkpoint is set: not training from scratch")
    if checkpoint.save_interval is not None and checkpoint.save is None:
        raise ConfigError("--save-interval requires --save")
    if checkpoint.async_save and checkpoint.ckpt_format != "torch_dist":
        raise ConfigError("--async-save requires --ckpt-format torch_dist")
    if checkpoint.async_save and checkpoint.save is None:
        raise ConfigError("--async-save requires --save")


def _validate_logging(logging: LoggingConfig) -> None:
    """Flags that only write TensorBoard scalars need a place to write them."""
    if logging.tensorboard_dir is None:
        for flag, on in (("--log-timers-to-tensorboard", logging.log_timers_to_tensorboard),
                         ("--log-memory-to-tensorboard", logging.log_memory_to_tensorboard)):
            if on:
                raise ConfigError(f"{flag} requires --tensorboard-dir")


def _cp_comm_types(model: ModelConfig) -> tuple[str, ...]:
    """Every layer's --cp-comm-type after the checks: known types, one value or one per layer."""
    given = (model.cp_comm_type,) if isinstance(model.cp_comm_type, str) else \
        tuple(model.cp_comm_type)
    for value in given:
        if value not in COMM_TYPES:
            raise ConfigError(f"--cp-comm-type must be one of {COMM_TYPES}, got {value!r}")
    if len(given) not in (1, model.num_layers):
        raise ConfigError(f"--cp-comm-type takes one value or one per layer (--num-layers "
                          f"{model.num_layers}), got {len(given)}")
    return tuple(model.layer_cp_comm_type(n + 1) for n in range(model.num_layers))


def _validate_context_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """--context-parallel-size and --cp-comm-type (the sequence rule is the layout's)."""
    cp = parallel.context_parallel_size
    types = _cp_comm_types(model)
    _validate_hierarchical_sizes(types, parallel)
    if cp == 1:
        return
    if model.hidden_dropout > 0 or model.attention_dropout > 0:
        given = " and ".join(f"{name} {value:g}" for name, value in (
            ("--hidden-dropout", model.hidden_dropout),
            ("--attention-dropout", model.attention_dropout)) if value > 0)
        raise ConfigError(f"--context-parallel-size > 1 needs --hidden-dropout 0 and "
                          f"--attention-dropout 0, got {given} (a keyed dropout mask is drawn "
                          "for a whole tensor of one process: a context rank's tokens cannot "
                          "draw their part of it; docs/LONG_SEQUENCES.md)")
    if model.document_attention != "auto":
        raise ConfigError(f"--document-attention {model.document_attention} does not apply with "
                          "--context-parallel-size > 1: the --cp-comm-type kernel masks the "
                          "documents itself")
    layout = parallel.layout
    if "a2a" in types:
        check_heads(layout.split(model.num_attention_heads, "--num-attention-heads"),
                    layout.split(model.query_groups, "--num-query-groups"), cp)
    if "a2a+p2p" in types:
        check_heads(layout.split(model.num_attention_heads, "--num-attention-heads"),
                    layout.split(model.query_groups, "--num-query-groups"),
                    parallel.hierarchical_context_parallel_sizes[0])


def _validate_hierarchical_sizes(types: tuple[str, ...], parallel: ParallelConfig) -> None:
    """--hierarchical-context-parallel-sizes A B: given exactly when a layer runs a2a+p2p, two
    levels whose product is --context-parallel-size."""
    sizes, cp = parallel.hierarchical_context_parallel_sizes, parallel.context_parallel_size
    hierarchical = "a2a+p2p" in types and cp > 1
    if sizes is None:
        if hierarchical:
            raise ConfigError("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes "
                              f"A B (A x B = --context-parallel-size {cp})")
        return
    if not hierarchical:
        raise ConfigError("--hierarchical-context-parallel-sizes applies to --cp-comm-type "
                          "a2a+p2p with --context-parallel-size > 1")
    if len(sizes) != 2 or min(sizes) < 1 or sizes[0] * sizes[1] != cp:
        raise ConfigError(f"--hierarchical-context-parallel-sizes takes two sizes A B (all-to-all "
                          f"inside A adjacent ranks, a ring across B groups) with A x B = "
                          f"--context-parallel-size {cp}, got {' '.join(map(str, sizes))}")


def _validate_attention(model: ModelConfig, data: DataConfig) -> None:
    """Attention flags that contradict each other or have nothing to act on."""
    if model.use_flash_attn and not model.masked_softmax_fusion:
        raise ConfigError("--use-flash-attn and --no-masked-softmax-fusion exclude each other "
                          "(the unfused softmax is not a flash kernel)")
    impl = model.document_attention
    if impl == "auto":
        return
    if not (data.reset_attention_mask or data.variable_seq_lengths):
        raise ConfigError(f"--document-attention {impl} requires --reset-attention-mask or "
                          "--variable-seq-lengths")
    if impl in ("varlen", "flex") and model.attention_dropout > 0:
        raise ConfigError(f"--document-attention {impl} has no attention dropout: add "
                          "--attention-dropout 0, or use --document-attention loop")
    if impl == "varlen" and model.params_dtype == "fp32":
        raise ConfigError("--document-attention varlen needs --fp16 or --bf16 (FlashAttention)")
