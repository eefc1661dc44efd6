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

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

#: the key of a micro-batch's :class:`TokenMean` (set by the training loop, read by the loss)
TOKEN_MEAN = "token_mean"


class TokenMean(NamedTuple):
    """The per-token loss of one iteration: the global batch's trained tokens and the
    executor's ``units`` (sequences x data-parallel ranks) every micro-batch loss is divided by."""

    global_tokens: torch.Tensor
    units: int

    def divisor(self, sequence_tokens: torch.Tensor) -> torch.Tensor:
        """:func:`loss_divisor` of a micro-batch under this per-token mean."""
        return loss_divisor(sequence_tokens, self.global_tokens, self.units)


def divisor_of(sequence_tokens: torch.Tensor, mean: TokenMean | None) -> torch.Tensor:
    """:func:`loss_divisor`: the sequence's tokens (``mean`` None) or the per-token divisor."""
    return loss_divisor(sequence_tokens) if mean is None else mean.divisor(sequence_tokens)


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
                         group: dist.ProcessGroup | None = None,
                         device: torch.device | str | None = None) -> torch.Tensor:
    """The trained tokens of the global batch: this rank's ``loss_masks`` (its micro-batches of
    the iteration, counted before any backward) summed, moved to ``device`` (NCCL needs a CUDA
    tensor), then one SUM all-reduce over ``group`` (the ranks that read different
    micro-batches; None or uninitialised: this rank alone). A global batch with no trained
    token is refused when the count is on the CPU; on a GPU the check would be a host sync,
    and the loss is NaN instead (``--check-for-nan-in-loss-and-grad`` names it)."""
    total: torch.Tensor | None = None
    for mask in loss_masks:  # summed on the masks' device (NCCL needs CUDA tensors)
        count = mask.detach().to(torch.float64).sum()
        total = count if total is None else total + count
    if total is None:
        total = torch.zeros((), dtype=torch.float64)
    if device is not None:
        total = total.to(device, non_blocking=True)
    if group is not None and dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    if total.device.type == "cpu" and total.item() <= 0:
        raise ValueError("the global batch has no trained token (every loss mask is zero)")
    return total


def add_token_mean(units: Sequence[Any], read: Sequence[Any], group: dist.ProcessGroup | None,
                   device: torch.device | str | None = None) -> TokenMean:
    """Count the global batch's trained tokens from the ``read`` micro-batches (this rank's
    collated dicts, or ``KeyedMicrobatch`` wrappers of them, None where not read) and set the
    :class:`TokenMean` under :data:`TOKEN_MEAN` in every pipeline unit's dict (``units``: one per
    sequence x data-parallel rank share of the executor's division)."""
    masks = [b["loss_mask"] for b in map(_dict_of, read) if b is not None]
    mean = TokenMean(count_trained_tokens(masks, group, device),
                     len(read) * _group_size(group))
    for unit in map(_dict_of, units):
        if unit is not None:
            unit[TOKEN_MEAN] = mean
    return mean


def _dict_of(batch: Any) -> dict | None:
    return getattr(batch, "batch", batch)  # a KeyedMicrobatch's batch, or the dict itself


def _group_size(group: dist.ProcessGroup | None) -> int:
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)
