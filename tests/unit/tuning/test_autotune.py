"""Autotuner: memory filter, the best of a hand-checked space, branch and bound, the CLI."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import shlex

import pytest

from megatron_chimera.config import ConfigError, ModelConfig
from megatron_chimera.model.stage_split import layout_partition
from megatron_chimera.tuning.analytic_costs import ModelSpec, StagePiece
from megatron_chimera.tuning.autotune import JSON_KEYS, SearchSpace, autotune, enumerate_layouts
from megatron_chimera.tuning.command import pretrain_flags
from megatron_chimera.tuning.hardware import PRESETS, HardwareProfile, LinkProfile
from megatron_chimera.tuning.perf_model import PerformanceModel, StageTimes
from megatron_chimera.tuning.training_plan import TrainingPlan
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT
FREE = LinkProfile(alpha_s=0.0, bandwidth_gbps=math.inf)
ZERO_COMM = HardwareProfile("zero-comm", 10.0, 20.0, 0.5, 16.0, 8, FREE, FREE)


class PerLayerCompute:
    """Forward = B x layers of the stage seconds; backward twice that (+1 forward recomputed)."""

    def stage_times(self, piece: StagePiece, micro_batch: int, recompute: bool) -> StageTimes:
        forward = float(micro_batch * piece.num_layers)
        return StageTimes(forward, 2 * forward + (forward if recompute else 0.0), 0.0)


def gpt(num_layers: int = 8) -> ModelSpec:
    return ModelSpec(ModelConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                                 seq_length=32, vocab_size=500), "gpt2")


def hand_space(distributed_optimizer: tuple[bool, ...] = (False,),
               pipeline_sizes: tuple[int, ...] | None = (2, 4)) -> SearchSpace:
    return SearchSpace(num_gpus=4, global_batch_size=8, num_layers=8,
                       schedules=("gpipe", "1f1b", "chimera"), micro_batch_sizes=(2,),
                       recompute=(False,), option_values=(("pipes", (2,)),),
                       partition_methods=("uniform",),
                       distributed_optimizer=distributed_optimizer,
                       pipeline_parallel_sizes=pipeline_sizes)


# Hand-checked iteration times (forward F = B x layers per stage, backward 2F, no communication):
# D=2 (W=2, N=2, F=8):  GPipe / 1F1B (N+D-1) 3F = 72;  Chimera basic unit (5D-4) F = 48
# D=4 (W=1, N=4, F=4):  GPipe / 1F1B (N+D-1) 3F = 84;  Chimera basic unit (5D-4) F = 64
# D=1 (W=4, N=1, F=16): no pipeline, 3F = 48 (one schedule stands for all: the first plain one)
HAND_TIMES = {("gpipe", 2): 72.0, ("1f1b", 2): 72.0, ("chimera", 2): 48.0,
              ("gpipe", 4): 84.0, ("1f1b", 4): 84.0, ("chimera", 4): 64.0,
              ("gpipe", 1): 48.0}


def test_enumeration_of_the_hand_space():
    """Every D dividing the GPUs is tried, D = 1 included (as one schedule: without a pipeline
    they all run the micro-batches in turn)."""
    layouts = list(enumerate_layouts(hand_space(pipeline_sizes=None)))
    assert {(layout.schedule, layout.D, layout.W, layout.B, layout.N) for layout in layouts} == {
        (s, D, 4 // D, 2, 8 // (4 // D * 2)) for s, D in HAND_TIMES}
    pinned = hand_space()  # --pipeline-model-parallel-sizes 2,4
    assert {layout.D for layout in enumerate_layouts(pinned)} == {2, 4}


def test_picks_the_best_of_a_hand_checked_space():
    model = PerformanceModel(gpt(), ZERO_COMM, compute=PerLayerCompute())
    result = autotune(model, hand_space(pipeline_sizes=None), memory_limit_bytes=10**12)
    times = {(p.layout.schedule, p.layout.D): p.iteration_s for p in result.ranked}
    assert times == pytest.approx(HAND_TIMES) and not result.invalid
    assert result.best.iteration_s == pytest.approx(48.0)
    assert result.best.samples_per_s == pytest.approx(8 / 48.0)
    assert [p.samples_per_s for p in result.ranked] == sorted(
        (p.samples_per_s for p in result.ranked), reverse=True)


def test_drops_layouts_over_the_memory_limit():
    """Chimera at D=2 holds the whole model twice per rank: below its peak it must drop out and
    the best fitting layout (Chimera at D=4) win."""
    model = PerformanceModel(gpt(), ZERO_COMM, compute=PerLayerCompute())
    chimera2 = TrainingPlan.of("chimera", 2, 2, 2, 2, pipes=2)
    limit = max(m.total_bytes for m in model.memory(chimera2)) - 1
    others = [layout for layout in enumerate_layouts(hand_space()) if layout != chimera2]
    assert all(max(m.total_bytes for m in model.memory(o)) <= limit for o in others)
    result = autotune(model, hand_space(), memory_limit_bytes=limit)
    assert [layout for layout, _ in result.over_memory] == [chimera2]
    assert all(p.peak_memory_bytes <= limit for p in result.ranked)
    assert (result.best.layout.schedule, result.best.layout.D) == ("chimera", 4)
    assert result.best.iteration_s == pytest.approx(64.0)
    with pytest.raises(ConfigError, match="no layout fits"):
        _ = autotune(model, hand_space(), memory_limit_bytes=1).best


def test_the_distributed_optimizer_lets_chimera_fit_where_its_replicas_did_not():
    """Chimera D=2 over its limit (two stage replicas per rank) fits once its optimizer state is
    sharded over its stage-replica groups, and wins again; where every layout fits, the plain
    layouts rank first (the sharded ones pay an exposed parameter all-gather)."""
    model = PerformanceModel(gpt(), ZERO_COMM, compute=PerLayerCompute())
    chimera2 = TrainingPlan.of("chimera", 2, 2, 2, 2, pipes=2)
    sharded = TrainingPlan.of("chimera", 2, 2, 2, 2, distributed_optimizer=True, pipes=2)
    peak = max(m.total_bytes for m in model.memory(chimera2))
    assert max(m.total_bytes for m in model.memory(sharded)) < peak
    assert "--use-distributed-optimizer" in pretrain_flags(gpt(), sharded)
    space = hand_space(distributed_optimizer=(False, True))
    assert sharded in list(enumerate_layouts(space))
    # 1F1B/GPipe at D=4, W=1 have one-rank stage-replica groups: no sharded variant
    assert TrainingPlan("1f1b", 4, 1, 2, 4, distributed_optimizer=True) not in list(
        enumerate_layouts(space))
    result = autotune(model, space, memory_limit_bytes=peak - 1)
    assert [layout for layout, _ in result.over_memory] == [chimera2]
    assert result.best.layout == sharded and result.best.iteration_s == pytest.approx(48.0)


def test_recomputation_is_tried_only_when_the_plain_layout_does_not_fit():
    model = PerformanceModel(gpt(), ZERO_COMM, compute=PerLayerCompute())
    space = SearchSpace(num_gpus=4, global_batch_size=32, num_layers=8, schedules=("gpipe",),
                        micro_batch_sizes=(4,), recompute=(False, True),
                        partition_methods=("uniform",), distributed_optimizer=(False,),
                        pipeline_parallel_sizes=(2, 4))
    plain = TrainingPlan("gpipe", 2, 2, 4, 4)
    peak_plain = max(m.total_bytes for m in model.memory(plain))
    loose = autotune(model, space, memory_limit_bytes=10**12)
    assert not any(p.layout.recompute for p in loose.ranked) and loose.dominated == 2
    tight = autotune(model, space, memory_limit_bytes=peak_plain - 1)
    recomputing = [p.layout for p in tight.ranked if p.layout.recompute]
    assert TrainingPlan("gpipe", 2, 2, 4, 4, recompute=True) in recomputing


def test_branch_and_bound_keeps_the_exhaustive_top_rows():
    spec = ModelSpec(ModelConfig(num_layers=16, hidden_size=256, num_attention_heads=8,
                                 seq_length=128, vocab_size=1000), "bert")
    space = SearchSpace(num_gpus=8, global_batch_size=64, num_layers=16,
                        schedules=("gpipe", "1f1b", "interleaved", "chimera", "zb-h1"))
    limit = 2 * 2**30
    full = autotune(PerformanceModel(spec, PRESETS["a100"]), space, limit)
    fast = autotune(PerformanceModel(spec, PRESETS["a100"]), space, limit, keep=5)
    assert fast.pruned > 0
    assert [p.iteration_s for p in fast.ranked[:5]] == [p.iteration_s for p in full.ranked[:5]]
    exhaustive = {p.layout: p.iteration_s for p in full.ranked}
    assert all(exhaustive[p.layout] == p.iteration_s for p in fast.ranked)


def _cli():
    spec = importlib.util.spec_from_file_location("autotune_cli", ROOT / "tools" / "autotune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_cli_done_when_command_prints_table_and_command(capsys):
    rc = _cli().main(["--model", "bert", "--num-layers", "48", "--hidden-size", "1024",
                      "--num-attention-heads", "16", "--seq-length", "128", "--num-gpus", "32",
                      "--global-batch-size", "512", "--hardware", "p100", "--top", "5"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "samples/s" in out and "peak mem [GiB]" in out
    assert "torchrun --nnodes 32 --nproc-per-node 1" in out and "pretrain_bert.py" in out
    assert "--pipeline-model-parallel-size" in out and "--global-batch-size 512" in out


def test_cli_json_records(tmp_path, capsys):
    path = tmp_path / "ranked.json"
    rc = _cli().main(["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
                      "--seq-length", "32", "--vocab-size", "500", "--num-gpus", "4",
                      "--global-batch-size", "16", "--hardware", "h100", "--bf16",
                      "--exhaustive", "--json", str(path)])
    assert rc == 0
    records = json.loads(path.read_text())
    assert records and all(tuple(r) == JSON_KEYS for r in records)
    rates = [r["samples_per_s"] for r in records]
    assert rates == sorted(rates, reverse=True)
    # T: every divisor of the 4 heads within the 8-GPU node that divides the 4 GPUs
    assert all(r["T"] * r["D"] * r["W"] == 4 and r["B"] * r["N"] * r["W"] == 16 for r in records)
    assert {r["T"] for r in records} <= {1, 2, 4} and {r["D"] for r in records} >= {1, 2}
    assert "--bf16" in capsys.readouterr().out


def test_cli_stage_costs_feed_chimera_zb_costs(tmp_path, capsys):
    """--stage-costs-json writes the best layout's per-stage F, B, W, p2p; --chimera-zb-costs
    @file reads it as it is, and its figures are the performance model's."""
    from megatron_chimera.schedules.costs import parse_costs

    path = tmp_path / "costs.json"
    rc = _cli().main(["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
                      "--seq-length", "32", "--vocab-size", "500", "--num-gpus", "4",
                      "--global-batch-size", "16", "--hardware", "h100", "--schedules",
                      "chimera-zb", "--stage-costs-json", str(path)])
    assert rc == 0 and f"--chimera-zb-costs @{path}" in capsys.readouterr().out
    costs = parse_costs(f"@{path}")
    record = json.loads(path.read_text())
    assert costs.num_stages == int(record["layout"].split(" D=")[1].split()[0])
    # the end stages carry the embedding and the LM head: heavier than a middle one
    if costs.num_stages > 2:
        assert costs.forward[-1] > costs.forward[1] and costs.backward[-1] > costs.backward[1]
    assert costs.p2p > 0


