"""Selective recomputation skips the attention core where the kernel keeps no [s, s] scores."""

from __future__ import annotations

import torch

from megatron_chimera.config import ModelConfig
from megatron_chimera.model.transformer import CoreAttention


class _Cuda:
    """A stand-in for a CUDA query (the predicate reads ``is_cuda`` only)."""

    is_cuda = True


def test_the_core_is_recomputed_only_where_it_stores_scores():
    fused = CoreAttention(ModelConfig(recompute_granularity="selective"), 1, causal=True)
    unfused = CoreAttention(ModelConfig(recompute_granularity="selective",
                                        masked_softmax_fusion=False), 1, causal=True)
    cpu_query = torch.zeros(1, 2, 4, 8)
    assert fused.stores_no_scores(_Cuda(), None)  # flash / memory-efficient SDPA on CUDA
    assert not fused.stores_no_scores(cpu_query, None)  # the CPU's math kernel keeps them
    assert not fused.stores_no_scores(_Cuda(), torch.ones(4, 4, dtype=torch.bool))  # a mask
    assert not unfused.stores_no_scores(_Cuda(), None)  # matmul + softmax keep the scores
