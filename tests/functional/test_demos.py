"""examples/demo_*.py run, write their outputs and print numbers that agree with the paper's
formulas, the real model classes and the simulator."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from megatron_chimera.schedules.simulate import simulate
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT
DEMOS = ("demo_schedule", "demo_model", "demo_performance")


def load(name: str):
    """Import examples/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", DEMOS)
def test_help_from_the_repository_root(name):
    proc = subprocess.run([sys.executable, f"examples/{name}.py", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


# ----------------------------------------------------------------------------- demo_schedule
def test_demo_schedule_writes_pngs_and_matches_the_paper(capsys, tmp_path):
    D, N = 4, 8
    assert load("demo_schedule").main(["-D", str(D), "-N", str(N), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ("chimera", "1f1b"):
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    makespans = dict(re.findall(r"^(chimera|1f1b): makespan (\d+)", out, re.M))
    # backward = 2 forward: 1F1B 3(N+D-1); Chimera slot-merge 3N+2D-4 (docs/CHIMERA.md / chimera.py)
    assert int(makespans["1f1b"]) == 3 * (N + D - 1)
    assert int(makespans["chimera"]) == 3 * N + 2 * D - 4
    table2 = re.findall(r"simulated bubble ratio ([0-9.]+), paper Table 2 ([0-9.]+)", out)
    assert [float(s) for s, _ in table2] == pytest.approx(
        [(D - 2) / (2 * N + D - 2), (D - 1) / (N + D - 1)], abs=5e-5)


def test_demo_schedule_rejects_sizes_chimera_cannot_run(capsys, tmp_path):
    assert load("demo_schedule").main(["-D", "6", "-N", "8", "--out", str(tmp_path)]) == 2
    assert "--num-microbatches" in capsys.readouterr().err


# ----------------------------------------------------------------------------- demo_model
def test_demo_model_gpt2_64_counts_and_real_slices(capsys):
    assert load("demo_model").main(["--model", "gpt2-64", "-D", "8"]) == 0
    out = capsys.readouterr().out
    h, v = 1280, 50304  # the paper's GPT-2: untied embeddings, vocabulary padded to 128
    total = 64 * (12 * h * h + 13 * h) + 2 * v * h + 632 * h + 2 * h
    assert f"{total / 1e6:.1f} M parameters" in out
    stages = [int(x.replace(",", "")) for x in
              re.findall(r"^\s+\d\s+\d+-\d+\s+([\d,]+)\s", out, re.M)]
    assert sum(stages) == total and len(stages) == 8
    assert stages[1] == 8 * (12 * h * h + 13 * h)  # a middle stage: 8 layers, nothing else
    checks = re.findall(r"parameters real ([\d,]+) / estimated ([\d,]+); bytes real ([\d,]+) / "
                        r"estimated ([\d,]+): (\w+)", out)
    assert len(checks) == 8 and all(c[0] == c[1] and c[2] == c[3] for c in checks)
    assert "output_layer" in out  # the untied head sits on the last stage
    assert "per rank under chimera" in out and "per rank under 1f1b" in out


def test_demo_model_bert_fp16_odd_stages(capsys):
    assert load("demo_model").main(["--model", "bert-48", "-D", "3", "--params-dtype",
                                    "fp16", "--partition-method", "parameters"]) == 0
    out = capsys.readouterr().out
    assert "per rank under chimera: not available" in out
    assert "word_embeddings (copy of the tied embedding)" in out
    assert out.count(": match") == 3


def test_demo_model_custom_needs_sizes(capsys):
    assert load("demo_model").main(["--model", "custom", "--num-layers", "4"]) == 2
    assert "--hidden-size" in capsys.readouterr().err


# ----------------------------------------------------------------------------- demo_performance
def test_demo_performance_predictions_equal_the_simulator(capsys):
    demo = load("demo_performance")
    args = ["--model", "gpt2-small", "--num-gpus", "8", "-D", "4", "-N", "8", "--hardware", "a100"]
    assert demo.main(args) == 0
    out = capsys.readouterr().out
    printed = dict(re.findall(r"^(\S+(?: \S+)*)\s{2,}(\d+\.\d+)\s", out, re.M))
    from megatron_chimera.tuning.analytic_costs import ModelSpec
    from megatron_chimera.tuning.hardware import load_hardware
    from megatron_chimera.tuning.perf_model import PerformanceModel
    from megatron_chimera.tuning.training_plan import TrainingPlan

    config = demo.make_model("gpt2-small")[1]
    model = PerformanceModel(ModelSpec(config, "gpt2"), load_hardware("a100"))
    for label, options, _ in demo.VARIANTS:
        schedule_options = {k: v for k, v in options.items() if k != "schedule"}
        layout = TrainingPlan.of(options["schedule"], 4, 2, 1, 8, **schedule_options)
        makespan = simulate(model.schedule(layout), model.cost_model(layout)).makespan
        # the prediction adds the optimizer step after the makespan (Adam's bytes over HBM)
        expected = makespan + model.optimizer_step_s(layout)
        assert float(printed[label]) == pytest.approx(expected, abs=5e-5), label
    assert "global batch 16" in out


def test_demo_performance_rejects_gpus_not_multiple_of_d(capsys):
    assert load("demo_performance").main(["--num-gpus", "6", "-D", "4"]) == 2
    assert "--num-gpus" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_demo_performance_measures_with_emulated_compute(capsys):
    demo = load("demo_performance")
    args = ["--model", "gpt2-small", "-D", "4", "-N", "4", "--measure",
            "--emulated-forward-ms", "3", "--timeout", "240"]
    assert demo.main(args) == 0
    out = capsys.readouterr().out
    table = out[out.index("measured s"):]
    rows = re.findall(r"^(\S+(?: \S+)*)\s{2,}(\d+\.\d+)\s+(\d+\.\d+)\s", table, re.M)
    labels = {r[0] for r in rows}
    assert {"1f1b", "gpipe", "chimera/slot-merge", "chimera-zb", "zb-h1"} <= labels
    for label, measured, simulated in rows:
        # stages sleep their emulated time, so no iteration beats most of the simulated makespan
        assert float(measured) >= 0.8 * float(simulated), label