def test_cli_rejects_bad_input(capsys):
    cli = _cli()
    base = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--num-gpus", "4", "--global-batch-size", "16"]
    assert cli.main(base + ["--hardware", "v100"]) == 2
    assert "--hardware" in capsys.readouterr().err
    assert cli.main(base[:5] + ["6"] + base[6:]) == 2  # 64 hidden not divisible by 6 heads
    assert "--num-attention-heads" in capsys.readouterr().err


@pytest.mark.parametrize("layout", [
    TrainingPlan.of("chimera", 4, 2, 2, 8, True, partition="parameters", pipes=2,
                      concat="direct"),
    TrainingPlan.of("interleaved", 4, 2, 1, 8, virtual_pipeline_size=2),
    TrainingPlan.of("chimera-zb", 4, 2, 1, 8, pipes=4),
    TrainingPlan("1f1b", 4, 1, 4, 2),
    TrainingPlan.of("chimera", 4, 1, 2, 4, T=2, sequence_parallel=True, pipes=2),
    TrainingPlan("1f1b", 2, 2, 2, 4, T=4),
    TrainingPlan.of("chimera", 4, 1, 2, 4, T=2, sequence_parallel=True,
                      distributed_optimizer=True, pipes=2),
    TrainingPlan("1f1b", 1, 4, 1, 2, True, recompute_granularity="selective"),
    TrainingPlan("1f1b", 1, 2, 1, 2, T=2),  # no pipeline: D = 1
])
def test_generated_flags_parse_into_the_same_layout(layout):
    """The command's flags go through the framework's own parser to the chosen layout."""
    from megatron_chimera.training.arguments import parse_args
    from megatron_chimera.tuning.command import pretrain_flags

    spec = ModelSpec(ModelConfig(num_layers=16, hidden_size=64, num_attention_heads=4,
                                 seq_length=32, vocab_size=500), "gpt2")
    argv = pretrain_flags(spec, layout) + ["--mock-data", "--train-iters", "10", "--lr", "1e-4",
                                           "--vocab-size", "500"]
    config = parse_args(argv, world_size=layout.num_gpus)
    parallel = config.parallel
    assert (parallel.pipeline_model_parallel_size, parallel.data_parallel_size,
            parallel.tensor_model_parallel_size) == (layout.D, layout.W, layout.T)
    assert config.model.sequence_parallel == layout.sequence_parallel
    assert parallel.pipeline_schedule == layout.schedule
    assert config.training.micro_batch_size == layout.B
    assert config.training.num_microbatches == layout.N
    # the proposed stages reach the run: a layout string for a balanced split
    from megatron_chimera.model.family import get_family
    from megatron_chimera.model.stage_split import stage_partition
    from megatron_chimera.tuning.analytic_costs import partition_stages

    built = stage_partition(config.training.layer_split, config.training.partition_method,
                            config.model, get_family("gpt2"), layout.num_stages, layout.D)
    assert built == [p.layer_range for p in partition_stages(spec, layout.num_stages,
                                                             layout.partition)]
    assert (config.training.layer_split.pipeline_model_parallel_layout is None) == \
        (layout.partition == "uniform")
    assert config.model.recompute_granularity == layout.recompute_mode
    assert parallel.schedule_options == layout.options
    assert config.ddp.use_distributed_optimizer == layout.distributed_optimizer


