"""tools/benchmark_schedules.py (millisecond emulated stages) and tools/benchmark_overhead.py
(zero-cost stages) end to end on 4 ranks."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from megatron_chimera.schedules import build_schedule
from tests.helpers import REPO_ROOT

from .harness import spawn_world

pytestmark = pytest.mark.distributed
TOOL = REPO_ROOT / "tools" / "benchmark_schedules.py"


OVERHEAD_TOOL = TOOL.parent / "benchmark_overhead.py"


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _run_tool(rank: int, world_size: int, argv: list[str]) -> None:
    _load(TOOL).main(argv)


@pytest.mark.timeout(120)
def test_benchmark_writes_rows_no_faster_than_the_simulator(tmp_path):
    """Every row is written; sleeping stages cannot beat the simulated compute-only makespan."""
    out = tmp_path / "bench.json"
    argv = ["--num-microbatches", "4", "8", "--forward-ms", "2", "--backward-ms", "4",
            "--weight-ms", "2", "--iters", "5", "--warmup", "0", "--rounds", "2",
            "--json", str(out), "--end-stage-factor", "1.5", "--trace",
            "--schedules", "1f1b,chimera,chimera-zb,interleaved:virtual_pipeline_size=2,torch-1f1b,"
            "chimera-zb:profile=2,chimera-zb:costs=unit,chimera-zb:p2p_us=500"]
    spawn_world(_run_tool, 4, argv, timeout_s=110)
    rows = json.loads(out.read_text())
    expected = [("1f1b", {}), ("chimera", {}), ("interleaved", {"virtual_pipeline_size": 2}),
                ("torch-1f1b", {}), ("chimera-zb", {}),
                ("chimera-zb", {"profile": 2}), ("chimera-zb", {"costs": "unit"}),
                ("chimera-zb", {"p2p_us": 500})]
    assert sorted((r["schedule"], r["N"], str(r["options"])) for r in rows) == sorted(
        (s, n, str(o)) for s, o in expected for n in (4, 8))
    profiled = [r for r in rows if r["options"] == {"profile": 2}]
    assert all(" measured F/B/W per stage [ms]: s0 " in r["rebuild"] for r in profiled)
    for row in rows:
        assert set(row) >= {"schedule", "pipes", "concat", "D", "N", "measured_s", "simulated_s"}
        assert row["D"] == 4 and len(row["times_s"]) == 10  # 2 rounds of 5
        # the host costs of the traced iterations, one pair for the run, in every row
        host = row["host_costs"]
        assert host == rows[0]["host_costs"] and 0 < host["action_s"] < 0.05, host
        assert 0 <= host["message_s"] < 0.05, host
        if row["schedule"].startswith("torch-"):
            assert row["simulated_s"] is None and "gaps" not in row
            assert row["simulated_host_s"] is None
        else:
            _check_gaps(row)
            assert row["simulated_s"] >= row["simulated_compute_s"] > 0, row
            assert row["measured_s"] >= 0.97 * row["simulated_compute_s"], row
            assert row["simulated_host_s"] > row["simulated_compute_s"], row
    tool = _load(TOOL)
    table = tool.format_table([tool.Row(r["schedule"], r["options"], r["D"], r["N"],
                                        r["measured_s"], r["simulated_s"]) for r in rows], 1e-4)
    for n in (4, 8):
        assert f"N={n}: our best " in table and "torch's best torch-1f1b" in table
        assert "largest measured/simulated" in table


@pytest.mark.timeout(120)
def test_moe_rows_calibrate_the_paired_runtimes_host_costs(tmp_path):
    """Emulated MoE rows (D = 2, EP = 2): the simulator costs pairs piece by piece, each row
    calibrates the paired runtime's host costs on its ranks (once per round), and the
    simulation with them is never faster than the one without; with ``--grad-reduce none`` the
    rows run on queued devices whose messages carry the device time (no iteration can then be
    faster than the simulator's makespan, whose costs are all real waits)."""
    out = tmp_path / "bench.json"
    argv = ["-D", "2", "--num-microbatches", "4", "--forward-ms", "3", "--backward-ms", "3",
            "--weight-ms", "0", "--all-to-all-ms", "3", "--expert-model-parallel-size", "2",
            "--layers-per-stage", "1", "--iters", "5", "--warmup", "0", "--rounds", "2",
            "--grad-reduce", "none", "--json", str(out),
            "--schedules", "chimera,chimera:overlap_moe_expert_parallel_comm=1"]
    spawn_world(_run_tool, 4, argv, timeout_s=110)
    rows = json.loads(out.read_text())
    assert len(rows) == 2
    for row in rows:
        host = row["pair_host_costs"]
        assert 0 <= host["action_s"] < 0.05 and 0 <= host["hand_over_s"] < 0.05, host
        measured, nominal = host["unpaired"]
        assert nominal == pytest.approx(4 * 0.003) and measured > 0.9 * nominal
        measured, modelled = host["pair"]  # a balanced F&B pair: max(3 + 3, 3 + 3) ms
        assert modelled == pytest.approx(0.006) and measured > 0.9 * modelled
        assert row["simulated_pair_host_s"] >= row["simulated_s"] - 1e-3, row
        assert row["device_timed"] is True
        assert min(row["times_s"]) >= 0.97 * row["simulated_s"], row


def _check_gaps(row: dict) -> None:
    """--trace: two traced iterations (one per round) split every rank's time between computes:
    every gap but each rank's first is either a critical hop or a local gap, and nothing
    measured on one clock is negative."""
    gaps = row["gaps"]
    options = {k: v for k, v in row["options"].items() if k == "virtual_pipeline_size"}
    schedule = build_schedule(row["schedule"], 4, row["N"], **options)
    gaps_per_iteration = sum(len(actions) - 1 for actions in schedule.actions)
    assert gaps["hops"]["count"] + gaps["local_gaps"]["count"] == 2 * gaps_per_iteration, row
    assert gaps["hops"]["count"] > 0 and gaps["wake_to_start"]["count"] == gaps["hops"]["count"]
    for kind in ("hops", "wake_to_start", "end_to_send", "local_gaps"):
        assert 0 <= gaps[kind]["median_ms"] < 50, (kind, row)


def _run_overhead_tool(rank: int, world_size: int, argv: list[str]) -> None:
    _load(OVERHEAD_TOOL).main(argv)


@pytest.mark.timeout(180)
def test_overhead_tool_reports_ours_and_torch_per_action(tmp_path):
    """tools/benchmark_overhead.py runs D=2 (two ranks, two waiting) and D=4 with zero-cost
    stages and reports CPU and wall ms per action for our executor and torch's runtime, with the
    cProfile split (no timing is asserted: speed is the benchmark's business)."""
    out = tmp_path / "overhead.json"
    argv = ["--sizes", "2", "4", "--num-microbatches", "4", "--iters", "2", "--rounds", "2",
            "--warmup", "1", "--profile", "--schedules", "1f1b,chimera-zb,torch-1f1b",
            "--json", str(out)]
    spawn_world(_run_overhead_tool, 4, argv, timeout_s=170)
    rows = json.loads(out.read_text())
    assert {(r["schedule"], r["pipeline_size"]) for r in rows} == {
        (s, d) for s in ("1f1b", "chimera-zb", "torch-1f1b") for d in (2, 4)}
    tool = _load(OVERHEAD_TOOL)
    for row in rows:
        assert len(row["cpu_ms_per_action"]) == row["pipeline_size"]
        assert min(row["cpu_ms_per_action"]) > 0 and row["wall_ms_per_action"] > 0
        assert row["actions_per_rank"] == (3 if row["schedule"] == "chimera-zb" else 2) * 4
        assert set(row["profile"]) == set(tool.CATEGORIES) and sum(row["profile"].values()) > 0
    table = tool.format_rows([tool.Row(**{**r, "top": [tuple(t) for t in r["top"]]})
                              for r in rows])
    assert "| ours | chimera-zb | 4 |" in table and "| torch | torch-1f1b | 2 |" in table
    assert "all but stage" in table
