"""The one FLOP count of GPT-2 and BERT (a multiply-add is two FLOPs; Narayanan et al., SC'21).

One transformer layer's forward on ``b`` sequences of length ``s``: ``2bs(3h² + h² + 2hf)`` in
the matmuls with weights (QKV, dense, the two MLP linears; ``24bsh²`` for ``f = 4h``) plus
``4bs²h`` for the attention scores and values. Grouped-query attention shrinks the K/V part of
QKV to ``2 g d h`` (``g`` query groups of head dimension ``d``); SwiGLU has three ``h x f``
matrices (gate, up, down). The LM head adds ``2bshV`` (BERT's head transform
``2bsh²`` more). A backward costs two forwards -- half of it the weight gradients a split-backward
schedule defers to W -- and full recomputation one forward more. Summed over the model this is
Megatron's ``72 B s L h² (1 + s/(6h) + V/(12 L h))`` per iteration (``96`` with recomputation).
"""

from __future__ import annotations

from megatron_chimera.config import ModelConfig
from megatron_chimera.model.family import ModelFamily


def layer_forward_flops(config: ModelConfig, micro_batch: int) -> tuple[float, float]:
    """(matmul-with-weights FLOPs, attention score/value FLOPs) of one layer's forward: QKV
    (``h x (heads + 2 groups) x head_dim``: grouped-query attention's smaller K/V), dense, the
    MLP's two (SwiGLU: three) ``h x f`` matrices; scores and values over the query heads."""
    b, s, h, f = micro_batch, config.seq_length, config.hidden_size, config.ffn_size
    inner = config.num_attention_heads * config.head_dim
    mlp_matrices = 3 if config.swiglu else 2
    weights = 2 * b * s * (h * config.qkv_size + inner * h + mlp_matrices * h * f)
    attention = 4 * b * s * s * inner
    return float(weights), float(attention)


def head_forward_flops(config: ModelConfig, family: ModelFamily, micro_batch: int) -> float:
    """FLOPs of the LM head's forward (logits over the padded vocabulary; BERT's transform)."""
    tokens = micro_batch * config.seq_length
    flops = 2.0 * tokens * config.hidden_size * config.padded_vocab_size
    if family.lm_head_transform:
        flops += 2.0 * tokens * config.hidden_size * config.hidden_size
    return flops


def stage_forward_flops(config: ModelConfig, family: ModelFamily, num_layers: int,
                        post_process: bool, micro_batch: int) -> tuple[float, float]:
    """(weight-matmul FLOPs, other FLOPs) of one stage's forward: its layers (+ the head)."""
    weights, attention = layer_forward_flops(config, micro_batch)
    weights *= num_layers
    attention *= num_layers
    if post_process:
        weights += head_forward_flops(config, family, micro_batch)
    return weights, attention


def training_flops(config: ModelConfig, family: ModelFamily, batch_size: int) -> float:
    """FLOPs of one training iteration on ``batch_size`` sequences: forward, backward (2x) and,
    with full recomputation, a second forward."""
    weights, attention = stage_forward_flops(config, family, config.num_layers, True, batch_size)
    passes = 4 if config.recompute_granularity == "full" else 3
    return passes * (weights + attention)
