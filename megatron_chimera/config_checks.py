"""Cross-flag validation of a TrainConfig, run on every rank before any process group exists.

Every inconsistency raises :class:`~megatron_chimera.config.ConfigError` with one line naming
the flag. The schedule itself is built here, so the generator's own size checks (odd D for
Chimera, micro-batches not divisible by the pipes, ...) surface as ConfigErrors too.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from .config import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)


def schedule_options(parallel: ParallelConfig, num_layers: int) -> dict[str, object]:
    """Keyword options of ``schedules.build_schedule`` for this parallel configuration."""
    name = parallel.pipeline_schedule
    options: dict[str, object] = {}
    if name.startswith("chimera"):
        options["pipes"] = parallel.chimera_pipes
        if parallel.chimera_concat is not None:
            options["concat"] = parallel.chimera_concat
        split = parallel.chimera_split_backward or name == "chimera-zb"
        if split:
            options["split_backward"] = True
        if parallel.chimera_max_inflight is not None:
            if not split:
                raise ConfigError(
                    "--chimera-max-inflight applies to the split-backward schedule: "
                    "add --chimera-split-backward or use --pipeline-schedule chimera-zb"
                )
            options["max_inflight"] = parallel.chimera_max_inflight
    if name == "interleaved":
        per_chunk = parallel.num_layers_per_virtual_pipeline_stage
        options["virtual_pipeline_size"] = num_layers // (
            per_chunk * parallel.pipeline_model_parallel_size
        )
    return options


def build_schedule_for(config: TrainConfig):
    """The schedule of this run (``schedules.build_schedule``); its ValueError -> ConfigError."""
    from .schedules import build_schedule
    from .schedules.validate import validate as validate_schedule

    parallel = config.parallel
    try:
        schedule = build_schedule(
            parallel.pipeline_schedule,
            parallel.pipeline_model_parallel_size,
            config.training.num_microbatches,
            **schedule_options(parallel, config.model.num_layers),
        )
        validate_schedule(schedule)
        return schedule
    except (ValueError, TypeError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else repr(exc)
        if "--" not in message:
            message = f"--pipeline-schedule {parallel.pipeline_schedule}: {message}"
        raise ConfigError(message) from None


def validate(config: TrainConfig, world_size: int) -> None:
    """Cross-flag consistency checks (no process group needed); raises ConfigError."""
    parallel = config.parallel
    if parallel.world_size != world_size:
        raise ConfigError(
            f"--pipeline-model-parallel-size {parallel.pipeline_model_parallel_size} x "
            f"data-parallel {parallel.data_parallel_size} != world size {world_size}"
        )
    _validate_model(config.model)
    _validate_pipeline(config)
    _validate_data(config.data)
    _validate_checkpoint(config.checkpoint)
    _validate_logging(config.logging)
    _validate_attention(config.model, config.data)
    if parallel.distributed_backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--distributed-backend nccl needs CUDA, which is not available")


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


def _validate_pipeline(config: TrainConfig) -> None:
    parallel, layers = config.parallel, config.model.num_layers
    pipeline_size = parallel.pipeline_model_parallel_size
    per_chunk = parallel.num_layers_per_virtual_pipeline_stage
    if parallel.pipeline_schedule == "interleaved":
        if per_chunk is None:
            raise ConfigError(
                "--pipeline-schedule interleaved requires --num-layers-per-virtual-pipeline-stage"
            )
        if layers % (per_chunk * pipeline_size):
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage {per_chunk} x "
                f"--pipeline-model-parallel-size {pipeline_size} does not divide "
                f"--num-layers {layers}"
            )
    elif per_chunk is not None:
        raise ConfigError(
            "--num-layers-per-virtual-pipeline-stage requires --pipeline-schedule interleaved"
        )
    schedule = build_schedule_for(config)
    if layers < schedule.num_stages:
        raise ConfigError(
            f"--num-layers {layers} is smaller than the {schedule.num_stages} pipeline stages"
        )


def _validate_data(data: DataConfig) -> None:
    if not data.mock_data and not data.data_path:
        raise ConfigError("--data-path is required unless --mock-data is given")
    if data.data_path and not data.mock_data:
        for prefix in _data_prefixes(data.data_path):
            for suffix in (".bin", ".idx"):
                if not os.path.isfile(prefix + suffix):
                    raise ConfigError(f"--data-path: {prefix + suffix} does not exist")
    try:
        split = [float(x) for x in data.split.replace("/", ",").split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--split must be comma-separated numbers, got {data.split!r}") from None
    if not 1 <= len(split) <= 3 or min(split) < 0 or sum(split) <= 0:
        raise ConfigError(f"--split must be up to 3 non-negative weights, got {data.split!r}")
    tokenizer = data.tokenizer_type
    if tokenizer is None:
        if not data.mock_data:
            raise ConfigError("--tokenizer-type is required with --data-path")
        if data.vocab_size is None:
            raise ConfigError("--mock-data without --tokenizer-type requires --vocab-size")
        return
    needed = {
        "GPT2BPETokenizer": ("vocab_file", "merge_file"),
        "BertWordPieceLowerCase": ("vocab_file",),
        "BertWordPieceCase": ("vocab_file",),
        "SentencePieceTokenizer": ("tokenizer_model",),
        "GPTSentencePieceTokenizer": ("tokenizer_model",),
        "NullTokenizer": (),
    }[tokenizer]
    if tokenizer == "NullTokenizer" and data.vocab_size is None:
        raise ConfigError("--tokenizer-type NullTokenizer requires --vocab-size")
    for name in needed:
        path = getattr(data, name)
        flag = "--" + name.replace("_", "-")
        if path is None:
            raise ConfigError(f"--tokenizer-type {tokenizer} requires {flag}")
        if not os.path.exists(path):
            raise ConfigError(f"{flag}: {path} does not exist")


def _data_prefixes(data_path: Sequence[str]) -> list[str]:
    """Prefixes of Megatron's ``[weight] prefix ...`` list (weights are optional)."""
    def is_number(text: str) -> bool:
        try:
            float(text)
        except ValueError:
            return False
        return True

    if len(data_path) > 1 and is_number(data_path[0]):
        if len(data_path) % 2:
            raise ConfigError("--data-path must alternate weight and prefix")
        return list(data_path[1::2])
    return list(data_path)


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
