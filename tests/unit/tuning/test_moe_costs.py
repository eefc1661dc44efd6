"""MoE in the performance model: the experts' FLOPs and bytes and the all-to-all bytes against
values written out by hand, EP's share of the expert memory, the overlap of the all-to-alls, the
search's EP sizes and ``tools/autotune.py --predict`` with the MoE flags."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import pytest

from megatron_chimera.config import ConfigError, ModelConfig
from megatron_chimera.config.moe import MoEConfig
from megatron_chimera.model.partition import expert_parameters
from megatron_chimera.schedules.registry import get_spec
from megatron_chimera.tuning.analytic_costs import ModelSpec, StagePiece
from megatron_chimera.tuning.autotune import SearchSpace, enumerate_layouts
from megatron_chimera.tuning.hardware import HardwareProfile, LinkProfile
from megatron_chimera.tuning.moe_costs import (
    all_to_all_bytes,
    all_to_all_seconds,
    expert_parallel_seconds,
    moe_mlp_ops,
    routed_rows,
)
from megatron_chimera.tuning.operators import layer_shapes
from megatron_chimera.tuning.perf_model import PerformanceModel
from megatron_chimera.tuning.training_plan import TrainingPlan

ROOT = Path(__file__).resolve().parents[3]
H, E, K, FE, S, B = 64, 4, 2, 32, 16, 2  # hidden, experts, top-k, expert width, seq, batch


def moe_config(**moe) -> ModelConfig:
    fields = dict(num_experts=E, moe_router_topk=K, moe_ffn_hidden_size=FE,
                  moe_token_dispatcher_type="alltoall")
    fields.update(moe)
    return ModelConfig(num_layers=4, hidden_size=H, num_attention_heads=4, seq_length=S,
                       vocab_size=500, params_dtype="bf16", moe=MoEConfig(**fields))


def test_expert_flops_and_all_to_all_bytes_by_hand():
    cfg = moe_config()
    m = B * S  # 32 tokens on the rank
    assert routed_rows(cfg, m) == m * K  # balanced, dropless: 64 rows
    # one all-to-all: 64 rows x 64 x 2 bytes, half of it to the other EP rank
    assert all_to_all_bytes(cfg, m, 2) == 64 * 64 * 2 / 2
    assert all_to_all_bytes(cfg, m, 4) == 64 * 64 * 2 * 3 / 4
    assert all_to_all_bytes(cfg, m, 1) == 0.0
    # capacity factor 0.5: each expert keeps ceil(32 x 2 / 4 x 0.5) = 8 of a rank's 16 rows
    assert routed_rows(moe_config(moe_expert_capacity_factor=0.5), m) == 4 * 8
    assert routed_rows(moe_config(moe_expert_capacity_factor=1.5), m) == m * K
    shapes = layer_shapes(cfg, B, 1, False)
    for grouped in (False, True):
        c = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, moe_grouped_gemm=grouped))
        for ep in (1, 2, 4):
            forward, backward = moe_mlp_ops(c, shapes, ep, 1)
            experts = sum(g.flops for g in forward.gemms if g.name.startswith("experts"))
            # balanced routing: a rank's E / ep experts take as many rows as it dispatches,
            # m k, each through h -> fe -> h (2 GEMMs, 2 FLOPs a multiply-add), whatever ep
            assert experts == 2 * 2 * (m * K) * H * FE
            router = [g for g in forward.gemms if g.name == "router"]
            assert [g.flops for g in router] == [2 * m * E * H]
            count = sum(g.name.startswith("experts") for g in forward.gemms)
            assert count == (2 if grouped else 2 * E // ep)  # one batched GEMM or a loop
            assert sum(g.flops for g in backward.gemms + backward.weight_gemms) == \
                2 * sum(g.flops for g in forward.gemms)
    forward, _ = moe_mlp_ops(cfg, shapes, 2, 1)
    streams = {s.name: s.nbytes for s in forward.streams}
    assert streams["permute"] == (m + m * K) * H * 2  # read the tokens, write the routed rows
    assert streams["regroup"] == 2 * m * K * H * 2


def test_all_to_all_seconds_on_a_link():
    cfg = moe_config()
    link = LinkProfile(alpha_s=1e-6, bandwidth_gbps=10.0)
    nbytes = 64 * 64 * 2 * 3 / 4
    one = 3 * 3 * 1e-6 + 2 * nbytes / 10e9  # counts, dispatch, combine: 3 messages each
    assert all_to_all_seconds(cfg, 32, 4, link) == pytest.approx(one)
    piece = StagePiece((0, 4), True, True)  # --moe-layer-freq 1: four MoE layers
    assert expert_parallel_seconds(cfg, piece, 32, 4, link) == pytest.approx((4 * one, 0.0))
    gathered = dataclasses.replace(cfg, moe=dataclasses.replace(
        cfg.moe, moe_token_dispatcher_type="allgather"))
    a2a, sync = expert_parallel_seconds(gathered, piece, 32, 4, link)
    assert a2a == 0.0 and sync > 0.0  # synchronous: on the compute's critical path


def _model(link: LinkProfile, **moe) -> PerformanceModel:
    hardware = HardwareProfile("slow-ep", peak_tflops_fp32=10.0, peak_tflops_half=20.0,
                               efficiency=0.5, memory_gb=16.0, gpus_per_node=8,
                               intra_node=link, inter_node=link)
    return PerformanceModel(ModelSpec(moe_config(**moe), "gpt2"), hardware)


def test_expert_parallelism_halves_the_expert_memory():
    model = _model(LinkProfile(1e-6, 100.0))
    cfg = model.spec.config
    one, two = (model.memory(TrainingPlan("1f1b", 2, 2, B, 4, EP=ep)) for ep in (1, 2))
    experts = expert_parameters(cfg, 0, 2, 1)  # stage 0's experts, all of them at EP 1
    assert experts > 0
    width = 2  # bf16 parameters
    assert one[0].param_bytes - two[0].param_bytes == experts // 2 * width
    assert one[0].activation_bytes == two[0].activation_bytes  # balanced: the same rows


def test_overlap_lowers_the_iteration_when_all_to_all_is_like_compute():
    """A link slow enough that a stage's all-to-all is about its forward: Chimera's pairs hide
    it, the unpaired order pays it."""
    model = _model(LinkProfile(0.0, 50.0))
    plain = TrainingPlan("chimera", 4, 2, B, 8, EP=2)
    a2a = model.all_to_all_costs(plain)
    forward = model.stage_times(plain, model.partition(plain)[1]).forward
    assert 0.5 < a2a[1] / forward < 2.0
    paired = dataclasses.replace(plain, options=get_spec("chimera").options_type(
        overlap_moe_expert_parallel_comm=True))
    slow, fast = model.predict(plain), model.predict(paired)
    assert fast.iteration_s < 0.97 * slow.iteration_s  # (6 % with these costs)
    assert max(fast.sim.exposed_all_to_all) < max(slow.sim.exposed_all_to_all)
    dense = model.predict(dataclasses.replace(plain, EP=1))
    assert dense.sim.exposed_all_to_all == [] or max(dense.sim.exposed_all_to_all) == 0.0


def test_expert_parallel_sizes_are_checked():
    model = _model(LinkProfile(1e-6, 100.0))
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 3"):
        model.predict(TrainingPlan("1f1b", 2, 3, B, 4, EP=3))  # 3 does not divide 4 experts
    with pytest.raises(ConfigError, match="does not divide"):
        model.predict(TrainingPlan("1f1b", 2, 2, B, 4, EP=4))  # W = 2 ranks to fold


def test_search_enumerates_the_expert_parallel_sizes():
    space = SearchSpace(8, 16, 4, schedules=("1f1b",), num_experts=4, expert_parallel_sizes=None,
                        distributed_optimizer=(False,), recompute=(False,),
                        partition_methods=("uniform",), pipeline_parallel_sizes=(2,),
                        micro_batch_sizes=(2,))
    assert {p.EP for p in enumerate_layouts(space)} == {1, 2, 4}  # W = 4, 4 experts
    bad = dataclasses.replace(space, expert_parallel_sizes=(3,))
    assert "no expert-parallel size EP" in bad.why_empty()


def _cli():
    spec = importlib.util.spec_from_file_location("autotune_cli", ROOT / "tools" / "autotune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_predict_with_moe_flags_writes_json(tmp_path, capsys):
    cli = _cli()
    out = tmp_path / "p.json"
    base = ["--predict", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads",
            "4", "--seq-length", "16", "--bf16", "--num-experts", "4", "--moe-router-topk", "2",
            "--moe-token-dispatcher-type", "alltoall", "--num-gpus", "8", "--hardware", "h100",
            "--global-batch-size", "16", "--micro-batch-size", "2",
            "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera"]
    assert cli.main(base + ["--expert-model-parallel-size", "2",
                            "--overlap-moe-expert-parallel-comm", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["EP"] == 2 and len(record["all_to_all_s"]) == 2
    assert all(a > 0 for a in record["all_to_all_s"])
    assert math.isfinite(record["exposed_all_to_all_s"])
    assert "all-to-all per micro-batch" in capsys.readouterr().out
    assert cli.main(base + ["--expert-model-parallel-size", "3"]) == 2
    assert "--expert-model-parallel-size 3" in capsys.readouterr().err
