"""The arguments a checkpoint was saved with: the model it holds, and whether a run's flags fit it.

``common.pt`` stores ``dataclasses.asdict(TrainConfig)`` (``{"model": {...}, "data": {...}, ...}``)
and the model family. Tools that load a checkpoint on their own (generation, evaluation, export)
rebuild the model and tokenizer from it (:func:`saved_model_config`, :func:`saved_data_config`).

A run that loads a checkpoint (``--load``, ``--finetune`` too) first checks that it describes the
same network -- Megatron's ``check_checkpoint_args``, one check for every path (trained and
imported checkpoints alike). Shapes alone do not tell models apart: a 4-layer checkpoint fills
the first two layers of a 2-layer model (and brings the 4-layer model's final norm and head), a
4-head checkpoint loads into 8 heads (its QKV re-split), and a different GeLU form or layer-norm
epsilon loads without any error and silently trains another function. So the *model-defining*
arguments saved with the checkpoint are compared with the run's, and every difference is named
in one error (a :class:`CheckpointArgsError`, exit code 2). As Megatron: the layers, hidden size,
heads, position embeddings, padded vocabulary and tokenizer type; beyond Megatron (whose loader
catches some of them as shape errors): the model family (GPT-2 / BERT), the FFN size, untied
output layer, BERT's token types and binary head, the layer-norm epsilon and the GeLU form, and
the decoder architecture (normalisation, SwiGLU, head dimension, query groups, biases, position
embeddings and RoPE's base, percent and scaling).
Everything else may change: the layout (D, pipes, W, schedule, T) -- checkpoints are
layout-independent -- and training settings (dropout, learning rate, precision, sequence length
up to the position embeddings). Unlike Megatron, ``--finetune`` is checked too: fine-tuning
starts from the same model.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from megatron_chimera.checkpoint.checkpointing import (
    COMMON_FILENAME,
    CheckpointError,
    checkpoint_dir,
    read_tracker,
    safe_torch_load,
)
from megatron_chimera.config import (
    ConfigError,
    DataConfig,
    ModelConfig,
    TrainConfig,
    pad_vocab_size,
)
from megatron_chimera.model.family import FAMILIES
from megatron_chimera.model.flags import model_flags


class CheckpointArgsError(CheckpointError, ConfigError):
    """The run's model flags describe another network than the checkpoint's (exit code 2: the
    flags are wrong, not the file); the message names every differing flag."""

    exit_code = 2


_MISSING = object()  # a key an older checkpoint did not record: not compared


def _get(key: str) -> Callable[[dict[str, Any]], Any]:
    return lambda model: model.get(key, _MISSING)


def _moe(key: str) -> Callable[[dict[str, Any]], Any]:
    """A mixture-of-experts value (``model["moe"]``; a checkpoint from before MoE records none:
    a dense model, ``num_experts`` None)."""
    def value_of(model: dict[str, Any]) -> Any:
        if "hidden_size" not in model:
            return _MISSING
        return (model.get("moe") or {}).get(key)
    return value_of


def _ffn(model: dict[str, Any]) -> Any:
    if "hidden_size" not in model:
        return _MISSING
    if model.get("ffn_hidden_size"):
        return model["ffn_hidden_size"]
    return ModelConfig(hidden_size=model["hidden_size"], swiglu=bool(model.get("swiglu"))).ffn_size


def _positions(model: dict[str, Any]) -> Any:
    if "seq_length" not in model and not model.get("max_position_embeddings"):
        return _MISSING
    return model.get("max_position_embeddings") or model["seq_length"]


def _padded_vocab(model: dict[str, Any]) -> Any:
    if "vocab_size" not in model or "make_vocab_size_divisible_by" not in model:
        return _MISSING
    return pad_vocab_size(model["vocab_size"], model["make_vocab_size_divisible_by"])


# name -> (the flag(s) a user changes, value from the saved/now ``model`` dict). Keys missing from
# an older checkpoint are not compared.
MODEL_ARGS: dict[str, tuple[str, Callable[[dict[str, Any]], Any]]] = {
    "num_layers": ("--num-layers", _get("num_layers")),
    "hidden_size": ("--hidden-size", _get("hidden_size")),
    "num_attention_heads": ("--num-attention-heads", _get("num_attention_heads")),
    "ffn_hidden_size": ("--ffn-hidden-size", _ffn),
    "max_position_embeddings": ("--max-position-embeddings", _positions),
    "padded_vocab_size": ("the padded vocabulary (tokenizer / --vocab-size, "
                          "--make-vocab-size-divisible-by)", _padded_vocab),
    "untie_embeddings_and_output_weights": ("--untie-embeddings-and-output-weights",
                                            _get("untie_embeddings_and_output_weights")),
    "num_tokentypes": ("the token-type embeddings (BERT)", _get("num_tokentypes")),
    "bert_binary_head": ("--bert-no-binary-head", _get("bert_binary_head")),
    "layernorm_epsilon": ("--layernorm-epsilon", _get("layernorm_epsilon")),
    "gelu": ("--gelu", _get("gelu")),
    # today's decoders (older checkpoints record none of these: not compared)
    "normalization": ("--normalization", _get("normalization")),
    "swiglu": ("--swiglu", _get("swiglu")),
    "kv_channels": ("--kv-channels", _get("kv_channels")),
    "num_query_groups": ("--group-query-attention --num-query-groups",
                         _get("num_query_groups")),
    "add_bias_linear": ("--disable-bias-linear", _get("add_bias_linear")),
    "add_qkv_bias": ("--add-qkv-bias", _get("add_qkv_bias")),
    "position_embedding_type": ("--position-embedding-type", _get("position_embedding_type")),
    "rotary_base": ("--rotary-base", _get("rotary_base")),
    "rotary_percent": ("--rotary-percent", _get("rotary_percent")),
    "use_rope_scaling": ("--use-rope-scaling", _get("use_rope_scaling")),
    "rope_scaling_factor": ("--rope-scaling-factor", _get("rope_scaling_factor")),
    # mixture of experts (what changes the parameters' shapes or their places)
    "num_experts": ("--num-experts", _moe("num_experts")),
    "moe_ffn_hidden_size": ("--moe-ffn-hidden-size", _moe("moe_ffn_hidden_size")),
    "moe_shared_expert_intermediate_size": ("--moe-shared-expert-intermediate-size",
                                            _moe("moe_shared_expert_intermediate_size")),
    "moe_shared_expert_gate": ("--moe-shared-expert-gate", _moe("moe_shared_expert_gate")),
    "moe_layer_freq": ("--moe-layer-freq", _moe("moe_layer_freq")),
}
FAMILY_KEY = "model_family"
TOKENIZER_KEY = "tokenizer_type"
LEGACY_FAMILY_NAMES = {"gpt": "gpt2"}  # family names recorded by earlier checkpoints


def model_signature(args: dict[str, Any]) -> dict[str, Any]:
    """The model-defining values of a run's arguments (``dataclasses.asdict(TrainConfig)`` plus
    ``model_family``, as saved in ``common.pt``), derived values resolved (FFN 4h, positions =
    sequence length, padding). Keys missing from an older checkpoint are left out, and so is the
    tokenizer of an imported checkpoint that has none (the tools are told to pass one)."""
    model = args.get("model") or {}
    out: dict[str, Any] = {}
    for key, (_, value_of) in MODEL_ARGS.items():
        value = value_of(model)
        if value is not _MISSING:
            out[key] = value
    data = args.get("data")
    if data is not None and TOKENIZER_KEY in data:
        if data[TOKENIZER_KEY] is not None or "imported_from" not in args:
            out[TOKENIZER_KEY] = data[TOKENIZER_KEY] or "NullTokenizer"
    family = args.get(FAMILY_KEY)
    if family:
        out[FAMILY_KEY] = LEGACY_FAMILY_NAMES.get(family, family)
    return out


def _flag(key: str) -> str:
    if key == FAMILY_KEY:
        return "the model family (pretrain_gpt2.py / pretrain_bert.py)"
    if key == TOKENIZER_KEY:
        return "--tokenizer-type"
    return MODEL_ARGS[key][0]


def checkpoint_args_mismatches(saved_args: dict[str, Any], config: TrainConfig | ModelConfig,
                               family: Any = None) -> list[str]:
    """``"<flag>: <saved> in the checkpoint, <now> now"`` for every model-defining difference.

    ``config`` is the run's TrainConfig (or only its ModelConfig: the tokenizer is then not
    compared); ``family`` (a ModelFamily or its name) is compared when given."""
    if isinstance(config, ModelConfig):
        now_args: dict[str, Any] = {"model": dataclasses.asdict(config)}
    else:
        now_args = dataclasses.asdict(config)
    if family is not None:
        now_args[FAMILY_KEY] = getattr(family, "name", family)
    saved, now = model_signature(saved_args), model_signature(now_args)
    keys = [FAMILY_KEY, *MODEL_ARGS, TOKENIZER_KEY]
    return [f"{_flag(key)}: {saved[key]!s} in the checkpoint, {now[key]!s} now"
            for key in keys if key in saved and key in now and saved[key] != now[key]]


def check_checkpoint_args(config: TrainConfig | ModelConfig, saved_args: dict[str, Any],
                          path: str, family: Any = None) -> None:
    """Raise one :class:`CheckpointArgsError` naming every model-defining argument in which the
    checkpoint at ``path`` (its saved arguments ``saved_args``) differs from ``config`` (and
    ``family``), with the flags that build the checkpoint's model."""
    mismatches = checkpoint_args_mismatches(saved_args, config, family)
    if not mismatches:
        return
    hint = ""
    if saved_args.get("model"):
        flags = model_flags(_build(ModelConfig, saved_args["model"]))
        hint = f"; the checkpoint's model flags: {' '.join(flags)}"
    raise CheckpointArgsError(
        f"{path} was saved from a different model: {'; '.join(mismatches)} "
        f"(layout and training flags may change, the model's may not{hint})")


