"""Run the entry scripts (plain or under torchrun) and read their TensorBoard scalars back."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_chimera.parallel_state import NCCL_SEMANTICS_ENV
from tests.helpers import REPO_ROOT
from tests.helpers.forked_scripts import start_script

ROOT = REPO_ROOT

# A tiny GPT/BERT: 8 layers, hidden 64, seq 32, vocab ~512, dropout off so layouts agree.
TINY = (
    "--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 8 --lr 1e-3 "
    "--mock-data --vocab-size 500 --hidden-dropout 0 --attention-dropout 0 --num-workers 0 "
    "--eval-iters 0 --log-interval 5 --distributed-timeout-minutes 1"
).split()


@dataclass
class RunResult:
    """Exit code and output of one launch."""

    returncode: int
    stdout: str
    stderr: str


def launch(script: str, args: list[str], nproc: int = 1, timeout: float = 180,
           env: dict[str, str] | None = None) -> RunResult:
    """``python script args`` (nproc 1; forked from the test server, :mod:`forked_scripts`) or
    ``torchrun --standalone --nproc-per-node nproc``, under NCCL's point-to-point rules on gloo
    (``MEGATRON_CHIMERA_NCCL_SEMANTICS=1``) unless ``env`` says otherwise."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                    **{NCCL_SEMANTICS_ENV: "1"}, **(env or {}))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if not env or key not in env:
            full_env.pop(key, None)
    if nproc == 1:
        return _run_forked([(str(ROOT / script), args, full_env)], timeout)[0]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(ROOT / script), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    return RunResult(proc.returncode, proc.stdout, proc.stderr)


def _run_forked(runs: list[tuple[str, list[str], dict[str, str]]], timeout: float
                ) -> list[RunResult]:
    """Start every ``(script, args, env)`` forked from the test server, wait for all (past
    ``timeout``: ``subprocess.TimeoutExpired``, every one still running killed) and return
    their exit codes and outputs."""
    procs = []
    with tempfile.TemporaryDirectory(prefix="mc_launch_") as outdir:
        try:
            for i, (script, args, env) in enumerate(runs):
                procs.append(start_script(script, args, env, ROOT, f"{outdir}/{i}.out",
                                          f"{outdir}/{i}.err"))
            deadline = time.monotonic() + timeout
            for proc in procs:
                proc.join(max(deadline - time.monotonic(), 0.1))
                if proc.exitcode is None:
                    raise subprocess.TimeoutExpired(runs[0][0], timeout)
            return [RunResult(proc.exitcode, _read(f"{outdir}/{i}.out"), _read(f"{outdir}/{i}.err"))
                    for i, proc in enumerate(procs)]
        finally:
            for proc in procs:
                if proc.exitcode is None:
                    proc.kill()
                    proc.join()


def _read(path: str) -> str:
    return Path(path).read_text() if os.path.exists(path) else ""


def train(script: str, args: list[str], nproc: int, tensorboard_dir: Path,
          timeout: float = 180) -> RunResult:
    """A training run that must succeed; writes TensorBoard events to ``tensorboard_dir``.
    Several ranks are started by hand (:func:`launch_ranks`: torchrun's environment without
    its agent, whose start-up costs each run seconds); their outputs are joined in rank order.
    The runs that test torchrun itself (quickstart, two nodes, signals, launcher death) use it."""
    full = [*TINY, *args, "--tensorboard-dir", str(tensorboard_dir)]
    if nproc == 1:
        result = launch(script, full, 1, timeout)
    else:
        ranks = launch_ranks(script, full, nproc, timeout)
        failed = [r.returncode for r in ranks if r.returncode != 0]
        result = RunResult(failed[0] if failed else 0, "".join(r.stdout for r in ranks),
                           "".join(r.stderr for r in ranks))
    assert result.returncode == 0, f"{script} {args} failed:\n{result.stdout}\n{result.stderr}"
    return result


def scalars(tensorboard_dir: Path, tag: str) -> dict[int, float]:
    """``{step: value}`` of one scalar tag (the last value written for each step)."""
    events = EventAccumulator(str(tensorboard_dir), size_guidance={"scalars": 0})
    events.Reload()
    if tag not in events.Tags()["scalars"]:
        raise KeyError(f"no scalar {tag!r} in {tensorboard_dir}: {events.Tags()['scalars']}")
    return {e.step: e.value for e in events.Scalars(tag)}


def assert_close(got: dict[int, float], want: dict[int, float], rtol: float, what: str) -> None:
    """Same iterations, each value within ``rtol`` (relative) of the reference."""
    assert got.keys() == want.keys(), f"{what}: steps {sorted(got)} != {sorted(want)}"
    for step in want:
        assert abs(got[step] - want[step]) <= rtol * abs(want[step]), (
            f"{what}: iteration {step}: {got[step]} vs {want[step]}")


def reference_curve(tensorboard_dir: Path, iters: int, min_drop: float) -> dict[int, float]:
    """The one-process GPT loss curve of ``iters`` iterations (the layouts' reference); it must
    fall by ``min_drop`` (else equality of curves would be vacuous)."""
    train("pretrain_gpt2.py", ["--train-iters", str(iters)], 1, tensorboard_dir)
    losses = scalars(tensorboard_dir, "lm loss")
    assert sorted(losses) == list(range(1, iters + 1))
    assert losses[iters] < losses[1] - min_drop, "the tiny model must learn"
    return losses


def free_port() -> int:
    """A TCP port that was free a moment ago (for MASTER_PORT)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_ranks(script: str, args: list[str], world_size: int,
                 timeout: float = 120) -> list[RunResult]:
    """Start ``world_size`` ranks by hand (torchrun's environment, no supervisor that kills
    siblings), so each rank's own exit status and stderr can be checked; under NCCL's
    point-to-point rules on gloo, as :func:`launch`. Each rank writes to files, not pipes (a
    rank blocked on a full pipe could stall the world). The ranks that failed make the others
    exit themselves (the framework's fail-fast); past ``timeout`` every rank still running is
    killed."""
    port = str(free_port())
    runs = []
    for rank in range(world_size):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, **{NCCL_SEMANTICS_ENV: "1"})
        runs.append((str(ROOT / script), args, env))
    return _run_forked(runs, timeout)


def launch_forked(script: str, args: list[str], nproc: int, timeout: float = 180
                  ) -> RunResult:
    """:func:`launch` of ``nproc`` ranks without torchrun: the ranks forked by hand
    (:func:`launch_ranks`; torchrun's agent and a fresh interpreter per rank cost a run
    seconds), their outputs joined in rank order, the exit code the first failed rank's (0 when
    every rank succeeded). For the runs that need a world, not torchrun itself."""
    ranks = launch_ranks(script, args, nproc, timeout)
    failed = [r.returncode for r in ranks if r.returncode != 0]
    return RunResult(failed[0] if failed else 0, "".join(r.stdout for r in ranks),
                     "".join(r.stderr for r in ranks))
