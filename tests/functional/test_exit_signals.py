"""End-to-end: a preempted (SIGTERM) or time-limited (``--exit-duration-in-mins``) Chimera D=2
run leaves a checkpoint at the iteration it reached, exits 0 without a traceback, and resuming
from it gives the losses of the uninterrupted run.

One chain of runs shares the reference: the uninterrupted run; a run SIGTERMed under torchrun
(launcher and workers signalled, as ``scancel`` does) at iteration k1; its resume, stopped by a
wall-clock limit below its start-up time at iteration k2 (ranks started by hand, so each
rank's exit status is seen); the resume of that to the end. The losses of the three pieces are
those of the reference, bit for bit (same layout, no dropout: resume is exact). The last
resume gives no model flags: ``--use-checkpoint-args`` takes them from the checkpoint.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_chimera.parallel_state import NCCL_SEMANTICS_ENV
from megatron_chimera.training.restart import KILL_ENV
from tests.helpers.flags import without_flags
from tests.helpers.processes import children_of, kill_launched

from .launcher import ROOT, TINY, launch_forked, launch_ranks, scalars, train

pytestmark = [pytest.mark.functional, pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

# 16: the SIGTERM lands an iteration or two after the 3rd, the wall-clock resume stops one
# iteration later, and the last piece still has iterations to run (even on a loaded machine);
# the kill after 7 restarts from the save at 5. Every iteration is ~0.1 s of each run.
ITERS = 16
# Chimera D=2 (two pipes, each rank a stage of each): two workers per torchrun attempt, not four
# (a fresh interpreter each, ~4 s of CPU); what is shown -- the signals, the agreed wall-clock
# stop, the restart, exact resume from the checkpoint -- is the same for every D (Chimera D=4
# resumes bit for bit in test_pretrain_layouts.py::test_resume_is_exact_and_changes_layout)
D = 2
FLAGS = [*TINY, "--num-layers", "4", "--hidden-size", "32", "--log-interval", "1",
         "--train-iters", str(ITERS), "--pipeline-model-parallel-size", str(D),
         "--chimera-pipes", "2"]
MODEL_FLAGS = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
               "--max-position-embeddings", "--vocab-size")
_ITERATION = re.compile(r" iteration\s+(\d+)/")




@pytest.mark.timeout(400)
def test_a_killed_rank_restarts_in_the_job_from_the_last_checkpoint(tmp_path, reference):
    # torchrun --max-restarts 1; rank 1 kill -9s itself after iteration 7 (saves every 5): the
    # job restarts from iteration 5, says so, and finishes with the uninterrupted run's losses
    ckpt, board = tmp_path / "ckpt", tmp_path / "tb"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={D}",
           "--max-restarts=1", str(ROOT / "pretrain_gpt2.py"), *FLAGS, "--save", str(ckpt),
           "--save-interval", "5", "--tensorboard-dir", str(board)]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{NCCL_SEMANTICS_ENV: "1"},
               **{KILL_ENV: "1:7"})
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    # the dead rank is named: by the launcher, and by its peers' heartbeat watch when they see
    # it before the launcher stops them
    assert re.search(r"failed \(exitcode: -9\) local_rank: 1 ", proc.stderr), proc.stderr[-3000:]
    assert (f" restart 1 of this job: resuming from iteration 5 of {ckpt}; the previous attempt "
            "finished iteration 7, so 2 iterations since the checkpoint are lost and run "
            "again") in proc.stdout, proc.stdout[-3000:]
    assert " save cost: " in proc.stdout  # the --save-interval advice after the first save
    losses = scalars(board, "lm loss")  # the restart's 6 and 7 replace the first attempt's
    assert {k: losses[k] for k in range(6, ITERS + 1)} == \
        {k: reference[k] for k in range(6, ITERS + 1)}


def tracker(checkpoint: Path) -> int:
    """The iteration the checkpoint's tracker names."""
    return int((checkpoint / "latest_checkpointed_iteration.txt").read_text())


