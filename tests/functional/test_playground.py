"""tools/chimera_playground.py: scripted sections checked against the library and the paper's
formulas, and the interactive tour driven at its prompt."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from megatron_chimera.config import ModelConfig
from megatron_chimera.model.gpt2 import build_gpt_stage
from megatron_chimera.model.partition import partition_layers
from megatron_chimera.schedules import build_schedule
from megatron_chimera.schedules.plot import text_chart
from megatron_chimera.schedules.simulate import CostModel, simulate
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT
sys.path.insert(0, str(ROOT / "tools"))
import chimera_playground as playground  # noqa: E402

TINY_GPT = ["--model", "custom", "--num-layers", "4", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "500"]


def run(args: list[str], stdin: str | None = None, timeout: float = 120):
    """The playground as a user runs it (a fresh process)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, str(ROOT / "tools" / "chimera_playground.py"), *args],
                          input=stdin, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def scripted(capsys, args: list[str]) -> str:
    """Output of one scripted run in this process (must succeed)."""
    assert playground.main(["--non-interactive", *args]) == 0
    return capsys.readouterr().out


# ------------------------------------------------------------------------------- scripted
@pytest.mark.parametrize("schedule,expected", [
    ("chimera", (4 - 2) / (2 * 4 + 4 - 2)),  # paper Table 2, forward = backward, N = D
    ("1f1b", (4 - 1) / (4 + 4 - 1)),
])
def test_schedule_bubble_ratio_matches_paper_formula(capsys, schedule, expected):
    out = scripted(capsys, ["--section", "schedule", "--pipeline-schedule", schedule, "-D", "4",
                            "-N", "4", "--forward-cost", "1", "--backward-cost", "1"])
    ratio = float(re.search(r"bubble ratio ([0-9.]+) \(forward", out).group(1))
    assert ratio == pytest.approx(expected, abs=5e-5)


def test_schedule_section_prints_the_library_chart_and_writes_png(capsys, tmp_path):
    png = tmp_path / "c.png"
    out = scripted(capsys, ["--section", "schedule", "-D", "4", "-N", "8", "--png", str(png)])
    schedule = build_schedule("chimera", 4, 8)
    result = simulate(schedule, CostModel(1.0, 2.0))
    assert text_chart(schedule, result) in out
    assert f"simulated makespan {result.makespan:g}, bubble ratio {result.bubble_ratio:.4f}" in out
    assert result.makespan == 3 * 8 + 2 * 4 - 4  # slot-merge: 3N + 2D - 4 at backward = 2 forward
    rows = re.findall(r"^\s+(\d)\s+([\d,]+)\s+(\d+) M\S+\s+(\d+) Ma", out, re.M)
    assert [(int(r), int(c), int(p)) for r, _, c, p in rows] == [
        (r, result.weight_copies[r], result.peak_inflight[r]) for r in range(4)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in out


def test_compare_section_makespans_equal_the_simulator(capsys):
    out = scripted(capsys, ["--section", "compare", "-D", "4", "-N", "8", "--weight-cost", "1"])
    found = {}
    for line in out.splitlines():
        m = re.match(r"^(\S+)\s+(concat=\S+|virtual_pipeline_size=\d|max_inflight=\d)?\s*"
                     r"([\d.]+)\s+([\d.]+)\s", line)
        if m:
            found[(m.group(1), m.group(2) or "")] = (float(m.group(3)), float(m.group(4)))
    costs = (1.0, 1.0, 1.0)  # F, B - W, W as the split generators optimise for
    expected = {
        ("1f1b", ""): simulate(build_schedule("1f1b", 4, 8), CostModel(1, 2)),
        ("chimera", "concat=direct"): simulate(build_schedule("chimera", 4, 8, concat="direct"),
                                               CostModel(1, 2)),
        ("zb-h1", ""): simulate(build_schedule("zb-h1", 4, 8), CostModel(1, 2, 1)),
        ("chimera-zb", "max_inflight=4"): simulate(
            build_schedule("chimera-zb", 4, 8, costs=costs), CostModel(1, 2, 1)),
    }
    for key, result in expected.items():
        assert found[key][0] == pytest.approx(result.makespan), key
        assert found[key][1] == pytest.approx(result.bubble_ratio, abs=5e-4), key
    assert "shortest:" in out


def test_partition_section_parameters_equal_the_real_stage_slices(capsys):
    out = scripted(capsys, ["--section", "partition", *TINY_GPT, "-D", "2", "-N", "4"])
    config = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                         vocab_size=500)
    partition = partition_layers(4, 2)
    real = [sum(p.numel() for p in build_gpt_stage(config, partition, s).parameters())
            for s in range(2)]
    printed = [int(n.replace(",", "")) for n in
               re.findall(r"^\s+\d\s+\d-\d\s+([\d,]+)\s", out, re.M)]
    assert printed == real
    assert "per rank under chimera" in out