# ----------------------------------------------------------------------------- tensor parallelism
def test_tensor_parallel_sizes_are_searched_and_reach_the_command(capsys):
    """With T allowed, the space holds T x W x D = P layouts (sequence parallel), T must divide
    the heads, and the chosen command carries T."""
    space = SearchSpace(num_gpus=8, global_batch_size=16, num_layers=8, schedules=("1f1b",),
                        micro_batch_sizes=(2,), recompute=(False,),
                        partition_methods=("uniform",), tensor_parallel_sizes=(1, 2, 8))
    layouts = list(enumerate_layouts(space))
    assert {(lay.T, lay.D, lay.W) for lay in layouts} == {(1, 1, 8), (1, 2, 4), (1, 4, 2),
                                                          (1, 8, 1), (2, 1, 4), (2, 2, 2),
                                                          (2, 4, 1), (8, 1, 1)}
    assert all(lay.sequence_parallel == (lay.T > 1) for lay in layouts)
    result = autotune(PerformanceModel(gpt(), PRESETS["a100"]), dataclasses.replace(
        space, tensor_parallel_sizes=(1, 2, 8), num_gpus=16), 10**12)
    assert any(lay.T == 8 and "--num-attention-heads 4 is not divisible" in why
               for lay, why in result.invalid)
    rc = _cli().main(["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
                      "--seq-length", "32", "--vocab-size", "500", "--num-gpus", "8",
                      "--global-batch-size", "16", "--hardware", "a100", "--bf16",
                      "--tensor-model-parallel-sizes", "2", "--schedules", "1f1b"])
    assert rc == 0
    command = capsys.readouterr().out.replace(" \\\n    ", " ")
    assert "--tensor-model-parallel-size 2 --sequence-parallel" in command


