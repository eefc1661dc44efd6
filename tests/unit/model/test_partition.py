"""Layer partitioning, analytic parameter counts and memory estimates vs the real modules."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from megatron_chimera.config import ConfigError, ModelConfig
from megatron_chimera.model.bert import BertModel, build_bert_stage
from megatron_chimera.model.family import BERT, GPT2
from megatron_chimera.model.gpt2 import GPTModel, build_gpt_stage
from megatron_chimera.model.memory import (
    bytes_per_parameter,
    estimate_stage_memory,
    layer_activation_bytes,
)
from megatron_chimera.model.partition import (
    balanced_partition,
    count_parameters,
    partition_layers,
    stage_parameters,
)
from megatron_chimera.model.presets import PAPER_CONFIGS
from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.gpipe import gpipe
from megatron_chimera.tuning.analytic_costs import ModelSpec, pieces_of
from megatron_chimera.tuning.rank_memory import rank_memory
from tests.helpers.models import small_config


def small(**overrides) -> ModelConfig:
    return small_config(**{"hidden_size": 64, "seq_length": 32, "vocab_size": 200,
                           "make_vocab_size_divisible_by": 128, "hidden_dropout": 0.1,
                           "attention_dropout": 0.1, **overrides})


def numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ----------------------------------------------------------------------------- parameter counts
def test_paper_gpt2_64_layers_is_1_39_billion_untied():
    config = PAPER_CONFIGS["gpt2-64"]
    h, v = 1280, 50304  # 50257 padded to a multiple of 128
    expected = 64 * (12 * h * h + 13 * h) + 2 * v * h + 632 * h + 2 * h
    assert count_parameters(config, GPT2) == expected
    assert 1.385e9 < expected < 1.395e9


def test_paper_bert_48():
    config = PAPER_CONFIGS["bert-48"]
    h, v = 1024, 30592  # 30522 padded to a multiple of 128
    layers = 48 * (12 * h * h + 13 * h)
    embeddings = v * h + 512 * h + 2 * h
    heads = 2 * h + (h * h + h) + 2 * h + v + (h * h + h) + (2 * h + 2)
    assert count_parameters(config, BERT) == layers + embeddings + heads
    assert (config.num_layers, config.hidden_size, config.num_attention_heads,
            config.seq_length) == (48, 1024, 16, 128)


@pytest.mark.parametrize("family,overrides", [
    (GPT2, {}), (GPT2, {"untie_embeddings_and_output_weights": True}),
    (GPT2, {"ffn_hidden_size": 96}), (BERT, {}), (BERT, {"bert_binary_head": False}),
])
def test_counts_match_real_models(family, overrides):
    config = small(**overrides)
    build_whole = GPTModel if family is GPT2 else BertModel
    assert count_parameters(config, family) == numel(build_whole(config))
    partition = [(0, 1), (1, 3), (3, 4)]
    build = build_gpt_stage if family is GPT2 else build_bert_stage
    real = [numel(build(config, partition, s)) for s in range(3)]
    assert stage_parameters(config, family, partition) == real


# ----------------------------------------------------------------------------- partitioning
def test_uniform_partition():
    assert partition_layers(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert partition_layers(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    with pytest.raises(ConfigError, match="--num-layers"):
        partition_layers(3, 4)
    with pytest.raises(ConfigError, match="method"):
        partition_layers(8, 4, "random")


def brute_force_best(costs, stages, first, last):
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        loads = [sum(costs[bounds[i]:bounds[i + 1]]) for i in range(stages)]
        loads[0] += first
        loads[-1] += last
        best = max(loads) if best is None else min(best, max(loads))
    return best


@pytest.mark.parametrize("seed", range(5))
def test_balanced_partition_is_optimal(seed):
    g = torch.Generator().manual_seed(seed)
    costs = (torch.rand(9, generator=g) * 10).tolist()
    first, last = float(torch.rand(1, generator=g) * 15), float(torch.rand(1, generator=g) * 15)
    parts = balanced_partition(costs, 4, first, last)
    assert parts[0][0] == 0 and parts[-1][1] == 9
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(parts, parts[1:]))
    loads = [sum(costs[s:e]) for s, e in parts]
    loads[0] += first
    loads[-1] += last
    assert max(loads) == pytest.approx(brute_force_best(costs, 4, first, last))


def test_parameter_and_time_balancing_account_for_embedding_and_head():
    config = PAPER_CONFIGS["gpt2-64"]
    parts = partition_layers(64, 8, "parameters", config=config)
    sizes = [e - s for s, e in parts]
    assert sum(sizes) == 64 and sizes[0] < sizes[3] and sizes[-1] < sizes[3]
    counts = stage_parameters(config, GPT2, parts)
    uniform = stage_parameters(config, GPT2, partition_layers(64, 8))
    assert max(counts) < max(uniform)
    timed = partition_layers(6, 3, "time", layer_times=[1, 1, 1, 1, 1, 1], embedding_time=2.0,
                             head_time=0.0)
    assert timed == [(0, 1), (1, 3), (3, 6)]
    with pytest.raises(ValueError, match="one measured time per layer"):
        partition_layers(6, 3, "time", layer_times=[1.0])


def _rank_stages(d: int, pipes: int) -> list[list[int]]:
    from megatron_chimera.schedules.chimera import chimera_placement

    held: list[list[int]] = [[] for _ in range(d)]
    for ranks in chimera_placement(d, pipes):
        for stage, rank in enumerate(ranks):
            held[rank].append(stage)
    return held


def _objective(bounds, costs, held, first, last):
    """(busiest rank, largest stage) of a split given by its cut points."""
    stage = [sum(costs[bounds[s]:bounds[s + 1]]) for s in range(len(bounds) - 1)]
    stage[0] += first
    stage[-1] += last
    return max(sum(stage[s] for s in ranks) for ranks in held), max(stage)


@pytest.mark.parametrize("d,pipes", [(2, 2), (4, 2), (4, 4), (6, 2), (8, 2), (8, 4)])
def test_time_partition_over_ranks_is_exact_for_equal_layers(d, pipes):
    """Balancing the ranks' replicas (both Chimera stages of a rank together), then the largest
    stage: the water-filling split equals exhaustive search over every split."""
    held = _rank_stages(d, pipes)
    for layers in range(d, d + 6):
        for first, last in ((0.0, 0.0), (0.5, 1.5), (2.0, 0.3), (3.2, 0.0)):
            costs = [1.0] * layers
            got = partition_layers(layers, d, "time", layer_times=costs, embedding_time=first,
                                   head_time=last, rank_stages=held)
            bounds = [0] + [end for _, end in got]
            best = min(_objective([0, *cuts, layers], costs, held, first, last)
                       for cuts in itertools.combinations(range(1, layers), d - 1))
            assert _objective(bounds, costs, held, first, last) == best, (layers, first, last)


def test_time_partition_over_ranks_beats_per_stage_balance_for_chimera():
    """D=4, 2 pipes (ranks 0 and 3 hold stages 0 and 3, ranks 1 and 2 stages 1 and 2), 5
    layers, the embedding as heavy as a layer: balancing stages gives [1, 1, 1, 2] (largest
    stage 2, but ranks 0 and 3 then run 1 + 1 + 2 = 4); balancing ranks gives [1, 2, 1, 1]
    (largest stage still 2, every rank 3)."""
    held = _rank_stages(4, 2)
    costs = [1.0] * 5
    per_stage = partition_layers(5, 4, "time", layer_times=costs, embedding_time=1.0)
    per_rank = partition_layers(5, 4, "time", layer_times=costs, embedding_time=1.0,
                                rank_stages=held)
    assert [e - s for s, e in per_stage] == [1, 1, 1, 2]
    assert [e - s for s, e in per_rank] == [1, 2, 1, 1]
    assert _objective([0, 1, 2, 3, 5], costs, held, 1.0, 0.0) == (4.0, 2.0)
    assert _objective([0, 1, 3, 4, 5], costs, held, 1.0, 0.0) == (3.0, 2.0)


def test_time_partition_with_unequal_layers_never_worse_than_its_start():
    held = _rank_stages(4, 2)
    costs = [1.0, 3.0, 1.0, 1.0, 2.0, 1.0, 1.0, 4.0, 1.0, 1.0]
    got = partition_layers(10, 4, "time", layer_times=costs, embedding_time=1.0,
                           head_time=2.0, rank_stages=held)
    uniform = partition_layers(10, 4)
    value = _objective([0] + [e for _, e in got], costs, held, 1.0, 2.0)
    assert value <= _objective([0] + [e for _, e in uniform], costs, held, 1.0, 2.0)
    best = min(_objective([0, *cuts, 10], costs, held, 1.0, 2.0)
               for cuts in itertools.combinations(range(1, 10), 3))
    assert value[0] <= best[0] * 1.25  # a local search: close to, not always at, the optimum
    with pytest.raises(ValueError, match="do not partition"):
        partition_layers(10, 4, "time", layer_times=costs, rank_stages=[[0, 1], [1, 2]])


# ----------------------------------------------------------------------------- memory
def test_bytes_per_parameter_table():
    assert bytes_per_parameter("fp32") == {"param": 4, "grad": 4, "optimizer": 8, "main_grad": 0}
    # bf16 always accumulates in fp32 buffers, which are the fp32 main grads (no copy)
    assert bytes_per_parameter("bf16") == {"param": 2, "grad": 4, "optimizer": 12, "main_grad": 0}
    assert bytes_per_parameter("fp16") == {"param": 2, "grad": 2, "optimizer": 12, "main_grad": 4}
    assert bytes_per_parameter("fp16", grad_reduce_in_fp32=True)["grad"] == 4
    assert bytes_per_parameter("fp16", "sgd")["optimizer"] == 8
    assert bytes_per_parameter("fp32", "sgd", sgd_momentum=0.0)["optimizer"] == 0


def test_korthikanti_formula_for_16_bit():
    config = small(params_dtype="bf16", masked_softmax_fusion=False)
    s, b, h, a = 32, 2, 64, 4
    assert layer_activation_bytes(config, b) == s * b * h * (34 + 5 * a * s / h)
    assert layer_activation_bytes(config, b, "selective") == 34 * s * b * h
    assert layer_activation_bytes(config, b, "full") == 2 * s * b * h
    fp32 = small(masked_softmax_fusion=False)
    assert layer_activation_bytes(fp32, b) == s * b * h * (66 + 9 * a * s / h)


def run_stage(module, family, first: bool):
    """One forward of a two-stage slice on a fixed micro-batch of 2 x 32 tokens."""
    tokens = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(0))
    if family is GPT2:
        if first:
            return module(tokens, torch.arange(32).expand(2, 32))
        return module(None, None, labels=tokens)
    padding, types = torch.ones(2, 32), torch.zeros(2, 32, dtype=torch.long)
    return module(tokens, padding, types) if first else module(None, padding, None, tokens)


def measured_activation_bytes(model, run) -> int:
    """Bytes of the distinct non-parameter storages autograd saves for backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(saved.values())


