"""tools/plot_schedule.py and tools/compare_schedules.py, run as scripts from the repo root."""

import json
import os
import subprocess
import sys

import pytest

from megatron_chimera.schedules import build_schedule
from megatron_chimera.schedules.plot import text_chart
from megatron_chimera.schedules.simulate import CostModel, simulate
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT


def _run(script, *args, cwd=ROOT):
    env = dict(os.environ, OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / script), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.timeout(120)
def test_plot_schedule_writes_png_and_json_matching_the_simulator(tmp_path):
    png, js = tmp_path / "c.png", tmp_path / "c.json"
    proc = _run("plot_schedule.py", "--pipeline-schedule", "chimera",
                "--pipeline-model-parallel-size", "8", "--num-microbatches", "16",
                "--forward-cost", "1", "--backward-cost", "2", "--out", str(png), "--json", str(js))
    assert proc.returncode == 0, proc.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    dumped = json.loads(js.read_text())
    expected = simulate(build_schedule("chimera", 8, 16), CostModel(1.0, 2.0))
    assert dumped["makespan"] == pytest.approx(expected.makespan) == 60
    assert dumped["bubble_ratio"] == pytest.approx(expected.bubble_ratio)
    assert dumped["peak_inflight"] == {str(r): p for r, p in enumerate(expected.peak_inflight)}
    got = [(e["rank"], e["kind"], e["pipe"], e["stage"], e["microbatch"], e["start"], e["end"])
           for e in dumped["events"]]
    want = [(e.rank, e.kind, e.pipe, e.stage, e.microbatch, e.start, e.end)
            for e in expected.events]
    assert got == want
    # the text chart: a title with makespan, then one row per rank
    assert "makespan 60" in proc.stdout
    assert sum(line.startswith("rank ") for line in proc.stdout.splitlines()) == 8


@pytest.mark.timeout(120)
def test_plot_schedule_rejects_flags_that_do_not_apply(tmp_path):
    proc = _run("plot_schedule.py", "--pipeline-schedule", "1f1b", "-D", "4",
                "--chimera-concat", "direct", "--no-text")
    assert proc.returncode == 2
    assert "--chimera-concat does not apply to --pipeline-schedule 1f1b" in proc.stderr
    proc = _run("plot_schedule.py", "--pipeline-schedule", "chimera", "-D", "5", "--no-text")
    assert proc.returncode == 2 and "--pipeline-model-parallel-size" in proc.stderr


@pytest.mark.timeout(120)
def test_compare_schedules_table_and_json(tmp_path):
    js = tmp_path / "rows.json"
    proc = _run("compare_schedules.py", "-D", "4", "-N", "8", "--backward-cost", "2",
                "--schedules", "1f1b", "chimera", "interleaved", "zb-h1", "--json", str(js),
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(js.read_text())
    by_variant = {(r["schedule"], r["variant"]): r for r in rows}
    assert by_variant[("1f1b", "")]["makespan"] == 3 * (8 + 4 - 1)
    assert by_variant[("chimera", "concat=direct")]["makespan"] == 3 * 8 + 3 * 2
    assert by_variant[("chimera", "concat=slot-merge")]["makespan"] == 3 * 8 + 2 * 4 - 4
    assert by_variant[("chimera", "concat=slot-merge")]["weight_copies"] == [2, 2, 2, 2]
    assert by_variant[("chimera", "concat=forward-doubling")]["makespan"] == 3 * 8 + 1.5 * 2
    interleaved = by_variant[("interleaved", "virtual_pipeline_size=2")]
    assert interleaved["makespan"] == pytest.approx(3 * 8 + 3 * 3 / 2)
    assert "--weight-cost must be > 0" in by_variant[("zb-h1", "")]["error"]
    assert "slot-merge" in proc.stdout and "1f1b" in proc.stdout


def test_text_chart_marks_idle_time():
    sched = build_schedule("gpipe", 2, 1)
    chart = text_chart(sched, simulate(sched, CostModel(1.0, 1.0)))
    rows = [line for line in chart.splitlines() if line.startswith("rank")]
    assert rows[0].count(".") == rows[1].count(".") > 0  # each rank idles 2 of 4 time units
