"""End-to-end: every layout trains the same model to the same losses; resume is exact.

Each run is a real ``pretrain_gpt2.py`` / ``pretrain_bert.py`` process (torchrun for several
ranks, gloo on CPU); losses are read back from the TensorBoard event files. fp32 runs of the same
seed, data and global batch agree up to float summation order (1e-5 relative).
"""

from __future__ import annotations

import pytest

from .launcher import assert_close, reference_curve, scalars, train

pytestmark = [pytest.mark.functional, pytest.mark.slow]

ITERS = ["--train-iters", "20"]
RTOL = 1e-5

# (1F1B through the entry script: the resume test's D=2 run and the data-parallel chain's;
# Chimera D=4 x W=2: the data-parallel chain's, with the distributed optimizer)
GPT_LAYOUTS = {
    "chimera-D4": (4, ["--pipeline-model-parallel-size", "4", "--chimera-pipes", "2"]),
    # uneven stages (3, 2, 2, 1 layers; the mirror pipe holds the same stages)
    "chimera-D4-layout": (4, ["--pipeline-model-parallel-size", "4", "--chimera-pipes", "2",
                              "--pipeline-model-parallel-layout", "Et*3|t*2|t*2|tL"]),
    "chimera-D8-4pipes": (8, ["--pipeline-model-parallel-size", "8", "--chimera-pipes", "4"]),
}


@pytest.fixture(scope="module")
def gpt_reference(tmp_path_factory):
    """One process, whole model: the reference loss curve."""
    return reference_curve(tmp_path_factory.mktemp("gpt-1proc"), 20, min_drop=0.1)


@pytest.fixture(scope="module")
def layout_curves():
    """Loss curves of the layouts run so far (the resume test reuses Chimera D=4's)."""
    return {}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", sorted(GPT_LAYOUTS))
def test_gpt_layouts_match_one_process(layout, gpt_reference, layout_curves, tmp_path):
    nproc, flags = GPT_LAYOUTS[layout]
    trace = tmp_path / "trace" / "pipeline.json"
    if layout == "chimera-D4-layout":  # the same run writes the measured timeline
        flags = [*flags, "--pipeline-trace", str(trace)]
    result = train("pretrain_gpt2.py", [*ITERS, *flags], nproc, tmp_path)
    losses = layout_curves[layout] = scalars(tmp_path, "lm loss")
    assert_close(losses, gpt_reference, RTOL, layout)
    assert "bubble ratio predicted:" in result.stdout and "bubble ratio measured:" in result.stdout
    if "--pipeline-model-parallel-layout" in flags:  # the stages were built as the layout says
        layout = flags[flags.index("--pipeline-model-parallel-layout") + 1]
        assert f"pipeline stages: {layout} (layers per stage [3, 2, 2, 1])" in result.stdout
        check_pipeline_trace(trace, nproc)
        check_memory_report(result.stdout, tmp_path, nproc)
    measured = scalars(tmp_path, "bubble-ratio")
    assert all(0.0 <= v < 1.0 for v in measured.values())


@pytest.mark.timeout(300)
def test_bert_chimera_matches_one_process(tmp_path):
    train("pretrain_bert.py", ITERS, 1, tmp_path / "one")
    train("pretrain_bert.py", [*ITERS, "--pipeline-model-parallel-size", "4",
                               "--chimera-pipes", "2"], 4, tmp_path / "chimera")
    for tag in ("lm loss", "sop loss"):
        assert_close(scalars(tmp_path / "chimera", tag), scalars(tmp_path / "one", tag), RTOL,
                     f"bert {tag}")


