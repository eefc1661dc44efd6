"""Spawns a gloo world of local processes for a test and reports every rank's outcome.

Every world runs under NCCL's point-to-point rules unless a test opts out (``nccl_semantics``):
gloo alone forgives tag mismatches, early receives and first-use rendezvous.

Each rank runs ``fn(rank, world_size, *args)`` in a fresh process with a process group whose
timeout is bounded, writes its outcome (ok, or the traceback) to a file and exits. Ranks are
forked from a forkserver that imported torch once (8 ranks start in about a second, and none of
the pytest process's threads is inherited). The parent enforces a deadline; with
``kill_on_failure`` the first failure kills the other ranks and is raised as an AssertionError
naming the rank.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_chimera.parallel_state import NCCL_SEMANTICS_ENV
from tests.helpers.forked_scripts import forkserver_context


@dataclass
class RankOutcome:
    """Exit code and error text (empty when ok) of one rank."""

    rank: int
    exitcode: int | None
    error: str
    finished_at: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _worker(fn: Callable, rank: int, world_size: int, port: int, pg_timeout_s: float,
            outdir: str, nccl_semantics: bool, env: dict[str, str], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
                      **env)
    os.environ[NCCL_SEMANTICS_ENV] = "1" if nccl_semantics else "0"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result = Path(outdir) / f"rank{rank}"
    code = 0
    try:
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        fn(rank, world_size, *args)
        _write_atomic(result, "")
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent
        _write_atomic(result, traceback.format_exc())
        code = 1
    os._exit(code)  # no teardown: peers may be gone, and gloo's destructors could block


def spawn_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
    kill_on_failure: bool = True,
    nccl_semantics: bool = True,
    env: dict[str, str] | None = None,
) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return their outcomes.

    With ``kill_on_failure`` the first failing rank stops the world and its traceback is raised.
    ``nccl_semantics`` (default on) runs gloo under NCCL's rules
    (:mod:`megatron_chimera.pipeline.nccl_semantics`): tag-blind FIFO matching, a rendezvous at
    each direction's first exchange, device-wide syncs waiting for posted operations. ``env``:
    variables set in every rank (the ranks fork from a server started once, which does not see
    later changes of this process's environment).
    """
    import torch.distributed as dist

    ctx = forkserver_context()  # torch and the package imported once, in a clean server
    port = _free_port()
    # the store lives here, as torchrun's lives in its agent: it outlives any failing rank, so
    # the others can still read who failed first
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True,
                          timeout=datetime.timedelta(seconds=pg_timeout_s),
                          wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="mc_dist_") as outdir:
        procs = [
            ctx.Process(target=_worker,
                        args=(fn, r, world_size, port, pg_timeout_s, outdir, nccl_semantics,
                              env or {}, args))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        finished: dict[int, float] = {}
        deadline = time.monotonic() + timeout_s
        failed = False
        while len(finished) < world_size and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if r not in finished and p.exitcode is not None:
                    finished[r] = time.monotonic()
                    failed = failed or p.exitcode != 0
            if failed and kill_on_failure:
                break
            time.sleep(0.05)
        for p in procs:
            if p.exitcode is None:
                p.kill()
        for p in procs:
            p.join(timeout=10)
        outcomes = []
        for r, p in enumerate(procs):
            path = Path(outdir) / f"rank{r}"
            error = path.read_text() if path.exists() else "(no outcome: killed or timed out)"
            outcomes.append(RankOutcome(r, p.exitcode if r in finished else None, error,
                                        finished.get(r, float("inf"))))
    del store
    if kill_on_failure:
        errors = [o for o in outcomes if o.exitcode not in (0,) and o.finished_at < float("inf")]
        if errors:
            first = min(errors, key=lambda o: o.finished_at)
            raise AssertionError(f"rank {first.rank} failed:\n{first.error}")
        hung = [o.rank for o in outcomes if o.exitcode is None]
        if hung:
            raise AssertionError(f"ranks {hung} did not finish within {timeout_s} s")
    return outcomes
