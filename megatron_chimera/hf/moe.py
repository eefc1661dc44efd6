"""Mixtral and Qwen2-MoE: Hugging Face ``*ForCausalLM`` <-> our ``GPTModel`` with MoE layers.

The attention, norms, embeddings and head map as for Llama / Qwen2 (:mod:`~megatron_chimera.hf.
llama`); the MLP of layer ``i`` (``L.`` = ``language_model.encoder.layers.{i}.``):

* Mixtral ``block_sparse_moe.gate`` / Qwen2-MoE ``mlp.gate`` ``[E, h]`` -> ``L.mlp.router.weight``
* expert ``e``: Mixtral ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down) /
  Qwen2-MoE ``mlp.experts.{e}.gate_proj``, ``up_proj``, ``down_proj`` ->
  ``L.mlp.experts.weight1[e] = [gate; up]^T`` ``[h, 2f]`` and ``weight2[e] = down^T`` ``[f, h]``
  (``transformers`` 5's fused in-memory names ``experts.gate_up_proj`` ``[E, 2f, h]`` and
  ``experts.down_proj`` ``[E, h, f]`` are read too; export writes the per-expert Hub names)
* Qwen2-MoE ``mlp.shared_expert.{gate,up,down}_proj`` -> ``L.mlp.shared_experts.dense_h_to_4h``
  / ``dense_4h_to_h`` (``--moe-shared-expert-intermediate-size``) and ``mlp.shared_expert_gate``
  ``[1, h]`` -> ``L.mlp.shared_experts.gate_weight`` (``--moe-shared-expert-gate``)
* a Qwen2-MoE dense layer (``mlp_only_layers``, ``decoder_sparse_step``) keeps Llama's MLP names;
  the pattern becomes ``--moe-layer-freq`` as a 0/1 list.

Routing (transformers' ``TopKRouter``): a softmax over all experts, the top k, renormalised to
sum 1 (Mixtral always, Qwen2-MoE with ``norm_topk_prob``) -- the same probabilities as Megatron's
default ``--moe-router-score-function softmax`` (softmax over the top-k logits); without
renormalisation -- ``--moe-router-pre-softmax``. Both are dropless (no capacity factor).
Qwen3-MoE is refused: its per-head query/key RMSNorm (``q_norm`` / ``k_norm``) is not in our
attention.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_chimera.config import ModelConfig, MoEConfig
from megatron_chimera.hf import llama
from megatron_chimera.hf.common import HFError, TensorSource, require

ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
# model types we recognise but cannot convert, and why
REFUSED = {"qwen3_moe": "Qwen3-MoE normalises each query and key head (q_norm / k_norm RMSNorm, "
                        "Megatron's --qk-layernorm), which our attention does not implement"}
_ENC = "language_model.encoder."


def _hf_moe_layers(hf: Any) -> list[bool]:
    """Which layers of ``hf`` are MoE layers (Qwen2-MoE: not in ``mlp_only_layers`` and
    ``(i + 1) % decoder_sparse_step == 0``; Mixtral: all)."""
    if hf.model_type == "mixtral":
        return [True] * hf.num_hidden_layers
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf, "mlp_only_layers", None) or [])
    return [i not in dense and hf.num_experts > 0 and (i + 1) % step == 0
            for i in range(hf.num_hidden_layers)]


def model_config_from_hf(hf: Any, source: str, make_vocab_size_divisible_by: int,
                         max_position_embeddings: int | None = None) -> ModelConfig:
    """Our ModelConfig (with its :class:`MoEConfig`) of a Mixtral / Qwen2-MoE config; settings
    whose semantics we do not reproduce raise HFError naming the field."""
    model_type = hf.model_type
    if model_type in REFUSED:
        raise HFError(f"{source}: model_type {model_type!r} is not supported: "
                      f"{REFUSED[model_type]}")
    base = llama.model_config_from_hf(hf, source, make_vocab_size_divisible_by,
                                      max_position_embeddings)
    jitter = float(getattr(hf, "router_jitter_noise", 0.0) or 0.0)
    require(jitter == 0.0, source, f"router_jitter_noise = {jitter} is not supported (our "
                                   "router has no input jitter)")
    if model_type == "mixtral":
        experts, pre_softmax = hf.num_local_experts, False
        expert_size, qkv_bias, shared = hf.intermediate_size, False, None
    else:
        experts, pre_softmax = hf.num_experts, not hf.norm_topk_prob
        expert_size, qkv_bias = hf.moe_intermediate_size, bool(getattr(hf, "qkv_bias", True))
        shared = hf.shared_expert_intermediate_size
        require(shared > 0, source, "shared_expert_intermediate_size must be positive")
    pattern = _hf_moe_layers(hf)
    require(any(pattern), source, "no layer is an MoE layer (num_experts, decoder_sparse_step, "
                                  "mlp_only_layers): import it as a dense model")
    topk = hf.num_experts_per_tok
    require(1 <= topk <= experts, source, f"num_experts_per_tok = {topk} is not in 1..{experts}")
    freq: int | str = 1 if all(pattern) else "[" + ",".join(str(int(p)) for p in pattern) + "]"
    moe = MoEConfig(num_experts=experts, moe_ffn_hidden_size=expert_size, moe_router_topk=topk,
                    moe_router_score_function="softmax", moe_router_pre_softmax=pre_softmax,
                    moe_router_load_balancing_type="aux_loss",
                    moe_aux_loss_coeff=float(getattr(hf, "router_aux_loss_coef", 0.0)),
                    moe_shared_expert_intermediate_size=shared,
                    moe_shared_expert_gate=shared is not None, moe_layer_freq=freq)
    return dataclasses.replace(base, add_qkv_bias=qkv_bias, moe=moe)


def _mlp_names(model_type: str) -> tuple[str, str, str, str]:
    """(the MoE block's name, expert gate, up, down projection names) of ``model_type``."""
    if model_type == "mixtral":
        return "block_sparse_moe", "w1", "w3", "w2"
    return "mlp", "gate_proj", "up_proj", "down_proj"


def _experts_from_hf(src: TensorSource, block: str, model_type: str, num_experts: int,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight1`` ``[E, h, 2f]`` and ``weight2`` ``[E, f, h]`` from per-expert or fused
    tensors."""
    if src.has(block + "experts.gate_up_proj"):  # transformers' fused in-memory layout
        gate_up = src.take(block + "experts.gate_up_proj")  # [E, 2f, h]
        down = src.take(block + "experts.down_proj")  # [E, h, f]
        require(gate_up.shape[0] == num_experts, src.source,
                f"{block}experts.gate_up_proj holds {gate_up.shape[0]} experts, config.json "
                f"says {num_experts}")
        return gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    _, gate, up, down = _mlp_names(model_type)
    first, second = [], []
    for e in range(num_experts):
        name = f"{block}experts.{e}."
        fused = torch.cat([src.take(f"{name}{gate}.weight"), src.take(f"{name}{up}.weight")])
        first.append(fused.t())
        second.append(src.take(f"{name}{down}.weight").t())
    return torch.stack(first).contiguous(), torch.stack(second).contiguous()


def state_from_hf(tensors: dict[str, torch.Tensor], config: ModelConfig, model_type: str,
                  source: str) -> dict[str, torch.Tensor]:
    """Our whole-model state dict from a Mixtral / Qwen2-MoE ``*ForCausalLM`` state dict."""
    src = TensorSource(tensors, source, prefix="model.",
                       ignore_suffixes=(".rotary_emb.inv_freq",))
    out = llama.decoder_from_hf(src, config, source, mlp=False)
    block_name = _mlp_names(model_type)[0]
    pattern = config.moe.moe_layers(config.num_layers)
    for i in range(config.num_layers):
        hf, ours = f"layers.{i}.", f"{_ENC}layers.{i}.mlp."
        if not pattern[i]:
            llama.dense_mlp_from_hf(src, hf + "mlp.", ours, out)
            continue
        block = f"{hf}{block_name}."
        out[ours + "router.weight"] = src.take(block + "gate.weight")
        out[ours + "experts.weight1"], out[ours + "experts.weight2"] = _experts_from_hf(
            src, block, model_type, config.moe.num_experts)
        if config.moe.moe_shared_expert_intermediate_size:
            llama.dense_mlp_from_hf(src, block + "shared_expert.", ours + "shared_experts.",
                                    out)
            out[ours + "shared_experts.gate_weight"] = src.take(
                block + "shared_expert_gate.weight")
    src.check_consumed()
    return out


def state_to_hf(state: dict[str, torch.Tensor], config: ModelConfig,
                model_type: str) -> dict[str, torch.Tensor]:
    """A Mixtral / Qwen2-MoE ``*ForCausalLM`` state dict (per-expert Hub names) from ours."""
    out = llama.state_to_hf(state, config, mlp=False)
    block_name, gate, up, down = _mlp_names(model_type)
    pattern = config.moe.moe_layers(config.num_layers)
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"{_ENC}layers.{i}.mlp."
        if not pattern[i]:
            llama.dense_mlp_to_hf(state, hf + "mlp.", ours, out)
            continue
        block = f"{hf}{block_name}."
        out[block + "gate.weight"] = state[ours + "router.weight"]
        weight1, weight2 = state[ours + "experts.weight1"], state[ours + "experts.weight2"]
        for e in range(config.moe.num_experts):
            name = f"{block}experts.{e}."
            g, u = weight1[e].t().chunk(2, dim=0)
            out[f"{name}{gate}.weight"] = g.contiguous()
            out[f"{name}{up}.weight"] = u.contiguous()
            out[f"{name}{down}.weight"] = weight2[e].t().contiguous()
        if config.moe.moe_shared_expert_intermediate_size:
            llama.dense_mlp_to_hf(state, block + "shared_expert.", ours + "shared_experts.", out)
            out[block + "shared_expert_gate.weight"] = state[ours + "shared_experts.gate_weight"]
    return out


def default_model_type(config: ModelConfig) -> str:
    """The architecture an MoE checkpoint exports as when not imported: Qwen2-MoE with a
    shared expert, Mixtral without."""
    return "qwen2_moe" if config.moe.moe_shared_expert_intermediate_size else "mixtral"


def check_exportable(config: ModelConfig, model_type: str) -> list[str]:
    """HFError when ``model_type`` cannot express ``config``'s MoE (routing included); the
    notes on training-only settings its config does not record."""
    moe, name = config.moe, f"export-hf --model-type {model_type}"
    if model_type in REFUSED:
        raise HFError(f"{name}: {REFUSED[model_type]}")
    if not moe.enabled:
        raise HFError(f"{name}: the checkpoint has no MoE layers (--num-experts); export it as "
                      f"llama, mistral or qwen2")
    problems = []
    if moe.moe_router_score_function != "softmax":
        problems.append("--moe-router-score-function sigmoid (transformers routes by softmax)")
    if moe.moe_expert_capacity_factor is not None:
        problems.append("--moe-expert-capacity-factor (transformers' routing is dropless)")
    pattern = moe.moe_layers(config.num_layers)
    if model_type == "mixtral":
        if moe.moe_router_pre_softmax:
            problems.append("--moe-router-pre-softmax (Mixtral renormalises its top-k)")
        if moe.moe_shared_expert_intermediate_size:
            problems.append("--moe-shared-expert-intermediate-size (Mixtral has no shared "
                            "expert; export as qwen2_moe)")
        if not all(pattern):
            problems.append("dense layers in --moe-layer-freq (every Mixtral layer is MoE)")
    else:
        if not moe.moe_shared_expert_intermediate_size or not moe.moe_shared_expert_gate:
            problems.append("a shared expert with its gate (Qwen2-MoE always has one: "
                            "--moe-shared-expert-intermediate-size and --moe-shared-expert-gate)")
    if problems:
        raise HFError(f"{name}: the checkpoint's MoE is not expressible: " + "; ".join(problems))
    notes = []
    if moe.moe_z_loss_coeff or moe.moe_router_load_balancing_type != "aux_loss":
        notes.append("the router's training losses (--moe-router-load-balancing-type "
                     f"{moe.moe_router_load_balancing_type}, --moe-z-loss-coeff "
                     f"{moe.moe_z_loss_coeff}) have no {ARCHITECTURES[model_type]} config field "
                     "(inference is unaffected)")
    return notes


def hf_config_dict(config: ModelConfig, model_type: str, eod: int | None
                   ) -> tuple[dict[str, Any], list[str]]:
    """``MixtralConfig`` / ``Qwen2MoeConfig`` keyword arguments of ``config`` and notes."""
    notes = check_exportable(config, model_type)
    moe = config.moe
    dense_base = "qwen2" if config.add_qkv_bias else "mistral"
    if model_type == "mixtral" and config.add_qkv_bias:
        raise HFError("export-hf --model-type mixtral: the checkpoint has a QKV bias "
                      "(--add-qkv-bias), Mixtral has none; export as qwen2_moe")
    out = llama.hf_config_dict(config, dense_base, eod)
    out.update(architectures=[ARCHITECTURES[model_type]], num_experts_per_tok=moe.moe_router_topk,
               router_aux_loss_coef=moe.moe_aux_loss_coeff)
    expert_size = moe.moe_ffn_hidden_size or config.ffn_size
    if model_type == "mixtral":
        out.update(num_local_experts=moe.num_experts, intermediate_size=expert_size,
                   router_jitter_noise=0.0)
        return out, notes
    pattern = moe.moe_layers(config.num_layers)
    out.pop("sliding_window", None)
    out.update(num_experts=moe.num_experts, moe_intermediate_size=expert_size,
               shared_expert_intermediate_size=moe.moe_shared_expert_intermediate_size,
               norm_topk_prob=not moe.moe_router_pre_softmax, decoder_sparse_step=1,
               mlp_only_layers=[i for i, p in enumerate(pattern) if not p],
               qkv_bias=config.add_qkv_bias, use_sliding_window=False)
    return out, notes
