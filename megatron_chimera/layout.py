"""Megatron's rank layout as plain arithmetic (torch-free; shared by parallel_state and tuning).

``global rank = pipeline_rank x W + data_parallel_rank``: consecutive ranks are data-parallel
replicas of one pipeline rank, so a node holds replicas before it holds pipeline neighbours.
"""

from __future__ import annotations


def global_rank(pipeline_rank: int, data_parallel_rank: int, data_parallel_size: int) -> int:
    """Global rank of ``pipeline_rank`` in data-parallel replica ``data_parallel_rank``."""
    return pipeline_rank * data_parallel_size + data_parallel_rank


def pipeline_and_data_parallel_rank(rank: int, data_parallel_size: int) -> tuple[int, int]:
    """Inverse of :func:`global_rank`: ``(pipeline_rank, data_parallel_rank)``."""
    return divmod(rank, data_parallel_size)
