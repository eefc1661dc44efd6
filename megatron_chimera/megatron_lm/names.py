"""Megatron-core parameter names <-> ours, and how legacy files split each tensor over ranks.

Every reader normalises to Megatron-core's *global* names with a layer index,
``decoder.layers.{i}.<suffix>``, using the ``torch_dist`` suffixes: the layer norms are named after
the linear they feed (``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.
layer_norm_weight``), as in the Transformer-Engine spec; the local spec's ``input_layernorm`` /
``pre_mlp_layernorm`` (its legacy-file names) are aliases. Layouts that need no reordering,
checked against megatron-core 0.16.1: ``linear_qkv`` rows are grouped per query group
``[q of the group; k; v]`` (our ``query_key_value``'s layout), ``linear_fc1`` with SwiGLU is
``[gate; up]`` (our ``dense_h_to_4h``'s).
"""

from __future__ import annotations

import re

LAYER_PREFIX = "decoder.layers."
OUR_LAYER_PREFIX = "language_model.encoder.layers."
# per-layer suffix: Megatron-core -> ours
LAYER_NAMES: dict[str, str] = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "self_attention.linear_qkv.weight": "self_attention.query_key_value.weight",
    "self_attention.linear_qkv.bias": "self_attention.query_key_value.bias",
    "self_attention.linear_proj.weight": "self_attention.dense.weight",
    "self_attention.linear_proj.bias": "self_attention.dense.bias",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "post_attention_layernorm.bias",
    "mlp.linear_fc1.weight": "mlp.dense_h_to_4h.weight",
    "mlp.linear_fc1.bias": "mlp.dense_h_to_4h.bias",
    "mlp.linear_fc2.weight": "mlp.dense_4h_to_h.weight",
    "mlp.linear_fc2.bias": "mlp.dense_4h_to_h.bias",
}
# whole-model names: Megatron-core -> ours
GLOBAL_NAMES: dict[str, str] = {
    "embedding.word_embeddings.weight": "language_model.embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight":
        "language_model.embedding.position_embeddings.weight",
    "decoder.final_layernorm.weight": "language_model.encoder.final_layernorm.weight",
    "decoder.final_layernorm.bias": "language_model.encoder.final_layernorm.bias",
    "output_layer.weight": "language_model.output_layer.weight",
}
# the local spec's legacy-file names of the layer norms -> the torch_dist names
LOCAL_SPEC_ALIASES: dict[str, str] = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
EXTRA_STATE = "_extra_state"  # Transformer Engine's / local linears' non-tensor state
# how a legacy file splits a tensor over tensor ranks: dim 0, dim 1, [gate_r; up_r], replicated
SPLIT_ROWS, SPLIT_COLUMNS, SPLIT_GATED, REPLICATED = "rows", "columns", "gated", "replicated"
_ROWS = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
         "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "embedding.word_embeddings.weight",
         "output_layer.weight")
_COLUMNS = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_LAYER_FROM_OURS = {ours: megatron for megatron, ours in LAYER_NAMES.items()}
_GLOBAL_FROM_OURS = {ours: megatron for megatron, ours in GLOBAL_NAMES.items()}


def split_layer_name(name: str) -> tuple[int, str] | None:
    """``decoder.layers.3.mlp.linear_fc1.weight`` -> (3, ``mlp.linear_fc1.weight``)."""
    match = _LAYER.fullmatch(name)
    return (int(match.group(1)), match.group(2)) if match else None


def layer_name(index: int, suffix: str) -> str:
    """The Megatron-core name of ``suffix`` in layer ``index``."""
    return f"{LAYER_PREFIX}{index}.{suffix}"


def normalise_suffix(suffix: str) -> str:
    """A per-layer suffix in the torch_dist spelling (local-spec layer-norm names renamed)."""
    return LOCAL_SPEC_ALIASES.get(suffix, suffix)


def tensor_split(name: str, swiglu: bool) -> str:
    """How legacy files split the (normalised) Megatron tensor ``name`` over tensor ranks."""
    parsed = split_layer_name(name)
    suffix = parsed[1] if parsed else name
    if suffix.startswith("mlp.linear_fc1.") and suffix.endswith(("weight", "bias")) and swiglu \
            and "layer_norm" not in suffix:
        return SPLIT_GATED
    if suffix in _ROWS:
        return SPLIT_ROWS
    if suffix in _COLUMNS:
        return SPLIT_COLUMNS
    return REPLICATED


def to_ours(name: str) -> str | None:
    """Our parameter name of the normalised Megatron name, None when we have no such part."""
    parsed = split_layer_name(name)
    if parsed is None:
        return GLOBAL_NAMES.get(name)
    index, suffix = parsed
    ours = LAYER_NAMES.get(suffix)
    return f"{OUR_LAYER_PREFIX}{index}.{ours}" if ours else None


def from_ours(name: str) -> str:
    """The Megatron-core name (with its layer index) of one of our parameter names."""
    if name.startswith(OUR_LAYER_PREFIX):
        index, suffix = name[len(OUR_LAYER_PREFIX):].split(".", 1)
        if suffix in _LAYER_FROM_OURS:
            return layer_name(int(index), _LAYER_FROM_OURS[suffix])
    if name in _GLOBAL_FROM_OURS:
        return _GLOBAL_FROM_OURS[name]
    raise KeyError(f"{name}: no Megatron-core name (a part Megatron's GPTModel does not have)")
