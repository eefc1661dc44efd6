"""Megatron-BERT: Hugging Face ``MegatronBertForPreTraining`` / ``ForMaskedLM`` <-> ``BertModel``.

Hugging Face names (``bert.`` prefix optional) -> ours (``L.`` = ``language_model.``):

* ``embeddings.{word,position,token_type}_embeddings`` ->
  ``L.embedding.{word,position,tokentype}_embeddings``
* ``encoder.layer.{i}.attention.ln`` -> ``L.encoder.layers.{i}.input_layernorm``
* ``...attention.self.{query,key,value}`` -> ``...self_attention.query_key_value`` (per head)
* ``...attention.output.dense`` -> ``...self_attention.dense``; ``...ln`` ->
  ``post_attention_layernorm``; ``intermediate.dense`` / ``output.dense`` -> ``mlp.dense_*``
* ``encoder.ln`` -> ``L.encoder.final_layernorm``; ``pooler.dense`` -> ``L.pooler.dense``
* ``cls.predictions.transform.{dense,LayerNorm}``, ``cls.predictions.bias`` ->
  ``lm_head.{dense,layernorm,bias}``; ``cls.seq_relationship`` -> ``binary_head``
  (ForPreTraining only). The MLM decoder is tied to the word embedding on both sides.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_chimera.config import ModelConfig
from megatron_chimera.hf.common import HFError, TensorSource, gelu_from_hf, require
from megatron_chimera.hf.tensor_formats import (
    pad_vocab_rows,
    qkv_from_megatron,
    qkv_to_megatron,
    trim_vocab_rows,
)

MODEL_TYPE = "megatron-bert"
PRETRAINING = "MegatronBertForPreTraining"
MASKED_LM = "MegatronBertForMaskedLM"
_EMB = "language_model.embedding."
_ENC = "language_model.encoder."
IGNORED_SUFFIXES = ("embeddings.position_ids",)


def model_config_from_hf(hf: Any, tensors: dict[str, torch.Tensor], source: str,
                         make_vocab_size_divisible_by: int,
                         max_position_embeddings: int | None = None) -> ModelConfig:
    """Our ModelConfig of a ``MegatronBertConfig`` (binary head iff the weights have one)."""
    require(not getattr(hf, "is_decoder", False), source, "is_decoder = true is not supported")
    require(not getattr(hf, "add_cross_attention", False), source,
            "add_cross_attention = true is not supported")
    require(getattr(hf, "tie_word_embeddings", True), source,
            "tie_word_embeddings = false is not supported (our MLM decoder is tied, as Megatron's)")
    require(hf.hidden_size % hf.num_attention_heads == 0, source,
            f"hidden_size {hf.hidden_size} is not divisible by num_attention_heads "
            f"{hf.num_attention_heads}")
    position_type = getattr(hf, "position_embedding_type", "absolute")
    require(position_type == "absolute", source,
            f"position_embedding_type = {position_type!r} is not supported (absolute only)")
    positions = hf.max_position_embeddings
    if max_position_embeddings is not None:
        if max_position_embeddings > positions:
            raise HFError(f"--max-position-embeddings {max_position_embeddings} exceeds the "
                          f"model's max_position_embeddings {positions}")
        positions = max_position_embeddings
    binary_head = any(k.endswith("cls.seq_relationship.weight") for k in tensors)
    return ModelConfig(
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
        num_attention_heads=hf.num_attention_heads, ffn_hidden_size=hf.intermediate_size,
        seq_length=positions, max_position_embeddings=positions, vocab_size=hf.vocab_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        hidden_dropout=hf.hidden_dropout_prob, attention_dropout=hf.attention_probs_dropout_prob,
        init_method_std=hf.initializer_range, layernorm_epsilon=hf.layer_norm_eps,
        num_tokentypes=hf.type_vocab_size, bert_binary_head=binary_head,
        gelu=gelu_from_hf(hf.hidden_act, "hidden_act", source))


def _pair(src: TensorSource, hf: str, out: dict[str, torch.Tensor], ours: str) -> None:
    out[ours + ".weight"] = src.take(hf + ".weight")
    out[ours + ".bias"] = src.take(hf + ".bias")


def state_from_hf(tensors: dict[str, torch.Tensor], config: ModelConfig,
                  source: str) -> dict[str, torch.Tensor]:
    """Our whole-model state dict from a ``MegatronBertForPreTraining`` / ``ForMaskedLM`` one."""
    src = TensorSource(tensors, source, prefix="bert.", ignore_suffixes=IGNORED_SUFFIXES)
    heads, padded = config.num_attention_heads, config.padded_vocab_size
    word = src.take("embeddings.word_embeddings.weight")
    require(word.shape[0] == config.vocab_size, source,
            f"word_embeddings has {word.shape[0]} rows but config.json says vocab_size "
            f"{config.vocab_size}")
    out = {_EMB + "word_embeddings.weight": pad_vocab_rows(word, padded),
           _EMB + "position_embeddings.weight":
               src.take("embeddings.position_embeddings.weight")[:config.max_positions],
           _EMB + "tokentype_embeddings.weight":
               src.take("embeddings.token_type_embeddings.weight")}
    for i in range(config.num_layers):
        hf, ours = f"encoder.layer.{i}.", f"{_ENC}layers.{i}."
        _pair(src, hf + "attention.ln", out, ours + "input_layernorm")
        for kind in ("weight", "bias"):
            q, k, v = (src.take(f"{hf}attention.self.{n}.{kind}")
                       for n in ("query", "key", "value"))
            out[f"{ours}self_attention.query_key_value.{kind}"] = qkv_to_megatron(q, k, v, heads)
        _pair(src, hf + "attention.output.dense", out, ours + "self_attention.dense")
        _pair(src, hf + "ln", out, ours + "post_attention_layernorm")
        _pair(src, hf + "intermediate.dense", out, ours + "mlp.dense_h_to_4h")
        _pair(src, hf + "output.dense", out, ours + "mlp.dense_4h_to_h")
    _pair(src, "encoder.ln", out, _ENC + "final_layernorm")
    _take_heads(src, word, config, out, source)
    src.check_consumed()
    return out


def _take_heads(src: TensorSource, word: torch.Tensor, config: ModelConfig,
                out: dict[str, torch.Tensor], source: str) -> None:
    """MLM head (decoder tied to ``word``), pooler and binary head (ForPreTraining only)."""
    pre = "cls.predictions."
    if config.bert_binary_head:
        _pair(src, "pooler.dense", out, "language_model.pooler.dense")
    elif src.has("pooler.dense.weight"):  # a MaskedLM checkpoint may carry an unused pooler
        src.take("pooler.dense.weight")
        src.take("pooler.dense.bias")
    out["lm_head.dense.weight"] = src.take_raw(pre + "transform.dense.weight").float()
    out["lm_head.dense.bias"] = src.take_raw(pre + "transform.dense.bias").float()
    out["lm_head.layernorm.weight"] = src.take_raw(pre + "transform.LayerNorm.weight").float()
    out["lm_head.layernorm.bias"] = src.take_raw(pre + "transform.LayerNorm.bias").float()
    bias = src.take_raw(pre + "bias").float()
    if src.has_raw(pre + "decoder.bias"):
        require(torch.equal(src.take_raw(pre + "decoder.bias").float(), bias), source,
                "cls.predictions.decoder.bias differs from cls.predictions.bias")
    out["lm_head.bias"] = pad_vocab_rows(bias, config.padded_vocab_size)
    if src.has_raw(pre + "decoder.weight"):
        require(torch.equal(src.take_raw(pre + "decoder.weight").float(), word), source,
                "cls.predictions.decoder.weight differs from the word embeddings (untied MLM "
                "decoder is not supported)")
    if config.bert_binary_head:
        out["binary_head.weight"] = src.take_raw("cls.seq_relationship.weight").float()
        out["binary_head.bias"] = src.take_raw("cls.seq_relationship.bias").float()


def state_to_hf(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A Megatron-BERT state dict from ours: ``ForPreTraining`` with a binary head, else
    ``ForMaskedLM`` (vocabulary unpadded; a model without token types gets one zero row)."""
    heads, vocab, h = config.num_attention_heads, config.vocab_size, config.hidden_size
    tokentype = state.get(_EMB + "tokentype_embeddings.weight")
    if tokentype is None:
        tokentype = torch.zeros(1, h, dtype=state[_EMB + "word_embeddings.weight"].dtype)
    out = {"bert.embeddings.word_embeddings.weight":
               trim_vocab_rows(state[_EMB + "word_embeddings.weight"], vocab),
           "bert.embeddings.position_embeddings.weight": state[_EMB + "position_embeddings.weight"],
           "bert.embeddings.token_type_embeddings.weight": tokentype}

    def pair(ours: str, hf: str) -> None:
        out[hf + ".weight"] = state[ours + ".weight"]
        out[hf + ".bias"] = state[ours + ".bias"]

    for i in range(config.num_layers):
        hf, ours = f"bert.encoder.layer.{i}.", f"{_ENC}layers.{i}."
        pair(ours + "input_layernorm", hf + "attention.ln")
        for kind in ("weight", "bias"):
            q, k, v = qkv_from_megatron(state[f"{ours}self_attention.query_key_value.{kind}"],
                                        heads)
            for name, tensor in (("query", q), ("key", k), ("value", v)):
                out[f"{hf}attention.self.{name}.{kind}"] = tensor
        pair(ours + "self_attention.dense", hf + "attention.output.dense")
        pair(ours + "post_attention_layernorm", hf + "ln")
        pair(ours + "mlp.dense_h_to_4h", hf + "intermediate.dense")
        pair(ours + "mlp.dense_4h_to_h", hf + "output.dense")
    pair(_ENC + "final_layernorm", "bert.encoder.ln")
    pair("lm_head.dense", "cls.predictions.transform.dense")
    pair("lm_head.layernorm", "cls.predictions.transform.LayerNorm")
    out["cls.predictions.bias"] = trim_vocab_rows(state["lm_head.bias"], vocab)
    if config.bert_binary_head:
        pair("language_model.pooler.dense", "bert.pooler.dense")
        pair("binary_head", "cls.seq_relationship")
    return out


