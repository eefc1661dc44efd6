"""GPT-2: Hugging Face ``GPT2LMHeadModel`` <-> our ``GPTModel`` (configs and parameter names).

Hugging Face names (``transformer.`` prefix optional) -> ours (``L.`` = ``language_model.``):

* ``wte``, ``wpe`` -> ``L.embedding.word_embeddings``, ``L.embedding.position_embeddings``
* ``h.{i}.ln_1`` / ``ln_2`` -> ``L.encoder.layers.{i}.input_layernorm`` /
  ``post_attention_layernorm``
* ``h.{i}.attn.c_attn`` (Conv1D, ``[q|k|v]``) -> ``...self_attention.query_key_value`` (per head)
* ``h.{i}.attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj`` (Conv1D) -> ``self_attention.dense``,
  ``mlp.dense_h_to_4h``, ``mlp.dense_4h_to_h``
* ``ln_f`` -> ``L.encoder.final_layernorm``; ``lm_head`` (untied only) -> ``L.output_layer``
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_chimera.config import ModelConfig
from megatron_chimera.hf.common import HFError, TensorSource, gelu_from_hf, require
from megatron_chimera.hf.tensor_formats import (
    conv1d_to_linear,
    fused_qkv_from_megatron,
    fused_qkv_to_megatron,
    linear_to_conv1d,
    pad_vocab_rows,
    trim_vocab_rows,
)

MODEL_TYPE = "gpt2"
ARCHITECTURE = "GPT2LMHeadModel"
_EMB = "language_model.embedding."
_ENC = "language_model.encoder."
# buffers older GPT-2 checkpoints carry (the causal mask); not weights
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def model_config_from_hf(hf: Any, source: str, make_vocab_size_divisible_by: int,
                         max_position_embeddings: int | None = None) -> ModelConfig:
    """Our ModelConfig of a ``GPT2Config``; unsupported variants raise HFError naming the field."""
    require(bool(getattr(hf, "scale_attn_weights", True)), source,
            "scale_attn_weights = false (unscaled attention) is not supported")
    require(not getattr(hf, "scale_attn_by_inverse_layer_idx", False), source,
            "scale_attn_by_inverse_layer_idx = true is not supported")
    require(not getattr(hf, "add_cross_attention", False), source,
            "add_cross_attention = true is not supported")
    require(hf.n_embd % hf.n_head == 0, source,
            f"n_embd {hf.n_embd} is not divisible by n_head {hf.n_head}")
    positions = hf.n_positions
    if max_position_embeddings is not None:
        if max_position_embeddings > positions:
            raise HFError(f"--max-position-embeddings {max_position_embeddings} exceeds the "
                          f"model's n_positions {positions} (no trained rows to extend with)")
        positions = max_position_embeddings
    return ModelConfig(
        num_layers=hf.n_layer, hidden_size=hf.n_embd, num_attention_heads=hf.n_head,
        ffn_hidden_size=hf.n_inner or 4 * hf.n_embd, seq_length=positions,
        max_position_embeddings=positions, vocab_size=hf.vocab_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        hidden_dropout=hf.resid_pdrop, attention_dropout=hf.attn_pdrop,
        init_method_std=hf.initializer_range, layernorm_epsilon=hf.layer_norm_epsilon,
        untie_embeddings_and_output_weights=not getattr(hf, "tie_word_embeddings", True),
        gelu=_gpt_gelu(gelu_from_hf(hf.activation_function, "activation_function", source)))


def _gpt_gelu(form: str) -> str:
    """GPT-2 has GeLU only in its MLP, where "megatron" (the training default) is the tanh
    approximation: record that, so fine-tuning needs no --gelu flag."""
    return "megatron" if form == "tanh" else form


def state_from_hf(tensors: dict[str, torch.Tensor], config: ModelConfig,
                  source: str) -> dict[str, torch.Tensor]:
    """Our whole-model state dict from a ``GPT2LMHeadModel`` state dict."""
    src = TensorSource(tensors, source, prefix="transformer.", ignore_suffixes=IGNORED_SUFFIXES)
    heads, padded = config.num_attention_heads, config.padded_vocab_size
    wte = src.take("wte.weight")
    require(wte.shape[0] == config.vocab_size, source,
            f"wte has {wte.shape[0]} rows but config.json says vocab_size {config.vocab_size}")
    out = {_EMB + "word_embeddings.weight": pad_vocab_rows(wte, padded),
           _EMB + "position_embeddings.weight": src.take("wpe.weight")[:config.max_positions]}
    for i in range(config.num_layers):
        hf, ours = f"h.{i}.", f"{_ENC}layers.{i}."
        out[ours + "input_layernorm.weight"] = src.take(hf + "ln_1.weight")
        out[ours + "input_layernorm.bias"] = src.take(hf + "ln_1.bias")
        qkv = conv1d_to_linear(src.take(hf + "attn.c_attn.weight"))
        out[ours + "self_attention.query_key_value.weight"] = fused_qkv_to_megatron(qkv, heads)
        out[ours + "self_attention.query_key_value.bias"] = fused_qkv_to_megatron(
            src.take(hf + "attn.c_attn.bias"), heads)
        for hf_name, our_name in (("attn.c_proj", "self_attention.dense"),
                                  ("mlp.c_fc", "mlp.dense_h_to_4h"),
                                  ("mlp.c_proj", "mlp.dense_4h_to_h")):
            out[f"{ours}{our_name}.weight"] = conv1d_to_linear(src.take(f"{hf}{hf_name}.weight"))
            out[f"{ours}{our_name}.bias"] = src.take(f"{hf}{hf_name}.bias")
        out[ours + "post_attention_layernorm.weight"] = src.take(hf + "ln_2.weight")
        out[ours + "post_attention_layernorm.bias"] = src.take(hf + "ln_2.bias")
    out[_ENC + "final_layernorm.weight"] = src.take("ln_f.weight")
    out[_ENC + "final_layernorm.bias"] = src.take("ln_f.bias")
    _take_head(src, wte, config, out, source)
    src.check_consumed()
    return out


def _take_head(src: TensorSource, wte: torch.Tensor, config: ModelConfig,
               out: dict[str, torch.Tensor], source: str) -> None:
    """The LM head: absent or equal to ``wte`` when tied, a separate ``output_layer`` if not."""
    has_head = src.has_raw("lm_head.weight")  # the head sits outside the "transformer." prefix
    if config.untie_embeddings_and_output_weights:
        require(has_head, source, "tie_word_embeddings = false but no lm_head.weight")
        out["language_model.output_layer.weight"] = pad_vocab_rows(
            src.take_raw("lm_head.weight").float(), config.padded_vocab_size)
    elif has_head:
        head = src.take_raw("lm_head.weight").float()
        require(torch.equal(head, wte), source,
                "lm_head.weight differs from wte.weight but tie_word_embeddings is true")


def check_exportable(config: ModelConfig) -> None:
    """HFError when ``config`` is not GPT-2's architecture (LayerNorm, GeLU MLP with biases,
    learned positions, one key/value head per head of size hidden / heads)."""
    gpt2_shaped = (config.normalization == "LayerNorm" and not config.swiglu
                   and config.add_bias_linear and config.num_query_groups is None
                   and config.kv_channels in (None,
                                              config.hidden_size // config.num_attention_heads)
                   and config.learned_positions)
    if not gpt2_shaped:
        raise HFError("export-hf: the checkpoint's model is neither GPT-2-shaped (LayerNorm, GeLU "
                      "MLP with biases, learned positions, no query groups) nor a RoPE decoder "
                      "(Llama, Mistral, Qwen2): transformers has no architecture for it")


def state_to_hf(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A ``GPT2LMHeadModel`` state dict from our whole-model state dict (vocabulary unpadded)."""
    check_exportable(config)
    heads, vocab = config.num_attention_heads, config.vocab_size
    out = {"transformer.wte.weight": trim_vocab_rows(state[_EMB + "word_embeddings.weight"],
                                                     vocab),
           "transformer.wpe.weight": state[_EMB + "position_embeddings.weight"]}
    for i in range(config.num_layers):
        hf, ours = f"transformer.h.{i}.", f"{_ENC}layers.{i}."
        out[hf + "ln_1.weight"] = state[ours + "input_layernorm.weight"]
        out[hf + "ln_1.bias"] = state[ours + "input_layernorm.bias"]
        qkv = fused_qkv_from_megatron(state[ours + "self_attention.query_key_value.weight"], heads)
        out[hf + "attn.c_attn.weight"] = linear_to_conv1d(qkv)
        out[hf + "attn.c_attn.bias"] = fused_qkv_from_megatron(
            state[ours + "self_attention.query_key_value.bias"], heads)
        for hf_name, our_name in (("attn.c_proj", "self_attention.dense"),
                                  ("mlp.c_fc", "mlp.dense_h_to_4h"),
                                  ("mlp.c_proj", "mlp.dense_4h_to_h")):
            out[f"{hf}{hf_name}.weight"] = linear_to_conv1d(state[f"{ours}{our_name}.weight"])
            out[f"{hf}{hf_name}.bias"] = state[f"{ours}{our_name}.bias"]
        out[hf + "ln_2.weight"] = state[ours + "post_attention_layernorm.weight"]
        out[hf + "ln_2.bias"] = state[ours + "post_attention_layernorm.bias"]
    out["transformer.ln_f.weight"] = state[_ENC + "final_layernorm.weight"]
    out["transformer.ln_f.bias"] = state[_ENC + "final_layernorm.bias"]
    if config.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = trim_vocab_rows(state["language_model.output_layer.weight"],
                                                vocab)
    return out


def hf_config_dict(config: ModelConfig, eod: int | None) -> dict[str, Any]:
    """``GPT2Config`` keyword arguments describing ``config`` (GeLU "megatron" = tanh in GPT)."""
    return dict(
        vocab_size=config.vocab_size, n_positions=config.max_positions,
        n_embd=config.hidden_size, n_layer=config.num_layers, n_head=config.num_attention_heads,
        n_inner=config.ffn_size, activation_function="gelu" if config.gelu == "erf" else "gelu_new",
        resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout,
        attn_pdrop=config.attention_dropout, layer_norm_epsilon=config.layernorm_epsilon,
        initializer_range=config.init_method_std,
        tie_word_embeddings=not config.untie_embeddings_and_output_weights,
        bos_token_id=eod, eos_token_id=eod, architectures=[ARCHITECTURE])
