"""ParallelLayout: the one owner of world = T x W x D, of what T must divide, of the rank order
and of the groups' members -- and the places that ask it (flags, cost model, model) agree."""

from __future__ import annotations

import itertools

import pytest

from megatron_chimera.config import ConfigError, ModelConfig
from megatron_chimera.layout import ParallelLayout, pad_vocab_size
from megatron_chimera.model.family import GPT2
from megatron_chimera.schedules import build_schedule
from megatron_chimera.training.arguments import parse_args
from megatron_chimera.tuning.analytic_costs import ModelSpec, check_tensor_parallel

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8",
        "--seq-length", "32", "--micro-batch-size", "1", "--lr", "1e-3", "--mock-data",
        "--vocab-size", "100", "--train-iters", "2"]


def test_from_world_derives_the_data_parallel_size():
    layout = ParallelLayout.from_world(16, tensor=2, pipeline=4)
    assert (layout.tensor, layout.data, layout.pipeline, layout.world_size) == (2, 2, 4, 16)
    layout.check_world(16)
    with pytest.raises(ConfigError, match="!= world size 8"):
        layout.check_world(8)


@pytest.mark.parametrize("world,tensor,pipeline", [(12, 2, 4), (8, 3, 1), (8, 1, 0)])
def test_sizes_that_do_not_divide_the_world_name_both_flags(world, tensor, pipeline):
    with pytest.raises(ConfigError, match=r"--tensor-model-parallel-size .* x "
                                          r"--pipeline-model-parallel-size .* does not divide"):
        ParallelLayout.from_world(world, tensor, pipeline)


@pytest.mark.parametrize("sizes,flag", [
    (dict(num_attention_heads=6, hidden_size=48), "--num-attention-heads 6"),
    (dict(num_attention_heads=8, hidden_size=60), "--hidden-size 60"),
    (dict(num_attention_heads=8, hidden_size=64, ffn_hidden_size=90), "--ffn-hidden-size 90"),
])
def test_each_size_t_must_divide_is_named(sizes, flag):
    model = ModelConfig(num_layers=2, seq_length=32, **sizes)
    with pytest.raises(ConfigError, match=f"{flag} is not divisible by "
                                          "--tensor-model-parallel-size 8"):
        ParallelLayout(tensor=8).check_model(model)
    ParallelLayout(tensor=1).check_model(model)  # T = 1 divides everything


def test_query_groups_are_a_size_t_must_divide():
    class WithGroups:  # a config with Megatron's --num-query-groups
        num_attention_heads, num_query_groups, hidden_size, ffn_size = 8, 2, 64, 256
        seq_length, sequence_parallel = 32, False
    with pytest.raises(ConfigError, match="--num-query-groups 2 is not divisible"):
        ParallelLayout(tensor=4).check_model(WithGroups())
    ParallelLayout(tensor=2).check_model(WithGroups())


def test_sequence_parallel_rules():
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, seq_length=30,
                        sequence_parallel=True)
    with pytest.raises(ConfigError, match="--sequence-parallel requires "
                                          "--tensor-model-parallel-size > 1"):
        ParallelLayout(tensor=1).check_model(model)
    with pytest.raises(ConfigError, match="--seq-length 30 is not divisible"):
        ParallelLayout(tensor=4).check_model(model)
    ParallelLayout(tensor=2).check_model(model)


def test_vocabulary_padding():
    assert pad_vocab_size(50257, 128) == 50304
    assert ParallelLayout(tensor=4).padded_vocab_size(50257, 128) == 50688  # multiple of 512
    model = ModelConfig(vocab_size=50257)
    assert model.tensor_parallel_vocab_size(4) == 50688
    assert model.padded_vocab_size == 50304


