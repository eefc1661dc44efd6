"""An entry script's ranks as children forked from this process, on the CPU.

The runs of the equivalence checker (``tools/check_equivalence.py``) are small and many: a fresh
interpreter per rank (and one for torchrun) costs ~4 s of CPU in imports (torch, torch._dynamo,
the framework) against well under a second of training. Where no GPU is in play -- a CPU-only
torch, or ``CUDA_VISIBLE_DEVICES=""`` -- :func:`run_ranks` forks the ranks from this process
instead, after importing what they import once, and gives each the environment torchrun gives
its workers (rank, world size, the rendezvous address) with its own ``sys.argv``: the same runs
(each its own process and gloo rank) without the interpreter starts. As under torchrun, the first
rank to fail ends the others. CUDA keeps torchrun: a CUDA context does not survive a fork.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from pathlib import Path

RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "MASTER_ADDR", "MASTER_PORT")


def forkable() -> bool:
    """Whether the runs can be forked: no GPU can be used (a CPU-only torch build, or every GPU
    hidden). Asks no driver (a fork after the CUDA driver started is unsafe)."""
    import torch

    return os.environ.get("CUDA_VISIBLE_DEVICES") == "" or not (torch.version.cuda
                                                                 or torch.version.hip)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(script: str, argv: list[str], env: dict[str, str], log: int) -> None:
    """One forked rank: its output into ``log``, its environment and arguments, ``script`` as
    ``__main__``; killed with this process's parent (as torchrun's workers are)."""
    import runpy

    import torch

    from megatron_chimera.training.process import die_with_parent

    os.dup2(log, 1)
    os.dup2(log, 2)
    die_with_parent()
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS"):  # read at the interpreter's start: set it as that would
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def _wait(children: list, deadline: float) -> bool:
    """Until every child ended, one failed, or ``deadline``; the rest are killed. Whether it
    timed out (a child still running at the deadline, none failed)."""
    import multiprocessing.connection

    running = list(children)
    try:
        while running and time.monotonic() < deadline:
            multiprocessing.connection.wait([c.sentinel for c in running],
                                            deadline - time.monotonic())
            running = [c for c in running if c.exitcode is None]
            if any(c.exitcode for c in children):
                break
    finally:
        timed_out = bool(running) and not any(c.exitcode for c in children)
        for child in children:
            if child.exitcode is None:
                child.kill()
            child.join()
    return timed_out


def run_ranks(script: Path, argv: list[str], world_size: int, env: dict[str, str],
              timeout: float) -> tuple[int | None, str]:
    """Run ``script argv`` on ``world_size`` ranks forked from this process (see the module
    docstring); (the first failed rank's exit code, 0 when all succeeded, None on timeout; the
    ranks' output, interleaved)."""
    import multiprocessing

    import torch._dynamo  # noqa: F401 - torch.optim imports it at the first optimizer
    import torch.utils.tensorboard  # noqa: F401

    import megatron_chimera.training  # noqa: F401 - (the script's body runs only in the ranks)

    port = str(_free_port())
    env = {k: v for k, v in env.items() if k not in RANK_ENV}
    fork = multiprocessing.get_context("fork")
    with tempfile.TemporaryFile() as log:
        sys.stdout.flush()
        sys.stderr.flush()
        children = [fork.Process(target=_rank_main, args=(str(script), argv, dict(
            env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port) if world_size > 1 else env, log.fileno()))
            for r in range(world_size)]  # one rank: as ``python script``, no rank variables
        for child in children:
            child.start()
        timed_out = _wait(children, time.monotonic() + timeout)
        log.seek(0)
        output = log.read().decode(errors="replace")
    if timed_out:
        return None, output
    return next((c.exitcode for c in children if c.exitcode not in (0, -9)),
                next((c.exitcode for c in children if c.exitcode), 0)), output