def test_tensor_parallelism_divides_memory_and_compute_and_adds_collectives():
    """Per rank, T = 2 holds about half the weights and activations; its stage times are half
    the compute (each GEMM priced at its half-width shape) plus the tensor-parallel collectives,
    which vanish on a free link."""
    spec = ModelSpec(ModelConfig(num_layers=8, hidden_size=1024, num_attention_heads=16,
                                 seq_length=512, vocab_size=50257, params_dtype="bf16"), "gpt2")
    one = TrainingPlan("1f1b", 4, 1, 2, 8)
    two = dataclasses.replace(one, T=2, sequence_parallel=True)
    # an ideal device: no GEMM shape effect, no memory-bound time, no kernel gaps
    flat = dataclasses.replace(PRESETS["a100"], num_sms=0, hbm_bandwidth_gbps=0.0,
                               kernel_overhead_s=0.0)
    model = PerformanceModel(spec, flat)
    m1, m2 = (max(m.total_bytes for m in model.memory(lay)) for lay in (one, two))
    assert 0.45 < m2 / m1 < 0.6
    piece = model.partition(one)[1]
    t1, t2 = model.stage_times(one, piece), model.stage_times(two, piece)
    assert t2.weight == pytest.approx(t1.weight / 2)
    assert t2.forward > t1.forward / 2 and t2.backward > t1.backward / 2
    free = PerformanceModel(spec, dataclasses.replace(flat, intra_node=FREE))
    t_free = free.stage_times(two, piece)
    assert t_free.forward == pytest.approx(t1.forward / 2)
    # on the a100 preset the half-width GEMMs (fewer tiles: a part-empty wave) run at no more
    # than the full-width ones' rate per FLOP (the model prices each GEMM's shape)
    sized = PerformanceModel(spec, PRESETS["a100"])
    ratio = sized.stage_times(two, piece).weight / sized.stage_times(one, piece).weight
    assert 0.5 <= ratio < 1.0
    # 2 layers x (2 all-gathers + 2 reduce-scatters of one [s, b, h] bf16 activation) forward
    link = flat.intra_node
    activation = 512 * 2 * 1024 * 2
    one_collective = link.alpha_s + activation / 2 * link.beta_s_per_byte
    assert t2.forward - t1.forward / 2 == pytest.approx(2 * 4 * one_collective)
    # sequence parallelism halves the pipeline messages
    assert model.cost_model(two).activation_bytes == model.cost_model(one).activation_bytes / 2


