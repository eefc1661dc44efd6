"""--context-parallel-size and --cp-comm-type: the layout they make and every refusal, naming the
flag."""

from __future__ import annotations

import pytest

from megatron_chimera.config import ConfigError
from megatron_chimera.training.arguments import parse_args

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 1 --global-batch-size 8 --lr 1e-3 --train-iters 2 --mock-data "
        "--vocab-size 500 --hidden-dropout 0 --attention-dropout 0").split()


def parse(extra: str, world_size: int):
    return parse_args(BASE + extra.split(), world_size=world_size)


def test_context_ranks_come_out_of_the_data_parallel_size():
    config = parse("--context-parallel-size 2 --tensor-model-parallel-size 2 "
                   "--pipeline-model-parallel-size 2 --cp-comm-type a2a", 16)
    parallel = config.parallel
    assert (parallel.context_parallel_size, parallel.data_parallel_size) == (2, 2)
    assert config.training.num_microbatches == 4  # 8 samples over W=2 replicas, not W x CP
    assert config.model.cp_comm_type == "a2a"
    assert parallel.layout.world_size == 16


def test_cp_comm_type_takes_one_value_or_one_per_layer():
    """Megatron's forms: one value serves every layer; a list gives layer i its i-th entry."""
    one = parse("--context-parallel-size 2 --cp-comm-type allgather", 2).model
    assert one.cp_comm_type == "allgather"
    assert [one.layer_cp_comm_type(n) for n in (1, 4)] == ["allgather"] * 2
    many = parse("--context-parallel-size 2 --cp-comm-type a2a p2p allgather p2p", 2).model
    assert many.cp_comm_type == ("a2a", "p2p", "allgather", "p2p")
    assert [many.layer_cp_comm_type(n) for n in range(1, 5)] == list(many.cp_comm_type)
    assert parse("", 1).model.cp_comm_type == "p2p"
    hierarchical = parse("--context-parallel-size 4 --cp-comm-type a2a+p2p p2p a2a+p2p p2p "
                         "--hierarchical-context-parallel-sizes 2 2", 4)
    assert hierarchical.parallel.hierarchical_context_parallel_sizes == (2, 2)
    assert hierarchical.model.layer_cp_comm_type(3) == "a2a+p2p"


@pytest.mark.parametrize("extra,world,message", [
    ("--context-parallel-size 3", 4, "--context-parallel-size 3"),  # does not divide the world
    ("--context-parallel-size 2 --seq-length 30", 2, "--context-parallel-size"),  # 30 % 4
    ("--context-parallel-size 4 --num-attention-heads 8 --group-query-attention "
     "--num-query-groups 2 --cp-comm-type a2a", 4, "--num-query-groups"),
    ("--context-parallel-size 2 --hidden-dropout 0.1", 2, "--hidden-dropout 0"),
    ("--context-parallel-size 2 --attention-dropout 0.1", 2, "got --attention-dropout 0.1"),
    ("--cp-comm-type ring", 1, "--cp-comm-type"),
    ("--cp-comm-type p2p ring p2p p2p", 1, "--cp-comm-type must be one of"),
    ("--cp-comm-type p2p a2a", 1, "one value or one per layer (--num-layers 4), got 2"),
    ("--context-parallel-size 2 --cp-comm-type a2a+p2p", 2,
     "a2a+p2p needs --hierarchical-context-parallel-sizes"),
    ("--context-parallel-size 2 --cp-comm-type p2p p2p a2a+p2p p2p", 2,
     "needs --hierarchical-context-parallel-sizes"),
    ("--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 "
     "3", 4, "A x B = --context-parallel-size 4, got 2 3"),
    ("--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 "
     "2 1", 4, "takes two sizes"),
    ("--context-parallel-size 4 --hierarchical-context-parallel-sizes 2 2", 4,
     "applies to --cp-comm-type a2a+p2p"),
    ("--context-parallel-size 4 --num-attention-heads 8 --group-query-attention "
     "--num-query-groups 1 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2", 4,
     "--num-query-groups"),
    ("--context-parallel-size 4 --num-attention-heads 8 --group-query-attention "
     "--num-query-groups 2 --cp-comm-type p2p p2p a2a p2p", 4, "--num-query-groups"),
    ("--context-parallel-size 2 --reset-attention-mask --document-attention loop", 2,
     "--document-attention loop"),
    ("--context-parallel-size 0", 1, "--context-parallel-size"),
])
def test_refusals_name_the_flag(extra, world, message, capsys):
    with pytest.raises((ConfigError, SystemExit)) as info:
        parse(extra, world)
    text = str(info.value) if info.type is ConfigError else capsys.readouterr().err
    assert message in text


def test_memory_report_predicts_one_context_rank():
    """Activations and pipeline buffers per rank halve at CP=2 (s/CP tokens); the distributed
    optimizer's state is sharded over data x context ranks."""
    from megatron_chimera.model.family import GPT2
    from megatron_chimera.model.partition import partition_layers
    from megatron_chimera.schedules import build_schedule
    from megatron_chimera.training.memory_report import predicted_memory

    def figures(extra: str, world: int):
        config = parse(extra + " --use-distributed-optimizer --pipeline-model-parallel-size 2",
                       world)
        schedule = build_schedule("1f1b", 2, config.training.num_microbatches)
        return predicted_memory(config, GPT2, schedule, partition_layers(4, 2), "cpu")[0]

    one, two = figures("", 2), figures("--context-parallel-size 2", 4)
    assert two.activations / one.activations == pytest.approx(0.5, rel=0.05)
    assert two.buffers * 2 == one.buffers
    assert two.optimizer < one.optimizer
