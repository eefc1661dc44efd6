"""The README's first command, short CI form: corpus -> tokenizer -> data -> Chimera training.

It must leave TensorBoard event files, a checkpoint and the schedule PNG, and a second run must
reuse the prepared data and resume from the checkpoint.
"""

import os
import subprocess
from pathlib import Path

import pytest

from megatron_chimera.parallel_state import NCCL_SEMANTICS_ENV
from tests.helpers import REPO_ROOT

REPO = REPO_ROOT


def _run_quickstart(out_dir: Path) -> str:
    env = dict(os.environ, QUICKSTART_SHORT="1", OUT_DIR=str(out_dir), TRAIN_ITERS="4",
               MASTER_PORT="29631", OMP_NUM_THREADS="1", **{NCCL_SEMANTICS_ENV: "1"})
    proc = subprocess.run(["bash", "examples/quickstart.sh"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.functional
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_quickstart_short_end_to_end_and_rerun(tmp_path: Path):
    out = _run_quickstart(tmp_path)
    assert " iteration        4/       4 |" in out and "lm loss:" in out
    assert "validation loss at iteration 4" in out
    announced = out.index(" evaluating (validation")  # the announcement, then the loss
    assert announced < out.index("validation loss at iteration 4")  # said before it runs
    assert out.count(" layout: world ") == 1, out  # the start-up block, once
    events = list((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)
    tracker = tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt"
    assert tracker.read_text().strip() == "4"
    png = tmp_path / "chimera_schedule.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"Checkpoint       : {tmp_path / 'checkpoints'}" in out
    assert "==> sample:" in out and "--- sample 1/1" in out and "\nROMEO:" in out

    again = _run_quickstart(tmp_path)
    assert "reusing" in again and "resuming from" in again
    assert " iteration        8/       8 |" in again
    assert tracker.read_text().strip() == "8"