def test_tensor_parallelism_and_the_distributed_optimizer_combine():
    """Both dimensions are searched together, and per tensor rank the distributed optimizer
    shards that rank's parameters over its stage-replica group (2 pipes x W ranks, whatever T):
    the T = 2 shard's gradient buffers are about half of T = 1's, its optimizer state 1 / (2 W)
    of the unsharded one's, the reduction a reduce-scatter (half)."""
    spec = ModelSpec(ModelConfig(num_layers=8, hidden_size=1024, num_attention_heads=16,
                                 seq_length=512, vocab_size=50257, params_dtype="bf16"), "gpt2")
    model = PerformanceModel(spec, PRESETS["a100"])
    space = SearchSpace(num_gpus=8, global_batch_size=16, num_layers=8, schedules=("chimera",),
                        micro_batch_sizes=(2,), recompute=(False,),
                        option_values=(("pipes", (2,)),), partition_methods=("uniform",),
                        tensor_parallel_sizes=(1, 2))
    layouts = set(enumerate_layouts(space))
    layout = TrainingPlan.of("chimera", 2, 2, 2, 4, T=2, sequence_parallel=True,
                               distributed_optimizer=True, pipes=2, concat="direct")
    plain = dataclasses.replace(layout, distributed_optimizer=False)
    assert layout in layouts and plain in layouts
    one = TrainingPlan.of("chimera", 2, 4, 2, 2, distributed_optimizer=True, pipes=2)
    assert one in layouts
    sharded2, plain2, sharded1 = (model.memory(lay)[0] for lay in (layout, plain, one))
    # the state of a stage is spread over its T x 2 x W holders: 2 x 2 x 2 = 1 x 2 x 4 ranks
    assert sharded2.optimizer_bytes == pytest.approx(sharded1.optimizer_bytes, rel=0.02)
    assert 0.45 < sharded2.grad_bytes / sharded1.grad_bytes < 0.55
    # stage-replica groups: 2 pipes x W = 2 ranks at T = 2 (the tied embedding: 2 x 2 holders)
    assert sharded2.optimizer_bytes < plain2.optimizer_bytes / 2 * 1.01
    assert sharded2.grad_bytes == plain2.grad_bytes
    halves = zip(model.cost_model(layout).grad_bytes, model.cost_model(plain).grad_bytes)
    assert all(a == pytest.approx(b / 2) for a, b in halves)
    flags = " ".join(pretrain_flags(spec, layout))
    assert "--tensor-model-parallel-size 2 --sequence-parallel" in flags
    assert "--use-distributed-optimizer" in flags


def test_layout_strings_are_searched_with_their_stage_count():
    """A --pipeline-model-parallel-layout candidate: costed with its uneven stages, only at the
    stage count it describes, and proposed in the command as the layout string."""
    layout_string = "Et*5|t|t|tL"
    space = dataclasses.replace(hand_space(), partition_methods=("uniform", layout_string))
    layouts = list(enumerate_layouts(space))
    uneven = [lay for lay in layouts if lay.partition == layout_string]
    assert uneven and {lay.D for lay in uneven} == {4}
    model = PerformanceModel(gpt(), ZERO_COMM, compute=PerLayerCompute())
    for lay in uneven:
        even = dataclasses.replace(lay, partition="uniform")
        assert [p.num_layers for p in model.partition(lay)] == [5, 1, 1, 1]
        # per-layer costs: the 5-layer stage alone works N x 3F = 4 x 30 > 84 (the even split)
        assert model.predict(lay).iteration_s > model.predict(even).iteration_s
        flags = pretrain_flags(gpt(), lay)
        assert flags[flags.index("--pipeline-model-parallel-layout") + 1] == layout_string