def check_model_matches_checkpoint(root: str, config: TrainConfig | ModelConfig,
                                   family: Any = None) -> None:
    """:func:`check_checkpoint_args` against the latest checkpoint under ``root`` (for tools
    that load without :func:`~megatron_chimera.checkpoint.loading.load_checkpoint`);
    checkpoints without a tracker or without recorded model arguments are not checked."""
    common = read_common(root)
    if common is None or not (common.get("args") or {}).get("model"):
        return
    check_checkpoint_args(config, common["args"], root, family)


def read_common(root: str) -> dict[str, Any] | None:
    """``common.pt`` of the latest iteration under ``root`` (None when there is no tracker)."""
    iteration = read_tracker(root)
    if iteration is None:
        return None
    path = checkpoint_dir(root, iteration)
    if not os.path.isdir(path) and os.path.isdir(path + ".old"):
        path += ".old"  # crashed while replacing a re-saved iteration (as load_checkpoint does)
    return safe_torch_load(os.path.join(path, COMMON_FILENAME))


def checkpoint_family_error(load: str | None, family: Any) -> str | None:
    """The line for an entry script of ``family`` (a ModelFamily) given ``--load`` of a
    checkpoint of the other family: what it holds and which entry script trains it. None when
    ``load`` holds no checkpoint, an unreadable one (the load names the problem) or one of
    ``family``."""
    if load is None or not os.path.isdir(load):
        return None
    try:
        common = read_common(load)
    except CheckpointError:
        return None
    saved = ((common or {}).get("args") or {}).get(FAMILY_KEY)
    saved = LEGACY_FAMILY_NAMES.get(saved, saved)
    if not saved or saved == family.name:
        return None
    other = FAMILIES.get(saved)
    if other is None:
        return f"--load {load} holds a model of family {saved!r}, which no entry script trains"
    kind = "GPT-family" if other.name == "gpt2" else other.title
    return (f"--load {load} holds a {kind} model: train it with {other.entry_point}, not "
            f"{family.entry_point}")


def _build(cls: type, values: dict[str, Any] | None) -> Any:
    """``cls(**values)`` keeping only its fields (older or newer checkpoints may differ); a
    nested record (``ModelConfig.moe``) is rebuilt from its dict the same way."""
    nested = {f.name: type(f.default) for f in dataclasses.fields(cls)
              if dataclasses.is_dataclass(f.default)}
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: (_build(nested[k], v) if k in nested and isinstance(v, dict)
                  else tuple(v) if isinstance(v, list) else v)
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


def saved_run_flags(common: dict[str, Any]) -> list[str]:
    """Megatron's ``--use-checkpoint-args``: the flags that build the checkpoint's model (its
    shape and model settings, ``--seq-length``) and its tokenizer type and ``--vocab-size``, to
    be parsed ahead of the command line (whose values then win). Empty when it records none."""
    args = common.get("args") or {}
    if not args.get("model"):
        return []
    model = _build(ModelConfig, args["model"])
    flags = model_flags(model, seq_length=model.seq_length)
    data = saved_data_config(common)
    if data.tokenizer_type is not None:
        flags += ["--tokenizer-type", data.tokenizer_type]
    if data.vocab_size is not None:
        flags += ["--vocab-size", str(data.vocab_size)]
    return flags