@pytest.mark.timeout(300)
def test_resume_is_exact_and_changes_layout(gpt_reference, layout_curves, tmp_path):
    ckpt = tmp_path / "ckpt"
    chimera = ["--pipeline-model-parallel-size", "4", "--chimera-pipes", "2"]
    first = train("pretrain_gpt2.py", [*ITERS, *chimera, "--save", str(ckpt),
                                       "--exit-interval", "10"], 4, tmp_path / "first")
    assert "exiting program at iteration 10" in first.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    assert sorted(scalars(tmp_path / "first", "lm loss")) == list(range(1, 11))
    straight = {k: v for k, v in gpt_reference.items() if k > 10}

    # Same layout: the continued curve equals 20 straight iterations of this layout exactly.
    if "chimera-D4" not in layout_curves:  # run alone (-k): make the straight curve here
        train("pretrain_gpt2.py", [*ITERS, *chimera], 4, tmp_path / "straight")
        layout_curves["chimera-D4"] = scalars(tmp_path / "straight", "lm loss")
    chimera_straight = {k: v for k, v in layout_curves["chimera-D4"].items() if k > 10}
    train("pretrain_gpt2.py", [*ITERS, *chimera, "--load", str(ckpt)], 4, tmp_path / "same")
    assert scalars(tmp_path / "same", "lm loss") == chimera_straight

    # Another layout (1F1B, D=2): the same next losses up to summation order.
    train("pretrain_gpt2.py", [*ITERS, "--pipeline-model-parallel-size", "2", "--load",
                               str(ckpt)], 2, tmp_path / "other")
    assert_close(scalars(tmp_path / "other", "lm loss"), straight, RTOL, "1f1b D=2 resume")


@pytest.mark.timeout(240)
def test_bf16_tracks_fp32(gpt_reference, tmp_path):
    train("pretrain_gpt2.py", [*ITERS, "--bf16"], 1, tmp_path)
    bf16 = scalars(tmp_path, "lm loss")
    # bf16 keeps ~3 significant digits; over 20 steps of a tiny model the curves stay within 2%.
    assert_close(bf16, gpt_reference, 2e-2, "bf16 vs fp32")
    assert bf16[20] < bf16[1] - 0.1


def check_pipeline_trace(path, world_size: int) -> None:
    """``--pipeline-trace``: Chrome / Perfetto JSON whose complete events (pid = rank) hold one
    compute event per compute action of each rank's list in every traced iteration, the
    sends and waits, the gradient reductions and the optimizer step; the plot tool reads it."""
    import json
    from collections import Counter

    from megatron_chimera.schedules.measured import trace_schedule

    trace = json.loads(path.read_text())
    iterations = trace["otherData"]["iterations"]
    assert iterations == [2, 3]  # after one warm-up iteration
    schedule = trace_schedule(trace)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and isinstance(e["ts"], float) for e in complete)
    for rank in range(world_size):
        want = Counter((a.kind, a.pipe, a.stage, a.microbatch) for a in schedule.actions[rank])
        for iteration in iterations:
            mine = [e for e in complete if e["pid"] == rank and e["args"]["iteration"] == iteration]
            got = Counter((e["args"]["kind"], e["args"]["pipe"], e["args"]["stage"],
                           e["args"]["microbatch"]) for e in mine if e["cat"] == "compute")
            assert got == want, (rank, iteration)
            cats = Counter(e["cat"] for e in mine)
            assert cats["p2p"] > 0 and cats["grad-reduction"] > 0 and cats["optimizer"] == 1
    import subprocess
    import sys

    from tests.helpers import REPO_ROOT

    out = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "plot_schedule.py"),
                          "--measured", str(path)], capture_output=True, text=True, check=True)
    assert "measured (ms):" in out.stdout and "rank  3 |" in out.stdout


def check_memory_report(stdout: str, tensorboard_dir, world_size: int) -> None:
    """One memory line per rank in the log and TensorBoard, predicted beside measured: weights,
    gradients and optimizer state are exact counts (equal to 1%), the receive buffers the same
    number of messages, the saved activations within 10% (the activation model is Korthikanti
    et al.'s formula; the measurement counts every storage saved for backward)."""
    lines = [line for line in stdout.splitlines() if "] memory (MB) predicted:" in line]
    assert len(lines) == world_size, lines
    def figure(rank: int, side: str, kind: str) -> float:
        return scalars(tensorboard_dir, f"memory/rank-{rank}/{side}-{kind}-MB")[1]

    for rank in range(world_size):
        for kind, rtol in (("weights", 0.01), ("grads", 0.01), ("optimizer", 0.01),
                           ("buffers", 1e-9), ("activations", 0.10)):
            predicted = figure(rank, "predicted", kind)
            measured = figure(rank, "measured", kind)
            assert measured > 0 and abs(predicted - measured) <= rtol * measured, (
                rank, kind, predicted, measured)