@pytest.mark.parametrize("family", [GPT2, BERT], ids=["gpt2", "bert"])
@pytest.mark.parametrize("overrides", [
    dict(masked_softmax_fusion=False), dict(masked_softmax_fusion=False, params_dtype="bf16"),
    dict(masked_softmax_fusion=False, attention_dropout=0.0),
    # fused attention: the CPU flash kernel is used without attention dropout
    dict(masked_softmax_fusion=True, attention_dropout=0.0, params_dtype="bf16"),
])
def test_estimates_match_measured_bytes(family, overrides):
    config = small(**overrides)
    partition = [(0, 2), (2, 4)]
    estimates = estimate_stage_memory(config, family, partition, micro_batch_size=2,
                                      device_type="cpu")
    build = build_gpt_stage if family is GPT2 else build_bert_stage
    width = config.torch_dtype.itemsize
    for stage in (0, 1):
        module = build(config, partition, stage)
        estimate = estimates[stage]
        assert estimate.param_bytes == sum(p.numel() * width for p in module.parameters())
        module.set_input_tensor(torch.randn(32, 2, 64, dtype=config.torch_dtype))
        run = functools.partial(run_stage, module, family, stage == 0)
        measured = measured_activation_bytes(module, run)
        assert abs(estimate.activation_bytes / measured - 1) < 0.10, (stage, measured)


