"""Context parallelism (``--context-parallel-size CP``, ``--cp-comm-type``): each rank of a
context-parallel group holds ``s / CP`` tokens of every sequence (the zigzag split,
:mod:`.zigzag`; of each document for one packed row, :mod:`.documents`) and attention reaches
across the group in one of four ways:

* ``p2p`` -- ring attention (:mod:`.ring`), key/value blocks rotate, results merged by their
  log-sum-exp; the default (Megatron's);
* ``a2a`` -- all-to-all between sequence and heads (:mod:`.gathered`), CP divides the key/value
  heads;
* ``allgather`` -- keys and values all-gathered (:mod:`.gathered`);
* ``a2a+p2p`` -- all-to-all inside groups of adjacent ranks, a ring across the groups
  (:mod:`.hierarchical`, ``--hierarchical-context-parallel-sizes``).

Everything outside attention is per-token and needs no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_chimera.config import CP_COMM_TYPES as COMM_TYPES
from megatron_chimera.errors import ConfigError
from megatron_chimera.model.context_parallel.gathered import (
    all_gather_attention,
    all_to_all_attention,
    masked_attention,
)
from megatron_chimera.model.context_parallel.hierarchical import (
    HierarchicalGroups,
    hierarchical_attention,
)
from megatron_chimera.model.context_parallel.ring import ring_attention
from megatron_chimera.model.context_parallel.stage import (
    context_parallel_size,
    document_split,
    document_tokens,
    sequence_mean_loss,
    split_batch,
    stage_tokens,
)
from megatron_chimera.model.context_parallel.tokens import ContextTokens
from megatron_chimera.model.context_parallel.zigzag import (
    check_sequence,
    merge_sequence,
    split_sequence,
    zigzag_positions,
)

_KERNELS = {"p2p": ring_attention, "a2a": all_to_all_attention,
            "allgather": all_gather_attention, "a2a+p2p": hierarchical_attention}


def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               tokens: ContextTokens,
                               group: dist.ProcessGroup | HierarchicalGroups | None,
                               comm_type: str = "p2p", scale: float | None = None
                               ) -> torch.Tensor:
    """Attention of this rank's queries ``[b, heads, s/CP, d]`` with keys and values
    ``[b, groups, s/CP, d]`` (``groups`` divides ``heads``: grouped-query attention) over the
    whole sequence held by the group; ``scale`` defaults to ``1/sqrt(d)``. ``group``: the
    context group, or for ``a2a+p2p`` this rank's :class:`HierarchicalGroups`."""
    if comm_type not in _KERNELS:
        raise ConfigError(f"--cp-comm-type must be one of {COMM_TYPES}, got {comm_type!r}")
    if scale is None:
        scale = query.shape[-1] ** -0.5
    return _KERNELS[comm_type](query, key, value, tokens, group, scale)


__all__ = ["COMM_TYPES", "ContextTokens", "HierarchicalGroups", "check_sequence",
           "context_parallel_attention", "context_parallel_size", "document_split",
           "document_tokens", "masked_attention", "merge_sequence", "sequence_mean_loss",
           "split_batch", "split_sequence",
           "stage_tokens", "zigzag_positions"]