def test_a_layout_with_empty_chunks_is_priced_but_never_searched():
    """Megatron's layout allows a chunk without transformer layers (the zero-bubble authors'
    embedding-only and head-only chunks): the model prices it, the search (whose answer is a
    run) and training refuse it."""
    empty = "E|t*4|t*4|L"
    with pytest.raises(ConfigError, match="stage 0 holds no transformer layer, which training"):
        dataclasses.replace(hand_space(), partition_methods=("uniform", empty))
    with pytest.raises(ConfigError, match="stage 0 holds no transformer layer"):
        layout_partition(empty, 8, 4)  # training's rule
    model = PerformanceModel(gpt(), ZERO_COMM, compute=PerLayerCompute())
    lay = TrainingPlan.of("interleaved", 2, 1, 1, 2, partition=empty, virtual_pipeline_size=2)
    pieces = model.partition(lay)
    assert [(p.num_layers, p.pre_process, p.post_process) for p in pieces] == [
        (0, True, False), (4, False, False), (4, False, False), (0, False, True)]
    # the empty chunks cost nothing here: F0 -> F1 (rank 1) -> F2 (rank 0) -> F3, as two
    # 4-layer stages (F = 4, B = 8) in turn; 2 micro-batches: (N + D - 1) (F + B) = 36
    assert model.predict(lay, with_memory=False).iteration_s == pytest.approx(36.0)


def test_cli_llama_8b_on_64_gpus_prints_a_command_with_the_architecture_flags(capsys):
    """The issue's done-when: a Llama-8B-shaped preset on 64 GPUs; the command carries the
    decoder flags and goes through the framework's parser to the same model."""
    from megatron_chimera.model.presets import MODEL_PRESETS
    from megatron_chimera.training.arguments import parse_args

    rc = _cli().main(["--preset", "llama3-8b", "--num-gpus", "64", "--global-batch-size", "512",
                      "--hardware", "h100", "--bf16", "--schedules", "1f1b,chimera-zb",
                      "--tensor-model-parallel-sizes", "1,2", "--micro-batch-sizes", "1",
                      "--top", "3"])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.startswith("Llama-style (GQA 8 groups): 32 layers"), out[:80]  # not "GPT-2"
    command = out[out.index("torchrun"):].replace(" \\\n    ", " ").replace(" \\\n", " ")
    for flag in ("--normalization RMSNorm", "--swiglu", "--group-query-attention "
                 "--num-query-groups 8", "--disable-bias-linear", "--position-embedding-type rope",
                 "--rotary-base 500000", "--use-rope-scaling", "--ffn-hidden-size 14336",
                 "--untie-embeddings-and-output-weights", "--hidden-dropout 0.0",
                 "--tokenizer-type HuggingFaceTokenizer --tokenizer-model $TOKENIZER_DIR"):
        assert flag in command, flag
    words = shlex.split(command.split("\n")[0])  # a shell command (a layout string is quoted)
    argv = words[words.index("pretrain_gpt2.py") + 1:words.index("--data-path")]
    config = parse_args([*argv, "--mock-data", "--train-iters", "1", "--lr", "1e-4",
                         "--vocab-size", "128256"], world_size=64)
    want = dataclasses.replace(MODEL_PRESETS["llama3-8b"][1], params_dtype="bf16")
    got = config.model
    assert (got.num_query_groups, got.ffn_size, got.rotary_base, got.normalization) == (
        want.num_query_groups, want.ffn_size, want.rotary_base, want.normalization)
    assert (got.swiglu, got.add_bias_linear, got.use_rope_scaling, got.hidden_dropout) == (
        want.swiglu, want.add_bias_linear, want.use_rope_scaling, want.hidden_dropout)


