"""Cross-entropy over vocabulary-parallel logits: the full ``[.., V]`` logits never exist on one
rank (Megatron-core's ``vocab_parallel_cross_entropy``).

Each rank holds the logits of its vocabulary range ``[.., V/T]``. The loss needs three reductions
over the tensor-parallel group, each of a ``[..]`` tensor: the maximum logit (MAX), the target's
logit (SUM; only the rank holding the target contributes) and the sum of exponentials (SUM). The
gradient is ``softmax - one_hot(target)`` restricted to this rank's range, computed locally.
Logits of padded vocabulary entries may be ``-inf`` (they get probability and gradient 0).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_chimera import parallel_state
from megatron_chimera.tensor_parallel.utils import VocabUtility


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp) -> None:
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(tensor, op=op, group=parallel_state.get_tensor_model_parallel_group())


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target):  # type: ignore[override]
        logits = vocab_parallel_logits.float()
        logits_max = logits.max(dim=-1).values
        _all_reduce(logits_max, dist.ReduceOp.MAX)
        logits = logits - logits_max.unsqueeze(-1)
        partition_vocab = logits.shape[-1]
        first, last = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab, parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())
        target_mask = (target < first) | (target >= last)
        masked_target = (target - first).masked_fill(target_mask, 0)
        logits_2d = logits.view(-1, partition_vocab)
        masked_target_1d = masked_target.reshape(-1)
        rows = torch.arange(logits_2d.shape[0], device=logits_2d.device)
        predicted = logits_2d[rows, masked_target_1d].clone().view_as(target)
        predicted.masked_fill_(target_mask, 0.0)
        _all_reduce(predicted, dist.ReduceOp.SUM)
        exp_logits = torch.exp(logits)
        sum_exp = exp_logits.sum(dim=-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM)
        loss = torch.log(sum_exp) - predicted
        exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.input_dtype = vocab_parallel_logits.dtype
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_input = softmax.clone()
        grad_2d = grad_input.view(-1, grad_input.shape[-1])
        rows = torch.arange(grad_2d.shape[0], device=grad_2d.device)
        grad_2d[rows, masked_target_1d] -= 1.0 - target_mask.reshape(-1).float()
        grad_input.mul_(grad_output.unsqueeze(-1))
        return grad_input.to(ctx.input_dtype), None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor,
                                 target: torch.Tensor) -> torch.Tensor:
    """Per-token fp32 cross-entropy ``[..]`` of logits ``[.., V/T]`` (this rank's vocabulary
    range) against ``target`` ``[..]`` (global token ids); same value on every rank."""
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(f"target shape {tuple(target.shape)} != logits' "
                         f"{tuple(vocab_parallel_logits.shape[:-1])}")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target)
