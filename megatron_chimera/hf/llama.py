"""Llama, Mistral and Qwen2: Hugging Face ``*ForCausalLM`` <-> our ``GPTModel`` (RoPE, SwiGLU,
RMSNorm, grouped-query attention).

Hugging Face names (``model.`` prefix optional) -> ours (``L.`` = ``language_model.``):

* ``embed_tokens`` -> ``L.embedding.word_embeddings``; ``norm`` -> ``L.encoder.final_layernorm``;
  ``lm_head`` (untied only) -> ``L.output_layer``
* ``layers.{i}.input_layernorm`` / ``post_attention_layernorm`` -> the same names under
  ``L.encoder.layers.{i}``
* ``self_attn.{q,k,v}_proj`` -> ``self_attention.query_key_value``, rows per query group
  ``[q_1 .. q_(heads/g) | k | v]`` (Megatron's grouped layout); ``self_attn.o_proj`` ->
  ``self_attention.dense``
* ``mlp.gate_proj`` and ``mlp.up_proj`` -> ``mlp.dense_h_to_4h`` (``[gate; up]``),
  ``mlp.down_proj`` -> ``mlp.dense_4h_to_h``

Both use the rotate-half RoPE convention, so the query and key rows need no permutation.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_chimera.config import ModelConfig
from megatron_chimera.hf.common import HFError, TensorSource, require
from megatron_chimera.hf.tensor_formats import pad_vocab_rows, trim_vocab_rows
from megatron_chimera.model.rotary import (
    LLAMA3_HIGH_FREQ_FACTOR,
    LLAMA3_LOW_FREQ_FACTOR,
    LLAMA3_ORIGINAL_MAX_POSITIONS,
)

# model_type -> the architecture transformers builds for it
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM"}
_EMB = "language_model.embedding."
_ENC = "language_model.encoder."


def grouped_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                num_groups: int) -> torch.Tensor:
    """Separate query ``[n d, ...]``, key and value ``[g d, ...]`` rows -> the fused rows per
    query group ``[q_1 .. q_(n/g) | k | v]`` (weights or biases)."""
    rest = tuple(query.shape[1:])
    parts = [t.reshape(num_groups, -1, *rest) for t in (query, key, value)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_grouped_qkv(qkv: torch.Tensor, config: ModelConfig
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`grouped_qkv`."""
    g, d = config.query_groups, config.head_dim
    per_group = config.num_attention_heads // g
    rest = tuple(qkv.shape[1:])
    grouped = qkv.reshape(g, (per_group + 2) * d, *rest)
    query, key, value = grouped.split([per_group * d, d, d], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (query, key, value))