def test_v_shaped_schedules_are_searched_with_their_chunks_and_weight_copies():
    """ZBV and BitPipe-ZB cut the model into 2D chunks; BitPipe holds two weight copies per rank,
    ZBV one, so under a memory limit between them only ZBV (and the single-copy 1F1B) fit."""
    space = dataclasses.replace(hand_space(), schedules=("1f1b", "zbv", "bitpipe-zb"),
                                option_values=())
    layouts = [layout for layout in enumerate_layouts(space) if layout.D == 2]
    assert {(layout.schedule, layout.num_stages, layout.pipes) for layout in layouts} == {
        ("1f1b", 2, 1), ("zbv", 4, 1), ("bitpipe-zb", 4, 2)}
    model = PerformanceModel(gpt(), ZERO_COMM, compute=PerLayerCompute())
    weights = {layout.schedule: max(m.weight_bytes for m in model.memory(layout))
               for layout in layouts}
    assert weights["bitpipe-zb"] > 1.5 * weights["zbv"]
    two_gpus = dataclasses.replace(space, num_gpus=2)  # the limit from the layouts ranked
    limit = max(max(m.total_bytes for m in model.memory(layout))
                for layout in enumerate_layouts(two_gpus) if layout.schedule != "bitpipe-zb")
    result = autotune(model, two_gpus, memory_limit_bytes=limit)
    assert {p.layout.schedule for p in result.ranked} == {"1f1b", "zbv"}
    assert [layout.schedule for layout, _ in result.over_memory] == ["bitpipe-zb"]


# ------------------------------------------------------------ odd D, D = 1, empty searches
def test_odd_pipeline_sizes_and_no_pipeline_are_searched():
    """6 GPUs, 6 layers: D in {1, 2, 3, 6}; 1F1B runs at every D, Chimera only at even D (at
    D = 1 only the first plain schedule is tried)."""
    space = SearchSpace(num_gpus=6, global_batch_size=12, num_layers=6,
                        schedules=("1f1b", "chimera"), micro_batch_sizes=(1,),
                        recompute=(False,), option_values=(("pipes", (2,)),),
                        partition_methods=("uniform",), distributed_optimizer=(False,))
    assert space.pipeline_sizes() == [1, 2, 3, 6]
    result = autotune(PerformanceModel(gpt(6), ZERO_COMM, compute=PerLayerCompute()), space,
                      memory_limit_bytes=10**12)
    ranked = {(p.layout.schedule, p.layout.D) for p in result.ranked}
    assert {("1f1b", 1), ("1f1b", 2), ("1f1b", 3), ("1f1b", 6)} <= ranked
    assert ("chimera", 2) in ranked and ("chimera", 6) in ranked
    assert {layout.D for layout, _ in result.invalid if layout.schedule == "chimera"} == {3}
    assert {p.layout.schedule for p in result.ranked if p.layout.D == 1} == {"1f1b"}


def test_automatic_tensor_sizes_divide_the_heads_within_a_node():
    space = SearchSpace(num_gpus=48, global_batch_size=48, num_layers=8,
                        tensor_parallel_sizes=None, num_attention_heads=12, gpus_per_node=8)
    assert space.tensor_sizes() == [1, 2, 3, 4, 6]  # 12 heads, <= 8 per node, divides 48
    assert SearchSpace(num_gpus=4, global_batch_size=4, num_layers=2,
                       tensor_parallel_sizes=None).tensor_sizes() == [1]


@pytest.mark.parametrize("changes,message", [
    ({"num_gpus": 6, "tensor_parallel_sizes": (4,)},
     "no tensor-parallel size T: none of [4] divides --num-gpus 6"),
    ({"num_gpus": 7, "num_layers": 2}, "no pipeline size D"),
    ({"global_batch_size": 3, "micro_batch_sizes": (2,)}, "no micro-batch size"),
])
def test_an_empty_search_names_the_constraint_that_emptied_it(changes, message):
    space = dataclasses.replace(hand_space(pipeline_sizes=None), **changes)
    if "num_layers" in changes:  # 7 GPUs, 2 layers: D = 1 is the only divisor <= 2, and the
        space = dataclasses.replace(space, pipeline_parallel_sizes=(7,))  # allowed D is 7
    result = autotune(PerformanceModel(gpt(), ZERO_COMM, compute=PerLayerCompute()), space,
                      memory_limit_bytes=10**12)
    with pytest.raises(ConfigError) as info:
        _ = result.best
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_empty_search_over_memory_names_the_smallest_peak():
    result = autotune(PerformanceModel(gpt(), ZERO_COMM, compute=PerLayerCompute()),
                      hand_space(), memory_limit_bytes=1)
    with pytest.raises(ConfigError, match=r"no layout fits in memory: the smallest peak is "
                                          r"[0-9.]+ GiB per rank \(.*\) over the 0.00 GiB limit"):
        _ = result.best


