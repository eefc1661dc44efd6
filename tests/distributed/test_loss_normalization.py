"""Per-token loss over the global batch on 2 gloo data-parallel ranks: the global trained-token
count (one all-reduce) and the summed gradients equal one process's token mean over every
micro-batch (float64, 1e-12 relative)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_chimera.model.loss_normalization import count_trained_tokens, loss_divisor

from .harness import spawn_world

pytestmark = pytest.mark.distributed

MICRO, SEQ, HIDDEN = 3, 5, 4  # per rank: 3 micro-batches of 5 tokens


def _data(world_size: int):
    gen = torch.Generator().manual_seed(7)
    inputs = torch.randn(world_size, MICRO, SEQ, HIDDEN, generator=gen, dtype=torch.float64)
    masks = (torch.rand(world_size, MICRO, SEQ, generator=gen) > 0.5).to(torch.float64)
    masks[:, :, 0] = 1.0
    masks[1, 0] = 0.0  # a micro-batch with no trained token on rank 1
    return inputs, masks


def _weight():
    return torch.linspace(-1, 1, HIDDEN, dtype=torch.float64).requires_grad_(True)


def run_data_parallel(rank, world_size):
    inputs, masks = _data(world_size)
    weight = _weight()
    tokens = count_trained_tokens(list(masks[rank]), group=dist.group.WORLD)
    assert tokens.item() == masks.sum().item()
    units = MICRO * world_size  # the executor's N x DP division
    for x, mask in zip(inputs[rank], masks[rank]):
        losses = (x @ weight) ** 2
        loss = torch.sum(losses * mask) / loss_divisor(mask.sum(), tokens, units)
        (loss / units).backward()
    grad = weight.grad.clone()
    dist.all_reduce(grad)  # the synchronizer SUMs over replicas
    reference = _weight()
    every = ((inputs.reshape(-1, SEQ, HIDDEN) @ reference) ** 2 * masks.reshape(-1, SEQ)).sum()
    (every / masks.sum()).backward()
    torch.testing.assert_close(grad, reference.grad, rtol=1e-12, atol=0)


def test_per_token_loss_on_two_data_parallel_ranks_equals_one_process():
    spawn_world(run_data_parallel, 2, timeout_s=120)