def _rope_scaling(hf: Any, source: str) -> tuple[bool, float]:
    """(use Llama-3 scaling, factor) of ``rope_scaling`` / ``rope_parameters``."""
    scaling = getattr(hf, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return False, ModelConfig.rope_scaling_factor
    require(kind == "llama3", source, f"rope_scaling type {kind!r} is not supported (default "
                                      "or llama3 only)")
    for name, ours in (("low_freq_factor", LLAMA3_LOW_FREQ_FACTOR),
                       ("high_freq_factor", LLAMA3_HIGH_FREQ_FACTOR),
                       ("original_max_position_embeddings", LLAMA3_ORIGINAL_MAX_POSITIONS)):
        require(float(scaling.get(name, ours)) == ours, source,
                f"rope_scaling {name} = {scaling.get(name)} is not supported (Megatron's "
                f"--use-rope-scaling fixes it to {ours})")
    return True, float(scaling["factor"])


def _rope_theta(hf: Any) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    theta = getattr(hf, "rope_theta", None) or params.get("rope_theta") or 10000.0
    return float(theta)


def model_config_from_hf(hf: Any, source: str, make_vocab_size_divisible_by: int,
                         max_position_embeddings: int | None = None) -> ModelConfig:
    """Our ModelConfig of a Llama / Mistral / Qwen2 config; unsupported variants (a sliding
    window, other activations or RoPE scalings, attention biases beyond Qwen2's) raise HFError
    naming the field."""
    model_type = hf.model_type
    require(getattr(hf, "hidden_act", "silu") == "silu", source,
            f"hidden_act {hf.hidden_act!r} is not supported (SwiGLU: silu only)")
    window = getattr(hf, "sliding_window", None)
    if model_type in ("qwen2", "qwen2_moe") and not getattr(hf, "use_sliding_window", False):
        window = None
    require(window is None, source, f"sliding_window = {window}: sliding-window attention is "
                                    "not implemented (full causal attention only)")
    require(not getattr(hf, "mlp_bias", False), source, "mlp_bias = true is not supported")
    qkv_bias = model_type == "qwen2"
    require(bool(getattr(hf, "attention_bias", qkv_bias)) == qkv_bias, source,
            f"attention_bias = {getattr(hf, 'attention_bias', None)} is not supported for "
            f"{model_type}")
    use_scaling, factor = _rope_scaling(hf, source)
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    groups = getattr(hf, "num_key_value_heads", None) or heads
    positions = hf.max_position_embeddings
    if max_position_embeddings is not None:
        positions = max_position_embeddings
    theta = _rope_theta(hf)
    require(theta == int(theta), source, f"rope_theta {theta} is not an integer "
                                         "(Megatron's --rotary-base is)")
    return ModelConfig(
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_attention_heads=heads,
        ffn_hidden_size=hf.intermediate_size, seq_length=positions,
        max_position_embeddings=positions, vocab_size=hf.vocab_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        hidden_dropout=0.0, attention_dropout=float(getattr(hf, "attention_dropout", 0.0)),
        init_method_std=hf.initializer_range, layernorm_epsilon=hf.rms_norm_eps,
        untie_embeddings_and_output_weights=not getattr(hf, "tie_word_embeddings", False),
        normalization="RMSNorm", swiglu=True,
        kv_channels=None if head_dim * heads == hf.hidden_size else head_dim,
        num_query_groups=None if groups == heads else groups,
        add_bias_linear=False, add_qkv_bias=qkv_bias, position_embedding_type="rope",
        rotary_base=int(theta), use_rope_scaling=use_scaling, rope_scaling_factor=factor)


def _attention_from_hf(src: TensorSource, hf: str, ours: str, config: ModelConfig,
                       out: dict[str, torch.Tensor]) -> None:
    g = config.query_groups
    q, k, v = (src.take(f"{hf}self_attn.{n}_proj.weight") for n in "qkv")
    out[ours + "self_attention.query_key_value.weight"] = grouped_qkv(q, k, v, g)
    if config.has_qkv_bias:
        q, k, v = (src.take(f"{hf}self_attn.{n}_proj.bias") for n in "qkv")
        out[ours + "self_attention.query_key_value.bias"] = grouped_qkv(q, k, v, g)
    out[ours + "self_attention.dense.weight"] = src.take(hf + "self_attn.o_proj.weight")


def dense_mlp_from_hf(src: TensorSource, hf: str, ours: str,
                      out: dict[str, torch.Tensor]) -> None:
    """``{hf}gate_proj`` and ``up_proj`` -> ``{ours}dense_h_to_4h`` (``[gate; up]``),
    ``{hf}down_proj`` -> ``{ours}dense_4h_to_h``."""
    out[ours + "dense_h_to_4h.weight"] = torch.cat(
        [src.take(hf + "gate_proj.weight"), src.take(hf + "up_proj.weight")])
    out[ours + "dense_4h_to_h.weight"] = src.take(hf + "down_proj.weight")


def dense_mlp_to_hf(state: dict[str, torch.Tensor], hf: str, ours: str,
                    out: dict[str, torch.Tensor]) -> None:
    """The inverse of :func:`dense_mlp_from_hf`."""
    gate, up = state[ours + "dense_h_to_4h.weight"].chunk(2, dim=0)
    out[hf + "gate_proj.weight"] = gate.contiguous()
    out[hf + "up_proj.weight"] = up.contiguous()
    out[hf + "down_proj.weight"] = state[ours + "dense_4h_to_h.weight"]


def state_from_hf(tensors: dict[str, torch.Tensor], config: ModelConfig,
                  source: str) -> dict[str, torch.Tensor]:
    """Our whole-model state dict from a Llama / Mistral / Qwen2 ``*ForCausalLM`` state dict."""
    src = TensorSource(tensors, source, prefix="model.",
                       ignore_suffixes=(".rotary_emb.inv_freq",))
    out = decoder_from_hf(src, config, source, mlp=True)
    src.check_consumed()
    return out


def decoder_from_hf(src: TensorSource, config: ModelConfig, source: str,
                    mlp: bool) -> dict[str, torch.Tensor]:
    """Everything but (``mlp`` False) the MLPs, taken from ``src`` (its leftovers unchecked:
    an MoE mapping takes the MLPs after)."""
    embed = src.take("embed_tokens.weight")
    if embed.shape[0] != config.vocab_size:
        raise HFError(f"{source}: embed_tokens has {embed.shape[0]} rows but config.json says "
                      f"vocab_size {config.vocab_size}")
    out = {_EMB + "word_embeddings.weight": pad_vocab_rows(embed, config.padded_vocab_size)}
    for i in range(config.num_layers):
        hf, ours = f"layers.{i}.", f"{_ENC}layers.{i}."
        out[ours + "input_layernorm.weight"] = src.take(hf + "input_layernorm.weight")
        _attention_from_hf(src, hf, ours, config, out)
        out[ours + "post_attention_layernorm.weight"] = src.take(
            hf + "post_attention_layernorm.weight")
        if mlp:
            dense_mlp_from_hf(src, hf + "mlp.", ours + "mlp.", out)
    out[_ENC + "final_layernorm.weight"] = src.take("norm.weight")
    has_head = src.has_raw("lm_head.weight")
    if config.untie_embeddings_and_output_weights:
        require(has_head, source, "tie_word_embeddings = false but no lm_head.weight")
        out["language_model.output_layer.weight"] = pad_vocab_rows(
            src.take_raw("lm_head.weight").float(), config.padded_vocab_size)
    elif has_head:
        require(torch.equal(src.take_raw("lm_head.weight").float(), embed), source,
                "lm_head.weight differs from embed_tokens.weight but tie_word_embeddings is true")
    return out


def state_to_hf(state: dict[str, torch.Tensor], config: ModelConfig,
                mlp: bool = True) -> dict[str, torch.Tensor]:
    """A ``*ForCausalLM`` state dict from our whole-model state dict (vocabulary unpadded);
    ``mlp`` False: without the MLPs (an MoE mapping adds them)."""
    vocab = config.vocab_size
    out = {"model.embed_tokens.weight": trim_vocab_rows(state[_EMB + "word_embeddings.weight"],
                                                        vocab)}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"{_ENC}layers.{i}."
        out[hf + "input_layernorm.weight"] = state[ours + "input_layernorm.weight"]
        qkv = split_grouped_qkv(state[ours + "self_attention.query_key_value.weight"], config)
        for name, tensor in zip("qkv", qkv):
            out[f"{hf}self_attn.{name}_proj.weight"] = tensor
        if config.has_qkv_bias:
            qkv = split_grouped_qkv(state[ours + "self_attention.query_key_value.bias"], config)
            for name, tensor in zip("qkv", qkv):
                out[f"{hf}self_attn.{name}_proj.bias"] = tensor
        out[hf + "self_attn.o_proj.weight"] = state[ours + "self_attention.dense.weight"]
        out[hf + "post_attention_layernorm.weight"] = state[
            ours + "post_attention_layernorm.weight"]
        if mlp:
            dense_mlp_to_hf(state, hf + "mlp.", ours + "mlp.", out)
    out["model.norm.weight"] = state[_ENC + "final_layernorm.weight"]
    if config.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = trim_vocab_rows(state["language_model.output_layer.weight"],
                                                vocab)
    return out


def check_exportable(config: ModelConfig, model_type: str) -> None:
    """HFError when ``config`` is not a model ``model_type``'s architecture can express."""
    expected_bias = model_type == "qwen2"
    if not (config.normalization == "RMSNorm" and config.swiglu
            and config.position_embedding_type == "rope" and not config.add_bias_linear
            and config.add_qkv_bias == expected_bias and config.rotary_percent == 1.0):
        raise HFError(f"export-hf --model-type {model_type}: the checkpoint's model is not "
                      f"{ARCHITECTURES[model_type]}-shaped (needs RMSNorm, SwiGLU, RoPE over "
                      f"whole heads, no linear biases{', a QKV bias' if expected_bias else ''})")


def hf_config_dict(config: ModelConfig, model_type: str, eod: int | None) -> dict[str, Any]:
    """``LlamaConfig`` / ``MistralConfig`` / ``Qwen2Config`` keyword arguments of ``config``."""
    check_exportable(config, model_type)
    out = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.ffn_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.query_groups, head_dim=config.head_dim,
        max_position_embeddings=config.max_positions, rms_norm_eps=config.layernorm_epsilon,
        rope_theta=float(config.rotary_base), hidden_act="silu",
        initializer_range=config.init_method_std, attention_dropout=config.attention_dropout,
        tie_word_embeddings=not config.untie_embeddings_and_output_weights,
        bos_token_id=eod, eos_token_id=eod, architectures=[ARCHITECTURES[model_type]])
    if config.use_rope_scaling:
        out["rope_scaling"] = {"rope_type": "llama3", "factor": config.rope_scaling_factor,
                               "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
                               "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
                               "original_max_position_embeddings":
                                   LLAMA3_ORIGINAL_MAX_POSITIONS}
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out["sliding_window"] = None
    if model_type == "qwen2":
        out["use_sliding_window"] = False
    return out