def test_2520_gpus_at_t8_find_the_paper_layout():
    """The issue's example: 529.6B on 2,520 GPUs at T = 8 has a layout (D = 35, odd)."""
    from megatron_chimera.tuning.published import MEGATRON_TABLE1, run_spec

    run = next(r for r in MEGATRON_TABLE1 if r.params == "529.6B")
    space = SearchSpace(num_gpus=run.gpus, global_batch_size=run.batch, num_layers=run.layers,
                        schedules=("1f1b",), micro_batch_sizes=(1,), recompute=(True,),
                        partition_methods=("uniform",), tensor_parallel_sizes=(8,),
                        distributed_optimizer=(False,), sequence_parallel=False)
    assert 35 in space.pipeline_sizes(8) and space.why_empty() is None
    model = PerformanceModel(run_spec(run), PRESETS["a100"])
    memory = model.memory(TrainingPlan("1f1b", 35, 9, 1, 280, True, T=8))
    assert max(m.total_bytes for m in memory) < 80e9


# ---------------------------------------------------------------------------------- --predict
PREDICT = ["--predict", "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
           "--seq-length", "32", "--vocab-size", "500", "--num-gpus", "8",
           "--global-batch-size", "16", "--hardware", "a100", "--bf16"]


def test_predict_prints_and_writes_one_layout(tmp_path, capsys):
    """--predict prices exactly the layout the training flags give: the same numbers as the
    performance model, Megatron's TFLOP/s formula over that time."""
    from megatron_chimera.tuning.published import megatron_flops

    path = tmp_path / "predict.json"
    rc = _cli().main([*PREDICT, "--tensor-model-parallel-size", "2",
                      "--pipeline-model-parallel-size", "4", "--micro-batch-size", "2",
                      "--pipeline-schedule", "chimera", "--chimera-pipes", "2",
                      "--sequence-parallel", "--recompute-granularity", "selective",
                      "--json", str(path)])
    assert rc == 0
    out = capsys.readouterr().out
    for text in ("iteration:", "TFLOP/s per GPU:", "bubble:", "peak memory per rank:"):
        assert text in out
    record = json.loads(path.read_text())
    layout = TrainingPlan.of("chimera", 4, 1, 2, 8, True, T=2, sequence_parallel=True,
                               recompute_granularity="selective", pipes=2)
    spec = ModelSpec(ModelConfig(num_layers=8, hidden_size=64, num_attention_heads=4,
                                 seq_length=32, vocab_size=500, params_dtype="bf16"), "gpt2")
    expected = PerformanceModel(spec, PRESETS["a100"]).predict(layout)
    assert record["layout"] == layout.describe()
    assert record["iteration_s"] == pytest.approx(expected.iteration_s)
    assert record["peak_memory_bytes"] == expected.peak_memory_bytes
    assert record["tflops_per_gpu"] == pytest.approx(
        megatron_flops(spec.config, 16) / 8 / expected.iteration_s / 1e12)
    assert f"{record['iteration_s']:.4f} s" in out


def test_predict_on_megatrons_runtime_prices_its_blocking_exchanges(capsys):
    """--runtime megatron: the same layout with Megatron-LM's blocking pipeline exchanges
    (schedules/blocking_p2p.py) is slower than on ours, and a schedule Megatron-LM does not run
    is refused in one line."""
    layout = [*PREDICT, "--pipeline-model-parallel-size", "4", "--pipeline-schedule",
              "interleaved", "--num-virtual-stages-per-pipeline-rank", "2"]
    seconds = {}
    for runtime in ("ours", "megatron"):
        assert _cli().main([*layout, "--runtime", runtime]) == 0
        out = capsys.readouterr().out
        seconds[runtime] = float(out.split("iteration:")[1].split()[0])
    assert seconds["megatron"] > seconds["ours"], seconds
    assert _cli().main([*PREDICT, "--pipeline-model-parallel-size", "4", "--pipeline-schedule",
                        "chimera", "--runtime", "megatron"]) == 2
    assert "runtime 'megatron' runs the schedules" in capsys.readouterr().err


@pytest.mark.parametrize("extra,message", [
    (["--pipeline-model-parallel-size", "3"], "--num-gpus 8 is not a multiple"),
    (["--micro-batch-size", "3"], "--global-batch-size 16 is not a multiple"),
    (["--sequence-parallel"], "--sequence-parallel needs"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b",
      "--chimera-pipes", "2"], "--chimera-pipes does not apply"),
    (["--pipeline-model-parallel-size", "1", "--pipeline-schedule", "chimera"],
     "--pipeline-model-parallel-size must be even"),
])
def test_predict_rejects_a_layout_that_cannot_run(capsys, extra, message):
    assert _cli().main([*PREDICT, *extra]) == 2
    assert message in capsys.readouterr().err
