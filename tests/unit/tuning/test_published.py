"""The performance model against throughput measured on real clusters (Narayanan et al., SC'21,
Table 1), the FLOP formula it is scored with, and the kernel-level compute model's parts."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from megatron_chimera.config import ConfigError, ModelConfig
from megatron_chimera.errors import UsageError
from megatron_chimera.model import flops
from megatron_chimera.model.family import get_family
from megatron_chimera.tuning.analytic_costs import ModelSpec, StagePiece
from megatron_chimera.tuning.hardware import PRESETS, load_hardware, load_hardware_profile
from megatron_chimera.tuning.perf_model import AnalyticCompute, PerformanceModel
from megatron_chimera.tuning.published import (
    MEGATRON_TABLE1,
    MEGATRON_TABLE2,
    megatron_flops,
    predict_run,
    ranks,
    run_layout,
    spearman,
    summarize,
)
from megatron_chimera.tuning.training_plan import TrainingPlan


@pytest.fixture(scope="module")
def table1():
    return [predict_run(run, PRESETS["a100"]) for run in MEGATRON_TABLE1]


def test_megatron_table1_rows_within_15_percent_mean_10_spearman_08(table1):
    """The issue's done-when: every row within +-15% of the published TFLOP/s per GPU, mean
    error <= 10%, and the sizes in the published order (Spearman >= 0.8)."""
    assert [r.run.params for r in table1] == [run.params for run in MEGATRON_TABLE1]
    for row in table1:
        assert 0.85 <= row.ratio <= 1.15, (row.run.params, row.ratio)
    summary = summarize(table1)
    assert summary.mean_error <= 0.10
    assert summary.spearman >= 0.8
    # the throughput rises with size as published: the largest beats the smallest
    assert table1[-1].predicted_tflops > table1[0].predicted_tflops


def test_out_of_sample_table2_rows_within_15_percent_and_in_order():
    """Table 2's PTD-P rows (175B and 530B at a fixed batch on 1x-4x the GPUs), never used to
    build the model: the same criteria as Table 1 hold -- every row within +-15% (they come out
    1.06-1.12x), mean error <= 10%, Spearman >= 0.8 -- and per-GPU throughput falls as the GPUs
    grow at a fixed batch (fewer micro-batches per pipeline, a larger bubble), as published."""
    rows = [predict_run(run, PRESETS["a100"]) for run in MEGATRON_TABLE2]
    for row in rows:
        assert 0.85 <= row.ratio <= 1.15, (row.run.params, row.run.gpus, row.ratio)
    summary = summarize(rows)
    assert summary.mean_error <= 0.10 and summary.spearman >= 0.8
    for model in ("174.6B", "529.6B"):
        tflops = [r.predicted_tflops for r in rows if r.run.params == model]
        assert tflops == sorted(tflops, reverse=True) and tflops[0] > tflops[-1]


def test_table_rows_use_the_stated_layout():
    """Each row runs on exactly its GPUs with the paper's T and D; D = 1 (no pipeline) and the
    odd D = 35 are expressible; the interleaved schedule where the layers per stage allow it."""
    for run in MEGATRON_TABLE1:
        layout = run_layout(run)
        assert (layout.T, layout.D, layout.num_gpus) == (run.T, run.D, run.gpus)
        assert layout.global_batch_size == run.batch and layout.recompute
    by_name = {run.params: run_layout(run) for run in MEGATRON_TABLE1}
    assert by_name["1.7B"].schedule == "1f1b" and by_name["1.7B"].D == 1
    assert by_name["529.6B"].virtual == 3 and by_name["1008B"].virtual == 2


def test_megatron_flops_is_the_model_flop_count_with_the_head_not_recomputed():
    """Eq. 3 = four passes of every layer (forward, recomputed forward, backward = 2) plus three
    of the LM head (it is not recomputed), from the one FLOP count of model/flops.py."""
    config = ModelConfig(num_layers=6, hidden_size=256, num_attention_heads=4, seq_length=128,
                         vocab_size=1024, make_vocab_size_divisible_by=128)
    batch = 3
    weights, attention = flops.layer_forward_flops(config, batch)
    head = flops.head_forward_flops(config, get_family("gpt2"), batch)
    expected = 4 * config.num_layers * (weights + attention) + 3 * head
    assert megatron_flops(config, batch) == pytest.approx(expected, rel=1e-12)


def test_spearman_with_ties_against_hand_ranks():
    assert ranks([10, 30, 20, 30]) == [1.0, 3.5, 2.0, 3.5]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # hand: ranks (1,2,3,4) vs (1,3.5,2,3.5), both of mean 2.5: covariance 2.25 - 0.5 - 0.25
    # + 1.5 = 3, variances 5 and 4.5
    assert spearman([1, 2, 3, 4], [10, 30, 20, 30]) == pytest.approx(3 / math.sqrt(22.5))


def test_validate_published_tool_prints_and_writes_the_table(tmp_path, capsys, monkeypatch,
                                                             table1):
    import importlib.util

    import megatron_chimera.tuning.published as published

    monkeypatch.setattr(published, "MEGATRON_TABLE1", MEGATRON_TABLE1[:3])  # cheap rows only
    monkeypatch.setattr(published, "MEGATRON_TABLE2", MEGATRON_TABLE2[:2])
    import megatron_chimera.tuning.published_fp8 as published_fp8

    cheap = [r for r in published_fp8.FP8_RUNS if r.model == "llama2-7b"]
    monkeypatch.setattr(published_fp8, "FP8_RUNS", tuple(cheap))  # one cheap FP8 row
    import megatron_chimera.tuning.published_zb as published_zb

    two_nodes = [r for r in published_zb.QI_TABLE4 if (r.params, r.microbatches) == ("14.6B", 48)]
    monkeypatch.setattr(published_zb, "QI_TABLE4", tuple(two_nodes))  # one zero-bubble row

    from tests.helpers import REPO_ROOT

    spec = importlib.util.spec_from_file_location(
        "validate_cli", REPO_ROOT / "tools" / "validate_perf_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = tmp_path / "published.json"
    assert module.main(["--published", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| 7.5B |" in out and "Spearman" in out and "worst row" in out
    record = json.loads(path.read_text())
    assert [r["params"] for r in record["rows"]] == ["1.7B", "3.6B", "7.5B"]
    assert record["rows"][0]["predicted_tflops"] == pytest.approx(table1[0].predicted_tflops)
    assert record["mean_error"] == pytest.approx(summarize(table1[:3]).mean_error)
    # the second table: out-of-sample rows, printed and written under their own key
    assert "Table 2" in out and "| 174.6B |" in out
    assert [r["gpus"] for r in record["out_of_sample"]["rows"]] == [384, 768]
    assert record["out_of_sample"]["rows"][0]["published_tflops"] == 153
    assert "FP8 runs" in out and [r["model"] for r in record["fp8"]] == ["llama2-7b"]
    with pytest.raises(UsageError, match="--published"):
        module.main([])  # neither a benchmark JSON nor --published
    # Table 4 on another cluster profile: a slower cross-node link (16 GPUs on two nodes) slows
    # the blocking exchanges of 1F1B-I, not the zero-bubble runtime's asynchronous ones
    profile = PRESETS["a100-80gb"].to_dict()
    profile.update(name="a100-slow-link", inter_node={"alpha_s": 5e-6, "bandwidth_gbps": 6.25})
    (tmp_path / "slow.json").write_text(json.dumps(profile))
    slow_path = tmp_path / "slow_published.json"
    assert module.main(["--published", "--zb-hardware", str(tmp_path / "slow.json"),
                        "--json", str(slow_path)]) == 0
    default, slow = (json.loads(p.read_text())["zero_bubble"] for p in (path, slow_path))
    assert (default["hardware"], slow["hardware"]) == ("a100-80gb", "a100-slow-link")
    assert "model: --hardware a100-slow-link" in capsys.readouterr().out
    fast_cells, slow_cells = default["rows"][0]["predicted"], slow["rows"][0]["predicted"]
    assert slow_cells["1F1B-I"] < 0.95 * fast_cells["1F1B-I"]
    assert slow_cells["ZB-2p"] == pytest.approx(fast_cells["ZB-2p"], rel=0.01)  # the fill only
    with pytest.raises(UsageError, match="--write-error-cache"):
        module.main(["--published", "--write-error-cache", "--zb-hardware", "a100-40gb"])


# ------------------------------------------------------------------ the compute model's parts
def small() -> ModelSpec:
    return ModelSpec(ModelConfig(num_layers=4, hidden_size=512, num_attention_heads=8,
                                 seq_length=256, vocab_size=1000, params_dtype="bf16",
                                 masked_softmax_fusion=False), "gpt2")


def test_selective_recomputation_costs_less_than_full_and_keeps_less_memory_than_none():
    """Selective recomputation re-runs only the attention core: its backward lies between none
    and full; its activations between full and none; the command says selective."""
    model = PerformanceModel(small(), PRESETS["a100"])
    piece = StagePiece((0, 2), False, False)
    base = TrainingPlan("1f1b", 2, 1, 2, 4)
    none, full, selective = (dataclasses.replace(base, recompute=r, recompute_granularity=g)
                             for r, g in ((False, "full"), (True, "full"),
                                          (True, "selective")))
    times = [model.stage_times(layout, piece).backward for layout in (none, selective, full)]
    assert times[0] < times[1] < times[2]
    memory = [max(m.activation_bytes for m in model.memory(layout))
              for layout in (full, selective, none)]
    assert memory[0] < memory[1] < memory[2]
    assert "selective" in selective.describe()
    with pytest.raises(ConfigError, match="--recompute-granularity"):
        TrainingPlan("1f1b", 2, 1, 2, 4, True, recompute_granularity="block")


def test_memory_bound_kernels_and_the_unfused_attention_cost_bandwidth():
    """Halving the HBM bandwidth slows the unfused attention layer (its [s, s] scores stream
    through memory) more than the fused one, and the optimizer step doubles."""
    spec = small()
    fused = ModelSpec(dataclasses.replace(spec.config, masked_softmax_fusion=True), "gpt2")
    slow = dataclasses.replace(PRESETS["a100"],
                               hbm_bandwidth_gbps=PRESETS["a100"].hbm_bandwidth_gbps / 2)
    piece = StagePiece((0, 1), False, False)

    def slowdown(s: ModelSpec) -> float:
        fast_t = AnalyticCompute(s, PRESETS["a100"]).stage_times(piece, 2, False).forward
        return AnalyticCompute(s, slow).stage_times(piece, 2, False).forward / fast_t

    assert slowdown(spec) > slowdown(fused) >= 1.0
    step = AnalyticCompute(spec, PRESETS["a100"]).optimizer_step_s(1e9)
    assert AnalyticCompute(spec, slow).optimizer_step_s(1e9) == pytest.approx(2 * step)


def test_pipeline_scatter_gather_shrinks_messages_and_adds_a_gather():
    """T > 1 without sequence parallelism: each rank sends 1/T of a message (Megatron's
    scatter/gather) and the receiving stage all-gathers it over the tensor-parallel link."""
    spec = small()
    model = PerformanceModel(spec, PRESETS["a100"])
    one = TrainingPlan("1f1b", 2, 1, 2, 4)
    two = dataclasses.replace(one, T=2)
    assert model.message_bytes(two) == model.message_bytes(one) // 2
    first, last = model.partition(two)
    free = PerformanceModel(spec, dataclasses.replace(
        PRESETS["a100"], intra_node=dataclasses.replace(PRESETS["a100"].intra_node,
                                                        alpha_s=0.0, bandwidth_gbps=math.inf)))
    # the gather lands on the receiving side: the last stage's forward, the first's backward
    assert model.stage_times(two, last).forward > free.stage_times(two, last).forward
    assert model.stage_times(two, first).backward > free.stage_times(two, first).backward


def test_hardware_presets_cite_their_figures_and_round_trip_through_json(tmp_path):
    """Every preset loads back from its JSON form (the schema tools/gpu_check.sh writes);
    the old tokens-per-rank key is rejected with the schema named."""
    for name in PRESETS:
        preset = PRESETS[name]
        assert preset.hbm_bandwidth_gbps > 0 and preset.num_sms > 0
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(preset.to_dict()))
        assert load_hardware_profile(path) == preset
        assert load_hardware(str(path)) == preset
    assert PRESETS["h200"].memory_gb > PRESETS["h100"].memory_gb
    assert PRESETS["a100-40gb"].hbm_bandwidth_gbps < PRESETS["a100"].hbm_bandwidth_gbps
    data = PRESETS["a100"].to_dict() | {"half_efficiency_tokens": 512}
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="unknown keys.*half_efficiency_tokens.*schema"):
        load_hardware_profile(bad)
    with pytest.raises(ConfigError, match="no such profile"):
        load_hardware_profile(tmp_path / "missing.json")
