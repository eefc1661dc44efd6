"""The one place that decides what a micro-batch's masked loss sum is divided by.

Every loss path (plain, context-parallel, sequence slices) divides its masked per-token loss sum
by :func:`loss_divisor`. The executor then divides each micro-batch loss by ``units`` (its
sequences x data-parallel ranks) and the gradients are SUMmed over replicas, so:

* pretraining (``global_tokens`` None): the divisor is the sequence's trained tokens, and the
  gradient is the mean over sequences of each sequence's token mean (Megatron's default);
* per-token loss over the global batch (``global_tokens`` given, Megatron's
  ``--calculate-per-token-loss`` as SFT uses it): the divisor is ``global_tokens / units``, so
  after the executor's division every trained token of the global batch (every micro-batch,
  data-parallel rank and pipe) weighs ``1 / global_tokens`` and the losses do not change with
  the layout or the micro-batch split.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def loss_divisor(sequence_tokens: torch.Tensor, global_tokens: torch.Tensor | None = None,
                 units: int = 1) -> torch.Tensor:
    """The divisor of a micro-batch's masked loss sum: its sequence's trained tokens
    (``sequence_tokens``, all context ranks and slices) or, per token, ``global_tokens / units``."""
    if global_tokens is None:
        return sequence_tokens
    if units < 1:
        raise ValueError(f"units must be positive, got {units}")
    return global_tokens.to(sequence_tokens.dtype) / units


def microbatch_units(num_sequences: int, data_parallel_size: int) -> int:
    """``units``: what the executor divides each micro-batch loss by before its backward (and
    the MoE auxiliary losses' gradient scale): this rank's sequences of the iteration times the
    data-parallel ranks, so the SUM of the gradients over the replicas is the batch mean."""
    if num_sequences < 1 or data_parallel_size < 1:
        raise ValueError(f"sequences ({num_sequences}) and data-parallel ranks "
                         f"({data_parallel_size}) must be positive")
    return num_sequences * data_parallel_size


def count_trained_tokens(loss_masks: Iterable[torch.Tensor],
                         group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The trained tokens of the global batch: this rank's ``loss_masks`` (its micro-batches of
    the iteration, counted before any backward) summed, then one SUM all-reduce over ``group``
    (the ranks that read different micro-batches; None or uninitialised: this rank alone).
    A global batch with no trained token is refused (its mean loss does not exist)."""
    total: torch.Tensor | None = None
    for mask in loss_masks:  # summed on the masks' device (NCCL needs CUDA tensors)
        count = mask.detach().to(torch.float64).sum()
        total = count if total is None else total + count
    if total is None:
        total = torch.zeros((), dtype=torch.float64)
    if group is not None and dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    if total.item() <= 0:
        raise ValueError("the global batch has no trained token (every loss mask is zero)")
    return total