@pytest.mark.parametrize("T,W,D", [(1, 1, 4), (2, 1, 4), (1, 2, 4), (2, 2, 2), (4, 2, 2)])
def test_every_rank_is_in_one_group_of_each_kind(T, W, D):
    layout = ParallelLayout(T, W, D)
    world = set(range(layout.world_size))
    for rank in world:
        assert layout.global_rank(*layout.coordinates(rank)) == rank
    kinds = {
        "pipeline": [layout.pipeline_ranks(w, t) for w in range(W) for t in range(T)],
        "data": [layout.data_parallel_ranks(p, t) for p in range(D) for t in range(T)],
        "tensor": [layout.tensor_ranks(p, w) for p in range(D) for w in range(W)],
        "model": [layout.model_parallel_ranks(w) for w in range(W)],
    }
    for kind, groups in kinds.items():
        members = list(itertools.chain.from_iterable(groups))
        assert sorted(members) == sorted(world), kind
    assert all(g == list(range(g[0], g[0] + T)) for g in kinds["tensor"])  # innermost


def test_chimera_replica_groups_match_parallel_states_example():
    """The example of parallel_state's docstring: T=2, W=1, Chimera D=4 with 2 pipes."""
    placement = build_schedule("chimera", 4, 4).placement
    layout = ParallelLayout(tensor=2, data=1, pipeline=4)
    assert [layout.stage_replica_ranks(placement, s, 0) for s in range(4)] == \
        [[0, 6], [2, 4], [2, 4], [0, 6]]
    assert layout.stage_replica_ranks(placement, 0, 1) == [1, 7]
    assert layout.embedding_ranks(placement, 1) == [1, 7]
    w2 = ParallelLayout(tensor=1, data=2, pipeline=4)
    assert w2.stage_replica_ranks(placement, 1, 0) == [2, 3, 4, 5]
    assert w2.embedding_ranks(placement, 0) == [0, 1, 6, 7]


def test_the_flags_and_the_cost_model_give_the_layouts_error():
    """Both ask the layout, so a size T does not divide fails the same way in both places."""
    with pytest.raises(ConfigError) as flags:
        parse_args(BASE + ["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "99"],
                   world_size=2)
    config = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=8, seq_length=32,
                         ffn_hidden_size=99)
    with pytest.raises(ConfigError) as tuning:
        check_tensor_parallel(ModelSpec(config, GPT2), 2, False)
    with pytest.raises(ConfigError) as layout:
        ParallelLayout(tensor=2).check_model(config)
    assert str(flags.value) == str(tuning.value) == str(layout.value)


@pytest.mark.parametrize("T,W,D,CP", [(1, 1, 2, 2), (2, 2, 2, 2), (1, 2, 2, 4)])
def test_context_ranks_sit_between_tensor_and_data_ranks(T, W, D, CP):
    """Megatron's order tp-cp-dp-pp: a context group is T apart within one data replica; every
    rank is in one group of each kind; stage replicas span data x context ranks."""
    layout = ParallelLayout(T, W, D, CP)
    world = set(range(layout.world_size))
    assert layout.world_size == T * W * D * CP
    for rank in world:
        p, w, t = layout.coordinates(rank)
        c = layout.context_rank(rank)
        assert layout.global_rank(p, w, t, c) == rank
        assert rank == ((p * W + w) * CP + c) * T + t
    kinds = {
        "pipeline": [layout.pipeline_ranks(w, t, c) for w in range(W) for t in range(T)
                     for c in range(CP)],
        "data": [layout.data_parallel_ranks(p, t, c) for p in range(D) for t in range(T)
                 for c in range(CP)],
        "context": [layout.context_ranks(p, w, t) for p in range(D) for w in range(W)
                    for t in range(T)],
        "tensor": [layout.tensor_ranks(p, w, c) for p in range(D) for w in range(W)
                   for c in range(CP)],
        "model": [layout.model_parallel_ranks(w, c) for w in range(W) for c in range(CP)],
    }
    for kind, groups in kinds.items():
        members = list(itertools.chain.from_iterable(groups))
        assert sorted(members) == sorted(world), kind
    assert all(g == list(range(g[0], g[0] + T * CP, T)) for g in kinds["context"])
    placement = build_schedule("1f1b", D, D).placement
    assert len(layout.stage_replica_ranks(placement, 0, 0)) == W * CP
    assert ParallelLayout.from_world(T * W * D * CP, T, D, CP) == layout


