"""``--cp-comm-type a2a+p2p`` (hierarchical context parallelism) on 4 gloo ranks, CP = 4 as
2 x 2 (all-to-all in adjacent pairs, a ring across them) and as 4 x 1 and 1 x 4: outputs and
dQ/dK/dV of every rank's zigzag share equal whole-sequence attention computed independently
(float64: 1e-12 relative; float32: 2e-6), causal and bidirectional, grouped-query attention,
document masks; and a Llama-style model at CP = 4 with a2a+p2p layers equals one process."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from megatron_chimera import parallel_state
from megatron_chimera.layout import hierarchical_groups
from megatron_chimera.parallel_state import HierarchicalGroups

from .cp_cases import HEADS, check_case
from .harness import spawn_world

pytestmark = pytest.mark.distributed


def _groups(world_size: int, rank: int, sizes: tuple[int, int]) -> HierarchicalGroups:
    """The inner and outer groups of the world as one context group (created on every rank)."""
    inner, outer = hierarchical_groups(list(range(world_size)), sizes)
    mine = []
    for level in (inner, outer):
        made = [(dist.new_group(r) if len(r) > 1 else None, r) for r in level]
        mine.append(next(g for g, r in made if rank in r))
    return HierarchicalGroups(mine[0], mine[1], *sizes)


def run_hierarchical_attention(rank, world_size):
    """Every size split of the world, causal or not, GQA (4 key/value heads: the pairs split
    them) or multi-head, with and without documents; float64 and float32."""
    world = dist.new_group(list(range(world_size)))
    for sizes in ((2, 2), (4, 1), (1, 4)):
        groups = _groups(world_size, rank, sizes)
        for causal, documents in itertools.product((True, False), (False, True)):
            for kv, dtype, tolerance in ((4, torch.float64, 1e-12), (HEADS, torch.float64, 1e-12),
                                         (4, torch.float32, 2e-6)):
                check_case(world, world_size, rank, "a2a+p2p", causal, kv, documents, dtype,
                           tolerance, attention_group=groups)


def run_hierarchical_model(rank, world_size):
    """A Llama-style model (4 key/value groups) at CP = 4 with layers a2a+p2p, p2p, a2a+p2p,
    a2a over 2 x 2 groups made by initialize_model_parallel equals one process (loss 1e-6,
    every gradient summed over the context ranks 1e-5)."""
    from megatron_chimera.model.context_parallel import split_batch
    from megatron_chimera.model.gpt2 import GPTModel
    from tests.helpers.models import small_config

    from .cp_model_cases import LLAMA, _batch, _loss, _relative, check_summed_gradients

    config = small_config(cp_comm_type=("a2a+p2p", "p2p", "a2a+p2p", "a2a"),
                          num_attention_heads=8, **{**LLAMA, "num_query_groups": 4})
    batch = _batch(config.seq_length, documents=True)
    reference = GPTModel(config, seed=11)
    ref_loss, _ = _loss(reference, *batch)
    ref_loss.backward()
    parallel_state.initialize_model_parallel(1, [[0]], 1, context_parallel_size=world_size,
                                             hierarchical_context_parallel_sizes=(2, 2))
    state = parallel_state.get_hierarchical_context_parallel_groups()
    assert (state.inner_size, state.outer_size) == (2, 2)
    model = GPTModel(config, seed=11)
    loss, reported = _loss(model, *split_batch(*batch))
    loss.backward()
    assert _relative(reported, ref_loss.detach()) < 1e-6, (reported, ref_loss)
    check_summed_gradients(model, reference, "a2a+p2p 2x2 model")
    parallel_state.destroy_model_parallel()


def run_all(rank, world_size):
    run_hierarchical_attention(rank, world_size)
    run_hierarchical_model(rank, world_size)


@pytest.mark.timeout(150)
def test_hierarchical_context_parallel_equals_full_attention_and_one_process():
    spawn_world(run_all, 4, timeout_s=140, nccl_semantics=False)


def test_hierarchical_groups_pair_adjacent_ranks():
    """Megatron's order: inner groups are adjacent context ranks, outer groups stride by A."""
    assert hierarchical_groups([10, 11, 12, 13, 14, 15], (2, 3)) == (
        [[10, 11], [12, 13], [14, 15]], [[10, 12, 14], [11, 13, 15]])
    with pytest.raises(ValueError, match="--hierarchical-context-parallel-sizes"):
        hierarchical_groups([0, 1, 2, 3], (3, 2))
