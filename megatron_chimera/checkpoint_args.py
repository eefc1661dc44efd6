"""The arguments a checkpoint was saved with: the model it holds, and whether a run's flags fit it.

``common.pt`` stores ``dataclasses.asdict(TrainConfig)`` (``{"model": {...}, "data": {...}, ...}``).
Tools that load a checkpoint on their own (generation, evaluation, export) rebuild the model and
tokenizer from it; a training run that ``--load``s a checkpoint checks first that its model flags
describe the same network (Megatron's ``check_checkpoint_args``), because a different GeLU form or
layer-norm epsilon would load without error and silently train another function.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from megatron_chimera.checkpointing import (
    COMMON_FILENAME,
    CheckpointError,
    checkpoint_dir,
    read_tracker,
    safe_torch_load,
)
from megatron_chimera.config import ConfigError, DataConfig, ModelConfig

# (ModelConfig attribute or property, flag that sets it) for every architecture-defining setting
_ARCHITECTURE = (
    ("num_layers", "--num-layers"),
    ("hidden_size", "--hidden-size"),
    ("num_attention_heads", "--num-attention-heads"),
    ("ffn_size", "--ffn-hidden-size"),
    ("max_positions", "--max-position-embeddings"),
    ("padded_vocab_size", "--make-vocab-size-divisible-by / the tokenizer's vocabulary"),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
    ("layernorm_epsilon", "--layernorm-epsilon"),
    ("gelu", "--gelu"),
    ("bert_binary_head", "--bert-no-binary-head"),
)


def read_common(root: str) -> dict[str, Any] | None:
    """``common.pt`` of the latest iteration under ``root`` (None when there is no tracker)."""
    iteration = read_tracker(root)
    if iteration is None:
        return None
    path = checkpoint_dir(root, iteration)
    if not os.path.isdir(path) and os.path.isdir(path + ".old"):
        path += ".old"  # crashed while replacing a re-saved iteration (as load_checkpoint does)
    return safe_torch_load(os.path.join(path, COMMON_FILENAME))


def _build(cls: type, values: dict[str, Any] | None) -> Any:
    """``cls(**values)`` keeping only its fields (older or newer checkpoints may differ)."""
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: (tuple(v) if isinstance(v, list) else v)
              for k, v in (values or {}).items() if k in names}
    return cls(**kwargs)


def saved_model_config(common: dict[str, Any], source: str) -> ModelConfig:
    """The ModelConfig a checkpoint was written with; CheckpointError when it has none."""
    model = (common.get("args") or {}).get("model")
    if not model:
        raise CheckpointError(f"{source}: the checkpoint records no model arguments")
    return _build(ModelConfig, model)


def saved_data_config(common: dict[str, Any]) -> DataConfig:
    """The DataConfig (tokenizer settings) a checkpoint was written with (defaults if none)."""
    return _build(DataConfig, (common.get("args") or {}).get("data"))


def check_model_matches_checkpoint(root: str, model: ModelConfig) -> None:
    """Raise ConfigError naming the flag when ``model`` is not the network saved under ``root``.

    Checkpoints without a tracker or without recorded model arguments are not checked.
    """
    common = read_common(root)
    if common is None or not (common.get("args") or {}).get("model"):
        return
    saved = saved_model_config(common, root)
    for attribute, flag in _ARCHITECTURE:
        want, have = getattr(saved, attribute), getattr(model, attribute)
        if want != have:
            raise ConfigError(
                f"{flag}: the checkpoint in --load {root} has {attribute} = {want!r}, this run "
                f"{have!r}; pass the checkpoint's setting (its model flags: "
                f"{' '.join(model_flags(saved))})")


def model_flags(model: ModelConfig) -> list[str]:
    """Training flags that build exactly ``model`` (the tokenizer gives the vocabulary)."""
    flags = ["--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
             "--num-attention-heads", str(model.num_attention_heads),
             "--max-position-embeddings", str(model.max_positions)]
    if model.ffn_size != 4 * model.hidden_size:
        flags += ["--ffn-hidden-size", str(model.ffn_size)]
    if model.make_vocab_size_divisible_by != ModelConfig.make_vocab_size_divisible_by:
        flags += ["--make-vocab-size-divisible-by", str(model.make_vocab_size_divisible_by)]
    if model.layernorm_epsilon != ModelConfig.layernorm_epsilon:
        flags += ["--layernorm-epsilon", repr(model.layernorm_epsilon)]
    if model.gelu != ModelConfig.gelu:
        flags += ["--gelu", model.gelu]
    if model.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    if not model.bert_binary_head:
        flags.append("--bert-no-binary-head")
    return flags