def test_context_parallel_sequence_rules():
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=12)
    with pytest.raises(ConfigError, match="--context-parallel-size"):
        ParallelLayout(context=4).check_model(model)
    ParallelLayout(context=3).check_model(model)
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=12,
                        sequence_parallel=True)
    with pytest.raises(ConfigError, match="--sequence-parallel"):
        ParallelLayout(tensor=4, context=2).check_model(model)  # 12 / 2 = 6 tokens per rank
    ParallelLayout(tensor=2, context=2).check_model(model)
    with pytest.raises(ConfigError, match="--context-parallel-size 3"):
        ParallelLayout.from_world(8, 2, 1, 3)


# ---------------------------------------------------------------- expert parallelism
@pytest.mark.parametrize("tensor,data,pipeline,expert", [
    (1, 2, 4, 2), (1, 4, 2, 2), (1, 4, 2, 4), (2, 2, 2, 2), (2, 4, 2, 4), (1, 8, 1, 8)])
def test_expert_groups_fold_one_pipeline_ranks_ranks(tensor, data, pipeline, expert):
    """Megatron's folding: each pipeline rank's T x W ranks split into EP-sized expert-parallel
    groups (expert rank innermost); every rank is in exactly one, of its own pipeline rank; the
    expert-data groups of a pipeline rank partition it again, one rank per expert group."""
    layout = ParallelLayout(tensor, data, pipeline, expert=expert)
    assert layout.expert_data == tensor * data // expert
    seen = []
    for p in range(pipeline):
        for d in range(layout.expert_data):
            ranks = layout.expert_parallel_ranks(p, d)
            assert len(ranks) == expert
            assert {layout.coordinates(r)[0] for r in ranks} == {p}
            assert [layout.expert_coordinates(r) for r in ranks] == [(e, d) for e in
                                                                     range(expert)]
            seen += ranks
        for e in range(expert):
            replicas = layout.expert_replica_ranks([p], e)
            assert [layout.expert_coordinates(r) for r in replicas] == [
                (e, d) for d in range(layout.expert_data)]
    assert sorted(seen) == list(range(layout.world_size))


def test_chimera_expert_groups_never_join_mirrored_workers():
    """Chimera D=4 x W=2 x EP=2: expert groups [0 1] [2 3] [4 5] [6 7] (one pipeline rank each,
    so workers w and D-1-w never share one); stage 0's experts of expert rank 1 are reduced over
    both pipes' holders [1 7]; the dense stage-replica group is [0 1 6 7]."""
    layout = ParallelLayout(1, 2, 4, expert=2)
    placement = build_schedule("chimera", 4, 4).placement
    assert [layout.expert_parallel_ranks(p, 0) for p in range(4)] == [[0, 1], [2, 3], [4, 5],
                                                                      [6, 7]]
    assert layout.expert_stage_replica_ranks(placement, 0, 1) == [1, 7]
    assert layout.expert_stage_replica_ranks(placement, 1, 0) == [2, 4]
    assert layout.stage_replica_ranks(placement, 0, 0) == [0, 1, 6, 7]


@pytest.mark.parametrize("tensor,data,expert", [(1, 2, 4), (2, 3, 4), (1, 4, 3)])
def test_expert_size_must_divide_a_pipeline_ranks_ranks(tensor, data, expert):
    with pytest.raises(ConfigError, match="--expert-model-parallel-size"):
        ParallelLayout(tensor, data, 2, expert=expert)
    with pytest.raises(ConfigError, match="--num-experts 6"):
        ParallelLayout(1, 4, 1, expert=4).check_experts(6)