def hf_config_dict(config: ModelConfig, pad: int | None) -> tuple[dict[str, Any], str | None]:
    """``MegatronBertConfig`` keyword arguments for ``config``, and a warning when Hugging Face
    cannot express our GeLU forms exactly ("megatron": tanh MLP, exact LM head)."""
    warning = None
    if config.gelu == "megatron":
        warning = ("this BERT uses Megatron's GeLU forms (tanh approximation in the MLP, exact in "
                   "the LM head); Hugging Face has one hidden_act, exported as gelu_new (tanh), "
                   "so the MLM head's transform differs slightly (train with --gelu tanh or "
                   "--gelu erf for an exact export)")
    num_tokentypes = config.num_tokentypes or (2 if config.bert_binary_head else 0)
    kwargs = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        intermediate_size=config.ffn_size,
        hidden_act="gelu" if config.gelu == "erf" else "gelu_new",
        hidden_dropout_prob=config.hidden_dropout,
        attention_probs_dropout_prob=config.attention_dropout,
        max_position_embeddings=config.max_positions, type_vocab_size=max(num_tokentypes, 1),
        initializer_range=config.init_method_std, layer_norm_eps=config.layernorm_epsilon,
        pad_token_id=pad, tie_word_embeddings=True,
        architectures=[PRETRAINING if config.bert_binary_head else MASKED_LM])
    return kwargs, warning
