"""Tensor layouts that differ between Megatron and Hugging Face: QKV order, Conv1D, vocabulary rows.

Megatron's ``query_key_value`` projection has ``3h`` output rows ordered per head,
``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (each block ``head_dim`` rows); Hugging Face keeps
``[q_all | k_all | v_all]`` (GPT-2's fused ``c_attn``) or three separate linears (Megatron-BERT).
A plain reshape or transpose between the two runs without error and gives wrong logits. GPT-2's
``Conv1D`` stores weights ``[in, out]``, the transpose of ``nn.Linear``.
"""

from __future__ import annotations

import torch


def qkv_to_megatron(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    num_heads: int) -> torch.Tensor:
    """Separate ``[h, ...]`` query, key, value weights (or biases) -> Megatron's per-head
    interleaved ``[3h, ...]``."""
    if not query.shape == key.shape == value.shape or query.shape[0] % num_heads:
        raise ValueError(f"query/key/value shapes {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)} do not split into {num_heads} heads")
    rest = tuple(query.shape[1:])
    per_head = [t.reshape(num_heads, -1, *rest) for t in (query, key, value)]
    return torch.stack(per_head, dim=1).reshape(3 * query.shape[0], *rest)


def qkv_from_megatron(qkv: torch.Tensor,
                      num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's per-head interleaved ``[3h, ...]`` -> separate query, key, value ``[h, ...]``."""
    if qkv.shape[0] % (3 * num_heads):
        raise ValueError(f"query_key_value with {qkv.shape[0]} rows does not split into "
                         f"3 x {num_heads} heads")
    rest = tuple(qkv.shape[1:])
    per_head = qkv.reshape(num_heads, 3, -1, *rest)
    query, key, value = (per_head[:, i].reshape(-1, *rest).contiguous() for i in range(3))
    return query, key, value


def fused_qkv_to_megatron(fused: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Hugging Face's fused ``[q_all | k_all | v_all]`` rows ``[3h, ...]`` -> Megatron's order."""
    query, key, value = fused.chunk(3, dim=0)
    return qkv_to_megatron(query, key, value, num_heads)


def fused_qkv_from_megatron(qkv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Megatron's per-head order ``[3h, ...]`` -> Hugging Face's fused ``[q_all|k_all|v_all]``."""
    return torch.cat(qkv_from_megatron(qkv, num_heads), dim=0)


def conv1d_to_linear(weight: torch.Tensor) -> torch.Tensor:
    """GPT-2 ``Conv1D`` weight ``[in, out]`` -> ``nn.Linear`` weight ``[out, in]``."""
    return weight.t().contiguous()


def linear_to_conv1d(weight: torch.Tensor) -> torch.Tensor:
    """``nn.Linear`` weight ``[out, in]`` -> GPT-2 ``Conv1D`` weight ``[in, out]``."""
    return weight.t().contiguous()


def pad_vocab_rows(tensor: torch.Tensor, padded_size: int) -> torch.Tensor:
    """Append zero rows up to ``padded_size`` (Megatron's ``--make-vocab-size-divisible-by``
    padding; the model masks those ids' logits, so the zeros never take probability mass)."""
    rows = tensor.shape[0]
    if rows > padded_size:
        raise ValueError(f"{rows} vocabulary rows exceed the padded vocabulary {padded_size}")
    if rows == padded_size:
        return tensor
    padding = tensor.new_zeros((padded_size - rows, *tensor.shape[1:]))
    return torch.cat([tensor, padding], dim=0)


def trim_vocab_rows(tensor: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The first ``vocab_size`` rows (drops Megatron's vocabulary padding)."""
    if tensor.shape[0] < vocab_size:
        raise ValueError(f"{tensor.shape[0]} vocabulary rows, fewer than the vocabulary "
                         f"{vocab_size}")
    return tensor[:vocab_size].contiguous()
