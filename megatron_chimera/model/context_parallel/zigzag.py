"""Which tokens of a sequence each context-parallel rank holds: the zigzag split.

The sequence is cut into ``2 x CP`` equal chunks and rank ``i`` holds chunks ``i`` and
``2 x CP - 1 - i`` (in that order), so under a causal mask every rank has the same attention work
(an early chunk, cheap, with a late one, dear). Every per-token tensor of a micro-batch (tokens,
labels, loss mask, position ids, document ids, the pipeline's ``[s, b, h]`` activations) is split
the same way, so positions and masks follow their tokens.
"""

from __future__ import annotations

import torch

from megatron_chimera.errors import ConfigError


def check_sequence(seq_length: int, context_parallel_size: int) -> int:
    """One chunk's length ``s / (2 x CP)``; ConfigError naming the flags when it does not divide."""
    chunks = 2 * context_parallel_size
    if seq_length % chunks:
        raise ConfigError(f"--seq-length {seq_length} is not divisible by 2 x "
                          f"--context-parallel-size ({chunks}): the zigzag split gives each "
                          f"context-parallel rank two equal chunks")
    return seq_length // chunks


def zigzag_positions(seq_length: int, context_parallel_size: int, rank: int) -> torch.Tensor:
    """The global token indices (int64, ``[s / CP]``, ascending) held by ``rank``."""
    chunk = check_sequence(seq_length, context_parallel_size)
    if context_parallel_size == 1:
        return torch.arange(seq_length)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    late = 2 * context_parallel_size - 1 - rank
    return torch.cat([first, torch.arange(late * chunk, (late + 1) * chunk)])


def split_sequence(tensor: torch.Tensor, dim: int, context_parallel_size: int,
                   rank: int) -> torch.Tensor:
    """``rank``'s zigzag share of ``tensor`` along ``dim`` (the sequence dimension)."""
    if context_parallel_size == 1:
        return tensor
    chunks = tensor.chunk(2 * context_parallel_size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * context_parallel_size - 1 - rank]], dim=dim)


def merge_sequence(shares: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of :func:`split_sequence`: the whole sequence from every rank's share, by rank."""
    cp = len(shares)
    if cp == 1:
        return shares[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, share in enumerate(shares):
        early, late = share.chunk(2, dim=dim)
        chunks[rank], chunks[2 * cp - 1 - rank] = early, late
    return torch.cat(chunks, dim=dim)
