"""Performance model: reduces to the simulator and to the paper's Eq. (1); alpha-beta costs."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_chimera.config import ConfigError, ModelConfig
from megatron_chimera.model.gpt2 import GPTModel
from megatron_chimera.schedules import build_schedule
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.simulate import CostModel, simulate
from megatron_chimera.tuning.analytic_costs import ModelSpec, StagePiece, stage_forward_flops
from megatron_chimera.tuning.hardware import PRESETS, HardwareProfile, LinkProfile, load_hardware
from megatron_chimera.tuning.operators import K_FILL, Gemm, gemm_seconds, shape_efficiency
from megatron_chimera.tuning.perf_model import PerformanceModel, StageTimes, chimera_eq1_time
from megatron_chimera.tuning.training_plan import TrainingPlan

FREE = LinkProfile(alpha_s=0.0, bandwidth_gbps=math.inf)
ZERO_COMM = HardwareProfile("zero-comm", peak_tflops_fp32=10.0, peak_tflops_half=20.0,
                            efficiency=0.5, memory_gb=16.0, gpus_per_node=8,
                            intra_node=FREE, inter_node=FREE)


def gpt(num_layers: int = 8, hidden: int = 64, heads: int = 4, seq: int = 32,
        vocab: int = 500) -> ModelSpec:
    return ModelSpec(ModelConfig(num_layers=num_layers, hidden_size=hidden,
                                 num_attention_heads=heads, seq_length=seq, vocab_size=vocab),
                     "gpt2")


class UniformCompute:
    """Every stage takes ``forward`` / ``backward`` seconds per micro-batch."""

    def __init__(self, forward: float, backward: float) -> None:
        self.forward, self.backward = forward, backward

    def stage_times(self, piece: StagePiece, micro_batch: int, recompute: bool) -> StageTimes:
        return StageTimes(self.forward, self.backward, 0.0)


def test_layer_flops_match_the_paper_formula():
    spec = gpt(num_layers=3, hidden=128, heads=8, seq=64, vocab=1000)
    b, s, h = 4, 64, 128
    v = spec.config.padded_vocab_size
    middle = StagePiece((0, 3), pre_process=False, post_process=False)
    last = StagePiece((0, 3), pre_process=False, post_process=True)
    assert sum(stage_forward_flops(spec, middle, b)) == 3 * (24 * b * s * h**2 + 4 * b * s**2 * h)
    head = sum(stage_forward_flops(spec, last, b)) - sum(stage_forward_flops(spec, middle, b))
    assert head == 2 * b * s * h * v


@pytest.mark.parametrize("name,options,N", [
    ("gpipe", {}, 8), ("1f1b", {}, 8), ("chimera", {"pipes": 2}, 4),
    ("chimera", {"pipes": 2, "concat": "direct"}, 8), ("chimera", {"pipes": 4}, 8),
])
def test_zero_communication_model_equals_simulator_on_flop_costs(name, options, N):
    """The prediction is the simulator's makespan under per-stage FLOP times computed by hand."""
    spec = gpt()
    D, B = 4, 2
    layout = TrainingPlan.of(name, D, 1, B, N, **options)
    prediction = PerformanceModel(spec, ZERO_COMM).predict(layout)
    s, h, v = 32, 64, spec.config.padded_vocab_size
    rate = 10e12 * 0.5
    weights, attention = 24 * B * s * h**2, 4 * B * s**2 * h
    forward = [2 * (weights + attention) / rate] * D  # 8 layers over 4 stages
    # the backward: two GEMMs per weight GEMM; the fused attention core recomputes its scores
    # (5 products of s x s x d against the forward's 2)
    backward = [2 * (2 * weights + 2.5 * attention) / rate] * D
    head = 2 * B * s * h * v / rate  # LM head
    forward[-1] += head
    backward[-1] += 2 * head
    expected = simulate(build_schedule(name, D, N, **options),
                        CostModel(forward_cost=forward, backward_cost=backward))
    assert prediction.iteration_s == pytest.approx(expected.makespan, rel=1e-12)
    assert prediction.bubble_ratio == pytest.approx(expected.bubble_ratio, rel=1e-12)


