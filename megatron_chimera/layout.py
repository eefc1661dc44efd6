"""Megatron's rank layout as plain arithmetic (torch-free; shared by parallel_state and tuning).

``global rank = (pipeline_rank x W + data_parallel_rank) x T + tensor_rank``: tensor-parallel
ranks are innermost (consecutive ranks, so a node holds a whole tensor-parallel group), then
data-parallel replicas, then pipeline ranks.
"""

from __future__ import annotations


def global_rank(pipeline_rank: int, data_parallel_rank: int, data_parallel_size: int,
                tensor_rank: int = 0, tensor_size: int = 1) -> int:
    """Global rank of ``(pipeline_rank, data_parallel_rank, tensor_rank)``."""
    return (pipeline_rank * data_parallel_size + data_parallel_rank) * tensor_size + tensor_rank


def rank_coordinates(rank: int, data_parallel_size: int,
                     tensor_size: int = 1) -> tuple[int, int, int]:
    """Inverse of :func:`global_rank`: ``(pipeline_rank, data_parallel_rank, tensor_rank)``."""
    replica, tensor_rank = divmod(rank, tensor_size)
    pipeline_rank, data_parallel_rank = divmod(replica, data_parallel_size)
    return pipeline_rank, data_parallel_rank, tensor_rank