def test_autotune_section_prints_the_tuners_best_layout(capsys):
    out = scripted(capsys, ["--section", "autotune", *TINY_GPT, "--num-gpus", "4",
                            "--global-batch-size", "8", "--hardware", "a100"])
    from megatron_chimera.tuning.analytic_costs import ModelSpec
    from megatron_chimera.tuning.autotune import SearchSpace, autotune
    from megatron_chimera.tuning.hardware import GB, load_hardware
    from megatron_chimera.tuning.perf_model import PerformanceModel

    spec = ModelSpec(ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4,
                                 seq_length=32, vocab_size=500), "gpt2")
    hardware = load_hardware("a100")
    best = autotune(PerformanceModel(spec, hardware), SearchSpace(4, 8, 4),
                    int(hardware.memory_gb * GB * 0.9)).best
    assert f"autotuner's suggestion: {best.layout.describe()}: {best.iteration_s:.4f}" in out
    assert "torchrun --nproc-per-node 4 pretrain_gpt2.py" in out


@pytest.mark.parametrize("args,flag", [
    (["--section", "schedule", "--pipeline-schedule", "1f1b", "--chimera-pipes", "4"],
     "--chimera-pipes"),
    (["--section", "schedule", "--pipeline-schedule", "zb-h1"], "--weight-cost"),
    (["--section", "partition", "--model", "gpt2-small", "--num-layers", "4"], "--num-layers"),
    (["--section", "partition", "--model", "custom", "--hidden-size", "64"], "--num-layers"),
    (["--section", "compare", "--png", "x.png"], "--png"),
    (["--section", "schedule", "-D", "0"], "--pipeline-model-parallel-size"),
    (["--section", "autotune", "--hardware", "tpu9"], "--hardware"),
])
def test_bad_flags_give_one_clear_error(capsys, args, flag):
    assert playground.main(["--non-interactive", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and flag in err, err


def test_section_without_non_interactive_is_rejected(capsys):
    assert playground.main(["--section", "schedule"]) == 2
    assert "--non-interactive" in capsys.readouterr().err


def test_all_sections_run_as_a_script(tmp_path):
    proc = run(["--non-interactive", "--section", "all", *TINY_GPT, "--num-gpus", "4",
                "--global-batch-size", "8", "--png", str(tmp_path / "s.png")])
    assert proc.returncode == 0, proc.stderr
    for header in ("== schedule ==", "== compare ==", "== partition ==", "== autotune =="):
        assert header in proc.stdout
    assert "autotuner unavailable" not in proc.stdout
    assert (tmp_path / "s.png").stat().st_size > 0


# ------------------------------------------------------------------------------- interactive
def test_interactive_schedule_chart_then_quit():
    # menu 1; schedule, D, N (one bad answer first), pipes, concat, forward, backward, weight; quit
    answers = ["1", "chimera", "4", "eight", "8", "", "", "1", "2", "0", "q"]
    proc = run([], stdin="\n".join(answers) + "\n")
    assert proc.returncode == 0, proc.stderr
    assert "error: expected a positive integer, got 'eight'" in proc.stdout
    schedule = build_schedule("chimera", 4, 8)
    result = simulate(schedule, CostModel(1.0, 2.0))
    assert text_chart(schedule, result) in proc.stdout
    assert f"bubble ratio {result.bubble_ratio:.4f}" in proc.stdout


def test_interactive_reasks_a_section_whose_answers_do_not_fit_and_ends_on_eof():
    # zb-h1 with weight cost 0 is refused; the section asks again, then stdin ends (Ctrl-D)
    answers = ["1", "zb-h1", "4", "4", "1", "2", "0", "", "", "", "", "", "0.5"]
    proc = run([], stdin="\n".join(answers) + "\n")
    assert proc.returncode == 0, proc.stderr
    assert "error: --weight-cost must be > 0 for zb-h1" in proc.stdout
    result = simulate(build_schedule("zb-h1", 4, 4), CostModel(1.0, 2.0, 0.5))
    assert f"simulated makespan {result.makespan:g}, bubble ratio {result.bubble_ratio:.4f}" \
        in proc.stdout
    assert "Traceback" not in proc.stderr


def test_interactive_partition_of_a_custom_bert(capsys):
    answers = iter(["3", "custom", "bert", "4", "64", "4", "32", "500", "2", "parameters",
                    "1f1b", "2", "2", "q"])
    assert playground.interactive(playground.Settings(), read=lambda prompt: next(answers)) == 0
    out = capsys.readouterr().out
    assert "BERT: 4 layers, hidden 64" in out
    assert "partition 'parameters' into 2 stages, micro-batch size 2" in out
    assert "per rank under 1f1b D=2" in out