@pytest.mark.parametrize("D", [2, 4, 6, 8, 16])
@pytest.mark.parametrize("forward,backward", [(1.0, 1.0), (1.0, 2.0), (1.0, 3.0), (0.7, 1.3)])
def test_basic_unit_reduces_to_eq1(D, forward, backward):
    """Basic unit (N = D), zero communication, B_t >= F_t: T = F_t N + B_t (N + D - 2)."""
    model = PerformanceModel(gpt(num_layers=16), ZERO_COMM,
                             compute=UniformCompute(forward, backward))
    prediction = model.predict(TrainingPlan.of("chimera", D, 1, 1, D, pipes=2))
    assert prediction.iteration_s == pytest.approx(
        forward * D + backward * (2 * D - 2), rel=1e-12)
    assert prediction.iteration_s == pytest.approx(chimera_eq1_time(forward, backward, D, D))


@pytest.mark.parametrize("D", [4, 8])
def test_basic_unit_with_forward_heavier_than_backward(D):
    """With B_t < F_t the critical path swaps: C_f = N + D - 2, C_b = N (documented)."""
    forward, backward = 2.0, 1.0
    model = PerformanceModel(gpt(num_layers=16), ZERO_COMM,
                             compute=UniformCompute(forward, backward))
    time = model.predict(TrainingPlan.of("chimera", D, 1, 1, D, pipes=2)).iteration_s
    assert time == pytest.approx(forward * (2 * D - 2) + backward * D)
    with pytest.raises(ValueError, match="backward >= forward"):
        chimera_eq1_time(forward, backward, D, D)


def test_rabenseifner_allreduce_on_hand_computed_case():
    """Zero compute: the last backward of stage 1 ends one p2p message after the start (the
    gradient crossing from the other rank), then the two stage all-reduces (r = 2f W replicas)
    run one after the other on each rank's channel: 2 log2(r) alpha + 2 (r-1)/r L beta each."""
    spec = gpt()
    alpha, bandwidth = 2e-6, 5.0
    link = LinkProfile(alpha, bandwidth)
    hw = HardwareProfile("ar", 10.0, 20.0, 0.5, 16.0, 1, link, link)
    model = PerformanceModel(spec, hw, compute=UniformCompute(0.0, 0.0))
    layout = TrainingPlan.of("chimera", 2, 2, 1, 2, pipes=2)  # r = 2 pipes x W=2 = 4
    h, v, seq = 64, spec.config.padded_vocab_size, 32
    per_layer = 12 * h * h + 13 * h
    stage0 = 4 * per_layer + v * h + seq * h
    stage1 = 4 * per_layer + 2 * h + v * h  # final norm + the tied embedding's copy
    beta = 1 / (bandwidth * 1e9)
    r = 4

    def allreduce(params: int) -> float:
        return 2 * math.log2(r) * alpha + 2 * (r - 1) / r * params * 4 * beta

    costs = model.cost_model(layout)
    assert costs.grad_bytes == (stage0 * 4, stage1 * 4)
    p2p = alpha + seq * 1 * h * 4 * beta  # one [s, b, h] fp32 message
    expected = p2p + allreduce(stage1) + allreduce(stage0)
    assert model.predict(layout).iteration_s == pytest.approx(expected, rel=1e-12)


