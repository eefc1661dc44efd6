"""Variable-length micro-batches in the simulator and the performance model (issue 50): each
micro-batch costs its own work; documents are priced by their squared lengths; ring messages
count where attention cannot hide them; CP chosen per micro-batch; the tuner's mix model reduces
to the plain one for full-length documents."""

from __future__ import annotations

import importlib.util
import math

import pytest

from megatron_chimera.config import ModelConfig
from megatron_chimera.schedules import build_schedule
from megatron_chimera.schedules.simulate import CostModel, simulate
from megatron_chimera.tuning.analytic_costs import ModelSpec, StagePiece
from megatron_chimera.tuning.dynamic_cp import Unit, choose_context_parallel, first_fit
from megatron_chimera.tuning.hardware import LinkProfile, load_hardware
from megatron_chimera.tuning.length_mix import (
    MixPerformanceModel,
    attention_seconds,
    microbatch_stage_times,
    spread_documents,
)
from megatron_chimera.tuning.perf_model import AnalyticCompute, PerformanceModel
from megatron_chimera.tuning.training_plan import TrainingPlan
from tests.helpers import REPO_ROOT

SPEC = ModelSpec(ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4,
                             seq_length=512, vocab_size=500, params_dtype="bf16",
                             masked_softmax_fusion=True), "gpt2")
MIDDLE = StagePiece((0, 2), pre_process=False, post_process=False)


def test_simulator_costs_each_microbatch_by_its_own_work():
    schedule = build_schedule("1f1b", 2, 2)
    base = CostModel(forward_cost=1.0, backward_cost=2.0)
    # rank 0: F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9]; rank 1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]
    assert simulate(schedule, base).makespan == 9.0
    # micro-batch 0 twice as dear, 1 as priced: rank 0 F0 [0,2] F1 [2,3]; rank 1 F0 [2,4]
    # B0 [4,8], F1 [8,9], B1 [9,11]; rank 0 B0 [8,12], B1 [12,14]
    mixed = CostModel(forward_cost=1.0, backward_cost=2.0,
                      microbatch_work=((2.0, 2.0, 2.0), (1.0, 1.0, 1.0)))
    assert simulate(schedule, mixed).makespan == 14.0
    with pytest.raises(ValueError, match="1 entries for 2 micro-batches"):
        simulate(schedule, CostModel(microbatch_work=((1.0, 1.0, 1.0),)))
    # message bytes follow the micro-batch's tokens: p2p = alpha + bytes x tokens x beta = 3;
    # rank 1: F0 [4,5] B0 [5,7] F1 [7,8] B1 [8,10]; rank 0: B0 [10,12] B1 [13,15]
    sized = CostModel(forward_cost=1.0, backward_cost=2.0, activation_bytes=1.0, p2p_beta=1.0,
                      microbatch_work=((1.0, 1.0, 1.0),) * 2, microbatch_tokens=(3.0, 3.0))
    assert simulate(schedule, sized).makespan == 15.0


def test_documents_priced_by_their_squared_lengths():
    hardware = load_hardware("a100")
    compute = AnalyticCompute(SPEC, hardware)
    whole = microbatch_stage_times(compute, MIDDLE, [512])
    assert whole == compute.rank_stage_times(MIDDLE, 1, None)  # one full-length sequence
    packed = microbatch_stage_times(compute, MIDDLE, [128] * 4)
    cfg = SPEC.config
    saved = [2 * attention_seconds(cfg, hardware, 512)[k] * (1 - 4 * 128**2 / 512**2)
             for k in (0, 1)]  # 2 layers, one varlen kernel holding a quarter of the pairs
    assert math.isclose(whole.forward - packed.forward, saved[0], rel_tol=1e-12)
    assert math.isclose(whole.backward - packed.backward, saved[1], rel_tol=1e-12)
    assert packed.weight == whole.weight  # weight gradients follow the tokens only
    free = LinkProfile(alpha_s=0.0, bandwidth_gbps=math.inf)
    slow = LinkProfile(alpha_s=1e-3, bandwidth_gbps=1.0)
    at_cp = microbatch_stage_times(compute, MIDDLE, [128] * 4, 2, free)
    exposed = microbatch_stage_times(compute, MIDDLE, [128] * 4, 2, slow)
    assert at_cp.forward < packed.forward and exposed.forward > at_cp.forward + 2 * 1e-3


def test_context_parallel_chosen_per_microbatch():
    assert choose_context_parallel([100, 90, 80, 70], 2, 200) == Unit(((100, 70), (90, 80)), 1)
    assert choose_context_parallel([300, 50], 2, 200) == Unit(((300, 50),), 2)
    with pytest.raises(ValueError, match="exceeds 2 ranks x 200 tokens"):
        choose_context_parallel([300, 200], 2, 200)
    assert first_fit([5, 4, 3, 2], 7) == [(5, 2), (4, 3)]
    assert spread_documents([5, 4, 3, 2, 1], 2) == [(5, 2, 1), (4, 3)]


def test_mix_model_reduces_to_the_plain_model_for_full_length_documents():
    hardware = load_hardware("a100")
    layout = TrainingPlan("1f1b", D=2, W=1, B=1, N=4)
    plain = PerformanceModel(SPEC, hardware).predict(layout, with_memory=False)
    full = MixPerformanceModel(SPEC, hardware, [512] * 4).predict(layout, with_memory=False)
    assert math.isclose(full.iteration_s, plain.iteration_s, rel_tol=1e-12)
    short = MixPerformanceModel(SPEC, hardware, [64] * 32).predict(layout, with_memory=False)
    assert short.iteration_s < plain.iteration_s  # the same tokens, less attention


def test_autotune_document_lengths_bad_input_is_one_line(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("autotune_cli", REPO_ROOT / "tools" /
                                                  "autotune.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    bad = tmp_path / "lengths.json"
    bad.write_text('{"messages": []}')
    base = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--num-gpus", "4", "--global-batch-size", "16"]
    assert cli.main(base + ["--document-lengths", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--document-lengths" in err[0] and "positive token counts" in err[0]
