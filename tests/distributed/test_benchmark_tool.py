"""tools/benchmark_schedules.py end to end on 4 ranks with millisecond emulated stages."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from .harness import spawn_world

pytestmark = pytest.mark.distributed
TOOL = Path(__file__).resolve().parents[2] / "tools" / "benchmark_schedules.py"


def _run_tool(rank: int, world_size: int, argv: list[str]) -> None:
    spec = importlib.util.spec_from_file_location("benchmark_schedules", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    module.main(argv)


@pytest.mark.timeout(120)
def test_benchmark_writes_rows_no_faster_than_the_simulator(tmp_path):
    """Every row is written; sleeping stages cannot beat the simulated compute-only makespan."""
    out = tmp_path / "bench.json"
    argv = ["--num-microbatches", "4", "8", "--forward-ms", "2", "--backward-ms", "4",
            "--weight-ms", "2", "--iters", "5", "--warmup", "0", "--json", str(out),
            "--end-stage-factor", "1.5",
            "--schedules", "1f1b,chimera,chimera-zb,interleaved:virtual_pipeline_size=2,torch-1f1b,"
            "chimera-zb:profile=2,chimera-zb:costs=unit"]
    spawn_world(_run_tool, 4, argv, timeout_s=110)
    rows = json.loads(out.read_text())
    expected = [("1f1b", {}), ("chimera", {}), ("interleaved", {"virtual_pipeline_size": 2}),
                ("torch-1f1b", {}), ("chimera-zb", {}),
                ("chimera-zb", {"profile": 2}), ("chimera-zb", {"costs": "unit"})]
    assert sorted((r["schedule"], r["N"], str(r["options"])) for r in rows) == sorted(
        (s, n, str(o)) for s, o in expected for n in (4, 8))
    profiled = [r for r in rows if r["options"] == {"profile": 2}]
    assert all(" measured F/B/W per stage [ms]: s0 " in r["rebuild"] for r in profiled)
    for row in rows:
        assert set(row) >= {"schedule", "pipes", "concat", "D", "N", "measured_s", "simulated_s"}
        assert row["D"] == 4
        if row["schedule"].startswith("torch-"):
            assert row["simulated_s"] is None
        else:
            assert row["simulated_s"] >= row["simulated_compute_s"] > 0, row
            assert row["measured_s"] >= 0.97 * row["simulated_compute_s"], row