def sigterm_under_torchrun(args: list[str], after_iteration: int, tmp_path: Path
                           ) -> tuple[int, str, str]:
    """torchrun D=2 on ``args``; once iteration ``after_iteration`` is logged, SIGTERM to the
    launcher and every worker. Returns (the last iteration logged then, stdout, stderr)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={D}",
           str(ROOT / "pretrain_gpt2.py"), *args]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{NCCL_SEMANTICS_ENV: "1"})
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err,
                                    text=True, start_new_session=True)
        lines, workers, seen = [], [], 0
        try:
            for line in launcher.stdout:
                lines.append(line)
                match = _ITERATION.match(line)
                if match and int(match.group(1)) >= after_iteration:
                    seen = int(match.group(1))
                    break
            workers = children_of(launcher.pid)
            assert len(workers) == D, workers
            for pid in [launcher.pid, *workers]:  # as scancel: every process of the step
                os.kill(pid, signal.SIGTERM)
            lines += launcher.stdout.readlines()
            launcher.wait(timeout=120)
        finally:
            kill_launched(launcher, workers)  # the processes this test started
    return seen, "".join(lines), err_path.read_text()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted run's losses (shared by the tests of this module)."""
    board = tmp_path_factory.mktemp("reference") / "tb"
    train("pretrain_gpt2.py", FLAGS, D, board)
    losses = scalars(board, "lm loss")
    assert sorted(losses) == list(range(1, ITERS + 1))
    return losses


@pytest.mark.timeout(600)
def test_sigterm_and_wall_clock_exits_save_and_resume_exactly(tmp_path, reference):
    ckpt = tmp_path / "ckpt"

    # 1. SIGTERM mid-training
    seen, out, err = sigterm_under_torchrun(
        [*FLAGS, "--exit-signal-handler", "--save", str(ckpt),
         "--tensorboard-dir", str(tmp_path / "tb-1")], 3, tmp_path)
    k1 = tracker(ckpt)
    assert seen <= k1 < ITERS, (seen, k1)
    assert f" exiting program after receiving SIGTERM at iteration {k1}" in out, out[-2000:]
    assert "pretrain_gpt2.py" not in err and "Terminated" not in err, err[-3000:]
    first = scalars(tmp_path / "tb-1", "lm loss")
    assert first == {k: reference[k] for k in range(1, k1 + 1)}

    # 2. the resume stops at its first iteration boundary past a 0.6 s wall-clock limit
    results = launch_ranks("pretrain_gpt2.py", [
        *FLAGS, "--exit-duration-in-mins", "0.01", "--load", str(ckpt), "--save", str(ckpt),
        "--tensorboard-dir", str(tmp_path / "tb-2")], D)
    for rank, result in enumerate(results):
        assert result.returncode == 0 and "Traceback" not in result.stderr, (rank, result)
    k2 = tracker(ckpt)
    assert k1 < k2 < ITERS, (k1, k2)
    assert re.search(rf" exiting program after [\d.]+ minutes at iteration {k2}\n",
                     results[0].stdout), results[0].stdout[-2000:]
    second = scalars(tmp_path / "tb-2", "lm loss")
    assert second == {k: reference[k] for k in range(k1 + 1, k2 + 1)}

    # 3. the rest, the model flags taken from the checkpoint (--use-checkpoint-args)
    rest = [*without_flags(FLAGS, MODEL_FLAGS), "--use-checkpoint-args",
            "--exit-on-missing-checkpoint"]
    assert "--num-layers" not in rest
    # (forked ranks: what this piece shows is the resume, not torchrun)
    result = launch_forked("pretrain_gpt2.py", [*rest, "--load", str(ckpt), "--save",
                                                str(tmp_path / "end"), "--tensorboard-dir",
                                                str(tmp_path / "tb-3")], D)
    assert result.returncode == 0, result.stderr[-3000:]
    third = scalars(tmp_path / "tb-3", "lm loss")
    assert third == {k: reference[k] for k in range(k2 + 1, ITERS + 1)}
