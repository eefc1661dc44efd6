"""``bash tools/gpu_check.sh --device cpu``: the dry run of the GPU check writes its files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from megatron_chimera.tuning.hardware import load_hardware
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT


@pytest.mark.functional
@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils' timeout")
def test_gpu_check_dry_run_on_cpu(tmp_path):
    """Every step runs (the CUDA-only audit reports SKIP), each records one result, the report
    and the hardware profile are written, and the profile loads as ``--hardware FILE``; the MoE
    layer's grouped GEMM equals its loop and the serial ring equals SDPA (bf16, tiny shapes)."""
    out = tmp_path / "out"
    out.mkdir()
    earlier = '{"step": "training", "run": "an earlier run", "status": "FAIL", "summary": "x"}\n'
    (out / "results.jsonl").write_text(earlier)  # appended to, never truncated; not this run
    env = dict(os.environ, OMP_NUM_THREADS="1", OUT=str(out), PYTHON=sys.executable)
    env.pop("PYTHONPATH", None)  # the script sets it: a bare checkout needs nothing installed
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--device", "cpu"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:] + log[-4000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_check.json", "gpu_check.log", "gpu_check.md", "hardware_profile.json",
        "results.jsonl"]  # at most 8 files come back from a lent machine
    results = json.loads((out / "gpu_check.json").read_text())
    assert (out / "results.jsonl").read_text().startswith(earlier)
    assert log.splitlines()[1].startswith("versions: python")  # before any step
    assert list(results) == ["env", "layer_mfu", "moe_experts", "ring_attention", "hardware",
                             "kernels", "training", "sync_audit", "memory", "recompute",
                             "resume", "moe_syncs", "slices_cpu", "overlap",
                             "equivalence_bf16"]
    statuses = {name: r["status"] for name, r in results.items()}
    # moe_experts: INFO where this torch's CPU build has no grouped GEMM (loop only)
    grouped = results["moe_experts"]["grouped_gemm_runs"]
    assert statuses == {"env": "INFO", "layer_mfu": "INFO", "training": "PASS",
                        "sync_audit": "SKIP", "recompute": "PASS", "resume": "PASS",
                        "memory": "PASS", "hardware": "INFO", "slices_cpu": "INFO",
                        "moe_experts": "PASS" if grouped else "INFO",
                        "ring_attention": "PASS", "moe_syncs": "INFO",
                        "kernels": "SKIP", "overlap": "INFO",
                        "equivalence_bf16": "INFO"}, results
    assert "exposed communication" in results["overlap"]["summary"]
    assert [r["gemm"] for r in results["moe_experts"]["rows"]] == (
        ["grouped", "loop"] if grouped else ["loop"])
    assert [r["what"] for r in results["ring_attention"]["rows"]][1:] == ["ring CP=2",
                                                                          "ring CP=4"]
    assert results["env"]["torch"] and set(results["env"]["sdpa"].values()) <= {
        "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"}, results["env"]
    assert [r["shape"] for r in results["layer_mfu"]["rows"]] == ["gpt tiny", "llama tiny"]
    assert "bitwise equal" in results["resume"]["summary"]
    slices = results["slices_cpu"]  # the benchmark ran both rows under torch.distributed.run
    assert [r["row"] for r in slices["rows"]] == [
        "chimera, unsliced", "chimera, --pipeline-sequence-slices 4"] and slices["ratio"] > 0
    assert slices["simulated_ratio"] == 0.625  # sliced_schedule vs chimera(4, 2) at B = 2F
    profile = load_hardware(str(out / "hardware_profile.json"))
    assert profile.name == "cpu-dry-run" and profile.hbm_bandwidth_gbps > 0
    assert profile.memory_efficiency == 1.0 and profile.kernel_overhead_s > 0
    table = (out / "gpu_check.md").read_text()
    assert "| step | status | s | result |" in table and "| gpt tiny | 2 |" in table
    assert proc.stdout.rstrip().endswith(f"0 failed step(s); files in {out}")


def test_gpu_check_rejects_a_bogus_device_before_any_step(tmp_path):
    """One error line, a non-zero exit, nothing run or written (a typo spends no lease)."""
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--device", "gpu0"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: --device must be auto, cuda or cpu, got 'gpu0'"]
    assert not (tmp_path / "out").exists()
