"""Hang forensics: on SIGUSR1 every rank of a Chimera D=4 run logs what it does and training goes
on; then a rank is stopped (SIGSTOP): within the timeout plus a minute every other rank exits,
and the log names the stopped rank and what its peers wait for."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from multiprocessing.process import BaseProcess

import pytest

from megatron_chimera.parallel_state import NCCL_SEMANTICS_ENV
from megatron_chimera.pipeline.nccl_semantics import TIMEOUT_ENV
from tests.helpers.forked_scripts import start_script

from .launcher import ROOT, TINY, free_port

pytestmark = [pytest.mark.functional, pytest.mark.slow]

# the watch reports at 60% of it (10.8 s; an iteration here takes well under a second), leaving
# 7.2 s for the report (a report window of 1.8 s, then the exit) before gloo's own timeout
TIMEOUT_MINUTES = 0.3
STOPPED = 2


def _start(world_size: int, args: list[str], out_dir) -> list[BaseProcess]:
    """The ranks forked from the test server (no interpreter start-up each: they start
    together), each logging stdout and stderr to ``rank<r>.log``."""
    port = str(free_port())
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, **{NCCL_SEMANTICS_ENV: "1"},
                   # its own 10 s deadlock check would name the first stuck peer instead
                   **{TIMEOUT_ENV: "600"})
        log = out_dir / f"rank{rank}.log"
        log.write_text("")
        procs.append(start_script(ROOT / "pretrain_gpt2.py", args, env, ROOT, log, log))
    return procs


def _running(procs: list[BaseProcess]) -> bool:
    return all(p.exitcode is None for p in procs)


@pytest.mark.timeout(240)
def test_a_stopped_rank_is_named_and_every_other_rank_exits(tmp_path):
    cut = TINY.index("--distributed-timeout-minutes")
    args = TINY[:cut] + TINY[cut + 2:]
    args += ["--distributed-timeout-minutes", str(TIMEOUT_MINUTES), "--train-iters", "100000",
             "--log-interval", "1", "--pipeline-model-parallel-size", "4", "--chimera-pipes",
             "2"]
    procs = _start(4, args, tmp_path)
    logging_rank = tmp_path / "rank3.log"
    try:
        deadline = time.monotonic() + 120
        while " iteration        3/" not in logging_rank.read_text():
            assert time.monotonic() < deadline, logging_rank.read_text()[-3000:]
            assert _running(procs), logging_rank.read_text()[-3000:]
            time.sleep(0.5)
        os.kill(procs[1].pid, signal.SIGUSR1)  # on demand: every rank reports, nobody exits
        while "hang (SIGUSR1, reported by rank 1)" not in (tmp_path / "rank1.log").read_text():
            assert time.monotonic() < deadline and _running(procs)
            time.sleep(0.5)
        on_demand = {r: (tmp_path / f"rank{r}.log").read_text().count(" hang report: ")
                     for r in range(4)}
        os.kill(procs[STOPPED].pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        for rank, proc in enumerate(procs):
            if rank != STOPPED:
                proc.join(max(stopped_at + TIMEOUT_MINUTES * 60 + 60 - time.monotonic(), 0.1))
                if proc.exitcode is None:
                    raise subprocess.TimeoutExpired(f"rank {rank}", TIMEOUT_MINUTES * 60 + 60)
        elapsed = time.monotonic() - stopped_at
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
                proc.join()
    logs = {r: (tmp_path / f"rank{r}.log").read_text() for r in range(4)}
    assert elapsed < TIMEOUT_MINUTES * 60 + 60
    for rank in (0, 1, 3):
        assert procs[rank].exitcode != 0, logs[rank][-2000:]
        # every live rank logged its line: its last action and what it waits for -- or, when
        # rank 2 stopped after its part of the pipeline, the collective it waits in (outside it)
        head = f"hang report: rank {rank} (pipeline rank {rank}): "
        assert head + "last completed" in logs[rank] or (
            re.search(re.escape(head) + r"in iteration \d+ outside the pipeline \(collectives",
                      logs[rank])), logs[rank][-3000:]
        assert f"rank {STOPPED} did not report (stopped" in logs[rank], logs[rank][-3000:]
    assert on_demand == {0: 1, 1: 1, 2: 1, 3: 1}  # SIGUSR1: one line from every rank
    assert "hang report: rank 2 (pipeline rank 2)" in logs[STOPPED]
    joined = "\n".join(logs[r] for r in (0, 1, 3))
    # a peer says what it waits for from rank 2 -- a message, or (NCCL's rules: a device sync
    # or a first exchange) rank 2's side of a rendezvous -- or, when rank 2 stopped after its
    # part of the iteration, every live rank is in the loss gather, a collective that waits
    # for rank 2
    waits_for_stopped = (f"from rank {STOPPED} to run", f"for rank {STOPPED} (to run")
    in_collective = ("in gathering the losses to the logging rank (collective)",
                     "outside the pipeline (collectives")
    assert any(text in joined for text in waits_for_stopped) or all(
        any(text in logs[r] for text in in_collective) for r in (0, 1, 3)
    ), "\n".join(line for line in joined.splitlines() if "hang" in line)