def test_recompute_estimates():
    config = small(num_layers=8, params_dtype="bf16", recompute_granularity="full",
                   recompute_method="uniform", recompute_num_layers=2)
    (stage,) = estimate_stage_memory(config, GPT2, [(0, 8)], 2)
    full, layer_input = layer_activation_bytes(config, 2), layer_activation_bytes(config, 2, "full")
    head_and_embedding = stage.activation_bytes - 8 * full
    assert stage.activation_bytes_recompute == 4 * layer_input + head_and_embedding
    assert stage.recompute_working_bytes == 2 * full
    block = small(num_layers=8, recompute_granularity="full", recompute_method="block",
                  recompute_num_layers=3)
    (stage,) = estimate_stage_memory(block, GPT2, [(0, 8)], 2)
    full, layer_input = layer_activation_bytes(block, 2), layer_activation_bytes(block, 2, "full")
    assert stage.activation_bytes_recompute == \
        3 * layer_input + 5 * full + stage.activation_bytes - 8 * full


def test_rank_memory_for_schedules():
    """The one per-rank model (tuning.rank_memory): a weight copy per stage held, activations of the
    in-flight micro-batches of each stage, walked from the schedule."""
    config = small(num_layers=4)
    partition = partition_layers(4, 2)
    stages = estimate_stage_memory(config, GPT2, partition, micro_batch_size=2)
    spec = ModelSpec(config, GPT2)
    r0 = rank_memory(spec, gpipe(2, 4), pieces_of(partition), 2, recompute=False)[0]
    assert r0.stages == (0,)
    assert r0.weight_bytes == stages[0].weight_bytes
    assert r0.activation_bytes == 4 * stages[0].activation_bytes  # GPipe holds all N = 4
    assert r0.total_bytes == r0.weight_bytes + r0.activation_bytes
    # Chimera-style placement: rank 0 holds stage 0 (down pipe) and stage 1 (up pipe); its list
    # keeps two stage-0 and one stage-1 activations alive at once
    F, B = "F", "B"
    from megatron_chimera.schedules.actions import Action

    actions = [[Action(F, 0, 0, 0), Action(F, 0, 0, 1), Action(F, 1, 1, 2), Action(B, 1, 1, 2),
                Action(B, 0, 0, 0), Action(B, 0, 0, 1), Action(F, 1, 1, 3), Action(B, 1, 1, 3)],
               []]
    chimera_like = Schedule(name="bidirectional", num_ranks=2, num_stages=2, num_pipes=2,
                            num_microbatches=4, placement=[[0, 1], [1, 0]], actions=actions)
    r0 = rank_memory(spec, chimera_like, pieces_of(partition), 2, recompute=False)[0]
    assert r0.stages == (0, 1)
    # both stages hold the tied embedding, but the two copies share one storage, one gradient
    # buffer and one optimizer state (fp32: 4 + 4 + 8 bytes per element)
    tied = stages[1].tied_parameters
    assert tied == stages[0].tied_parameters > 0
    assert r0.weight_bytes == stages[0].weight_bytes + stages[1].weight_bytes - tied * 16
    assert r0.activation_bytes == 2 * stages[0].activation_bytes + stages[1].activation_bytes