def test_two_level_network_picks_intra_or_inter_node_links():
    """Megatron's rank layout (global = pipeline rank x W + data-parallel rank), 8 GPUs a node."""
    hw = PRESETS["h100"]
    intra, inter = hw.intra_node, hw.inter_node
    model = PerformanceModel(gpt(num_layers=16), hw)
    link = {"intra": (intra.alpha_s, intra.beta_s_per_byte),
            "inter": (inter.alpha_s, inter.beta_s_per_byte)}

    def edges(costs) -> dict:
        return {(a, b): (alpha, beta) for a, b, alpha, beta in costs.p2p_edges}

    one_node = model.cost_model(TrainingPlan("1f1b", 8, 1, 1, 8))
    assert set(edges(one_node).values()) == {link["intra"]} and len(edges(one_node)) == 14
    assert one_node.allreduce_alpha == intra.alpha_s
    # D=8, W=2: pipeline 0 is ranks 0, 2, ..., 14: its hop 3 <-> 4 (global 6 <-> 8) crosses
    # nodes, every other hop stays inside one; each stage's replicas {2s, 2s+1} share a node
    two_nodes = model.cost_model(TrainingPlan("1f1b", 8, 2, 1, 8))
    crossing = {pair for pair, value in edges(two_nodes).items() if value == link["inter"]}
    assert crossing == {(3, 4), (4, 3)}
    assert two_nodes.p2p_time(3, 4) > two_nodes.p2p_time(2, 3) == one_node.p2p_time(2, 3)
    assert two_nodes.allreduce_alpha == intra.alpha_s
    # D=2, W=8: stage replicas are ranks 0..7 (one node); the only hop is 0 -> 8
    wide = model.cost_model(TrainingPlan("1f1b", 2, 8, 1, 2))
    assert edges(wide) == {(0, 1): link["inter"], (1, 0): link["inter"]}
    assert wide.allreduce_alpha == intra.alpha_s
    # Chimera D=2, W=8: stage 0 is held by pipeline ranks 0 (down) and 1 (up): 16 ranks, 2 nodes
    chimera = model.cost_model(TrainingPlan.of("chimera", 2, 8, 1, 2, pipes=2))
    assert chimera.allreduce_alpha == inter.alpha_s


