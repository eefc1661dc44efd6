"""Master rectangles of a rank's pieces: any flat range of an n-d shard (a distributed-optimizer
fragment of a 3-d expert weight) and an expert-parallel shard's rows of ``[num_experts, ...]``."""

from __future__ import annotations

import itertools

import torch

from megatron_chimera.checkpoint.chunks import _local_rects, master_chunks, spec_of


def test_every_flat_range_of_an_nd_tensor_is_few_contiguous_rectangles():
    for shape in ((5,), (3, 4), (2, 3, 4), (2, 2, 3, 2)):
        full = torch.arange(torch.Size(shape).numel()).view(shape)
        for lo, hi in itertools.combinations(range(full.numel() + 1), 2):
            rects = _local_rects(shape, lo, hi)
            assert 1 <= len(rects) <= 2 * len(shape) - 1, (shape, lo, hi)
            at = lo
            for (offsets, sizes), start in rects:  # in order, contiguous, the right elements
                box = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                assert start == at and torch.equal(box.reshape(-1),
                                                   torch.arange(at, at + box.numel()))
                at += box.numel()
            assert at == hi


def test_an_expert_parallel_shard_is_rows_of_the_whole_layer():
    weight = torch.nn.Parameter(torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4))
    weight.expert_offset, weight.num_experts = 4, 8  # experts 4, 5 of 8 (EP rank 2 of 4)
    spec = spec_of(weight)
    assert spec.master_shape == (8, 3, 4)
    master = torch.zeros(8, 3, 4)
    flat = weight.detach().reshape(-1)
    for lo, hi in ((0, 24), (5, 19), (0, 13), (13, 24)):  # fragments of a sharded optimizer
        for (offsets, sizes), view in master_chunks(spec, flat[lo:hi], lo, hi):
            master[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = view
    assert torch.equal(master[4:6], weight.detach()) and not master[:4].any()