def test_hardware_json_profile_and_errors(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text('{"peak_tflops_fp32": 1, "peak_tflops_half": 2, "efficiency": 0.5, '
                    '"memory_gb": 8, "gpus_per_node": 4, '
                    '"intra_node": {"alpha_s": 1e-6, "bandwidth_gbps": 100}, '
                    '"inter_node": {"alpha_s": 2e-6, "bandwidth_gbps": 10}}')
    hw = load_hardware(str(path))
    assert hw.name == "gpu" and hw.link_for([0, 3]) == hw.intra_node
    assert hw.link_for([3, 4]) == hw.inter_node
    path.write_text('{"peak_tflops_fp32": 1}')
    with pytest.raises(ConfigError, match="--hardware .*missing keys"):
        load_hardware(str(path))
    with pytest.raises(ConfigError, match="neither a preset"):
        load_hardware("v100")


def test_gemm_shape_efficiency_follows_tiles_waves_and_depth():
    """Large GEMMs run at the profile's efficiency; a GEMM filling one partial wave of tiles,
    a short reduction, or a thin (memory-bound) product runs below it."""
    hw = PRESETS["a100"]
    big = Gemm("big", 8192, 8192, 8192)
    assert shape_efficiency(hw, big) == pytest.approx(8192 / (8192 + K_FILL), rel=0.02)
    # 108 SMs: 109 tiles of 256 x 128 take two waves (the library then prefers smaller tiles)
    assert shape_efficiency(hw, Gemm("wave", 256 * 109, 128, 8192)) < 0.95
    assert shape_efficiency(hw, Gemm("short", 8192, 8192, 64)) < 0.4
    thin = Gemm("thin", 2048, 2048, 64, batch=16)  # attention scores, head dim 64
    compute = thin.flops / (hw.achieved_flops("fp16") * shape_efficiency(hw, thin))
    assert gemm_seconds(hw, thin, "fp16") >= compute
    ideal = dataclasses.replace(hw, num_sms=0, hbm_bandwidth_gbps=0.0, kernel_overhead_s=0.0)
    assert gemm_seconds(ideal, thin, "fp16") == pytest.approx(
        thin.flops / ideal.achieved_flops("fp16"))


def test_emulated_compute_prediction_is_the_simulator_with_the_benchmark_costs():
    from megatron_chimera.tuning.emulated_validation import (
        EmulatedCompute,
        emulated_model,
        layout_of_row,
    )

    link = LinkProfile(1e-3, math.inf)
    compute = EmulatedCompute(0.02, 0.04, 0.02)
    for row, options, costs in [
        ({"schedule": "interleaved", "D": 4, "N": 8, "pipes": 1,
          "options": {"virtual_pipeline_size": 2}}, {"virtual_pipeline_size": 2}, (0.01, 0.02, 0)),
        ({"schedule": "zb-h1", "D": 4, "N": 8, "pipes": 1}, {}, (0.02, 0.04, 0.02)),
        ({"schedule": "chimera", "D": 4, "N": 8, "pipes": 2, "concat": "direct"},
         {"pipes": 2, "concat": "direct"}, (0.02, 0.04, 0)),
    ]:
        layout = layout_of_row(row)
        predicted = emulated_model(4, compute, link).predict(layout).iteration_s
        schedule = build_schedule(row["schedule"], 4, 8, **options)
        expected = simulate(schedule, CostModel(
            forward_cost=costs[0], backward_cost=costs[1], weight_cost=costs[2], p2p_alpha=1e-3,
            allreduce_alpha=1e-3, grad_bytes=0.0))
        # grad bytes of the tiny emulated model cost nothing on an infinitely fast link
        assert predicted == pytest.approx(expected.makespan, rel=1e-12)
    # the host's time per action (benchmark_schedules.py --trace) reaches the simulator
    with_host = emulated_model(4, compute, link, action_overhead_s=2e-4).predict(layout)
    assert with_host.iteration_s == pytest.approx(simulate(schedule, CostModel(
        forward_cost=costs[0], backward_cost=costs[1], weight_cost=costs[2], p2p_alpha=1e-3,
        allreduce_alpha=1e-3, grad_bytes=0.0, action_overhead=2e-4)).makespan, rel=1e-12)


@pytest.mark.parametrize("name", ["chimera-zb", "bitpipe-zb", "zbv"])
def test_benchmark_rows_of_split_schedules_compare_without_crashing(name):
    """``costs=unit`` rows are predicted with the order the generator builds for 1,1,1, the
    others with the order built for the emulated costs (what the benchmark ran)."""
    from megatron_chimera.tuning.emulated_validation import EmulatedCompute, compare

    link = LinkProfile(0.0, math.inf)
    compute = EmulatedCompute(0.02, 0.05, 0.01)  # F : B : W = 1 : 2 : 0.5
    rows = [{"schedule": name, "D": 4, "N": 8, "options": {"costs": "unit"}, "measured_s": 1.0},
            {"schedule": name, "D": 4, "N": 8, "options": {}, "measured_s": 1.0},
            {"schedule": name, "D": 4, "N": 8, "options": {"p2p_us": 5000}, "measured_s": 1.0}]
    unit, known, for_messages = compare(rows, compute, link)
    built = build_schedule(name, 4, 8)
    chunk = 4 / built.num_stages  # a V chunk pays half of a rank's costs
    model = CostModel(0.02 * chunk, 0.05 * chunk, 0.01 * chunk)
    assert unit["predicted_s"] == pytest.approx(simulate(built, model).makespan, rel=1e-9)
    for_costs = build_schedule(name, 4, 8, costs=(0.02, 0.04, 0.01))
    assert known["predicted_s"] == pytest.approx(simulate(for_costs, model).makespan, rel=1e-9)
    # p2p_us=T: the order the benchmark built for the known costs and messages of T us
    stages = for_costs.num_stages
    with_messages = build_schedule(name, 4, 8, costs=StageCosts.uniform(
        0.02 * chunk, 0.04 * chunk, 0.01 * chunk, stages, p2p=5e-3))
    assert for_messages["predicted_s"] == pytest.approx(
        simulate(with_messages, model).makespan, rel=1e-9)
    assert for_messages["layout"].endswith("(built for p2p 5000 us)")
    assert "built for" not in known["layout"]


def test_measured_compute_times_the_real_classes():
    from megatron_chimera.tuning.profile import MeasuredCompute

    spec = gpt(num_layers=4, hidden=32, heads=4, seq=16, vocab=300)
    compute = MeasuredCompute(spec, device="cpu", warmup=0, iters=1)
    middle = compute.stage_times(StagePiece((1, 3), False, False), 2, False)
    recompute = compute.stage_times(StagePiece((1, 3), False, False), 2, True)
    assert middle.forward > 0 and middle.backward > 0 and 0 < middle.weight < middle.backward
    assert recompute.backward == pytest.approx(middle.backward + middle.forward)
    one = compute.stage_times(StagePiece((1, 2), False, False), 2, False)
    assert middle.forward == pytest.approx(2 * one.forward)  # layers scale linearly


def test_measured_optimizer_step_is_added_after_the_makespan():
    from megatron_chimera.tuning.profile import MeasuredCompute

    spec = gpt(num_layers=4, hidden=32, heads=4, seq=16, vocab=300)
    compute = MeasuredCompute(spec, device="cpu", warmup=0, iters=1)
    assert compute.optimizer_step_s(2000) == pytest.approx(2 * compute.optimizer_step_s(1000))
    model = PerformanceModel(spec, ZERO_COMM, compute=compute)
    layout = TrainingPlan("1f1b", 2, 1, 2, 4)
    prediction = model.predict(layout)
    params = [p.numel() for p in GPTModel(spec.config, True, False, (0, 2)).parameters()]
    step = compute.optimizer_step_s(sum(params))
    assert prediction.iteration_s - model.simulate(layout).makespan >= step * 0.99


def test_link_busy_time_counts_the_messages_and_the_all_reduce_shares_each_rank_sends():
    """One NIC per GPU carries both the pipeline messages and the gradient all-reduces: by hand,
    GPipe at D = 2, W = 2, N = 4, zero compute -- rank 0 sends N activations and its share
    ``2 (r - 1) / r L_0`` of stage 0's all-reduce (r = W = 2), rank 1 N gradients and its share of
    stage 1's. On a slow link that bound is the iteration: the simulator alone lets the N
    messages fly at once and prices the all-reduces on a separate channel, so it gives less."""
    spec = gpt()
    bandwidth = 0.01  # GB/s: the link dominates
    link = LinkProfile(0.0, bandwidth)
    hw = HardwareProfile("nic", 10.0, 20.0, 0.5, 16.0, 1, link, link)
    model = PerformanceModel(spec, hw, compute=UniformCompute(0.0, 0.0))
    layout = TrainingPlan.of("gpipe", 2, 2, 1, 4)
    beta = 1 / (bandwidth * 1e9)
    message = spec.config.seq_length * spec.config.hidden_size * 4  # one [s, b, h] fp32
    grads = model.cost_model(layout).grad_bytes
    expected = max(4 * message * beta + grads[0] * beta, 4 * message * beta + grads[1] * beta)
    assert model.link_busy_s(layout) == pytest.approx(expected, rel=1e-12)
    assert model.simulate(layout).makespan < expected
    assert model.predict(layout).iteration_s == pytest.approx(expected, rel=1e-12)
    # D = 1 without data parallelism sends nothing
    assert model.link_busy_s(TrainingPlan.of("1f1b", 1, 1, 1, 4)) == 0.0


def test_emulated_rows_with_a_gradient_reduction_are_priced_by_mode():
    """A benchmark row of ``--allreduce-ms R --grad-reduce M`` (W = 2, 1F1B): each stage's
    reduction takes R on the rank's emulated link. ``end`` waits for the compute (the last
    stage's all-reduce over its two replicas: exactly compute + R on rank 0, the last to finish);
    ``stage`` equals it for 1F1B (rank 0 holds the last stage to finish); ``overlap`` hides part
    of it in the last backward; ``none`` and rows without a mode are not charged."""
    from megatron_chimera.tuning.emulated_validation import EmulatedCompute, compare

    link, compute, reduce_s = LinkProfile(0.0, math.inf), EmulatedCompute(0.02, 0.04, 0.0), 0.06
    rows = [{"schedule": "1f1b", "D": 4, "W": 2, "N": 8, "measured_s": 1.0,
             "options": {"grad_reduce": mode}} for mode in ("none", "end", "stage", "overlap")]
    none, end, stage, overlap = (r["predicted_s"] for r in compare(rows, compute, link,
                                                                    reduce_s=reduce_s))
    assert end == pytest.approx(none + reduce_s) and stage == pytest.approx(end)
    assert none < overlap < end
    assert compare(rows[1:2], compute, link)[0]["predicted_s"] == pytest.approx(none)
