"""In-job restart: a job whose rank died restarts from its last complete checkpoint.

Under ``torchrun --max-restarts N`` (``TORCHELASTIC_RESTART_COUNT``) or a SLURM requeue
(``SLURM_RESTART_COUNT``) a restarted attempt loads ``--save`` when no ``--load`` is given, and
says what was lost: rank 0 of every attempt that may be restarted records the last finished
iteration under ``--save`` (a few bytes, atomically, after each iteration), so the next attempt
names the iterations since the checkpoint that it runs again.

For tests and drills, ``MEGATRON_CHIMERA_KILL_AT=RANK:ITERATION`` makes that rank ``kill -9``
itself after finishing that iteration (and its save), in the first attempt only.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Mapping

from megatron_chimera.atomic import atomic_write_text
from megatron_chimera.errors import UserError

RESTART_COUNT_ENVS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
PROGRESS_FILENAME = "last_finished_iteration.txt"
KILL_ENV = "MEGATRON_CHIMERA_KILL_AT"


def restart_count(env: Mapping[str, str] = os.environ) -> int:
    """How many times the launcher (torchrun, SLURM) has restarted this job (0: first attempt)."""
    return max((int(env[name]) for name in RESTART_COUNT_ENVS
                if env.get(name, "").strip().isdigit()), default=0)


def may_restart(env: Mapping[str, str] = os.environ) -> bool:
    """True when the launcher may restart this job (torchrun with ``--max-restarts`` > 0, a
    SLURM job that can be requeued, or an attempt that already is a restart)."""
    max_restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0").strip()
    return ((max_restarts.isdigit() and int(max_restarts) > 0) or "SLURM_RESTART_COUNT" in env
            or restart_count(env) > 0)


def restart_load(load: str | None, save: str | None,
                 env: Mapping[str, str] = os.environ) -> str | None:
    """The directory to resume from: ``--load``, else ``--save`` in a restarted attempt."""
    if load is not None or save is None or restart_count(env) == 0:
        return load
    return save


def record_progress(save: str | None, iteration: int) -> None:
    """Record ``iteration`` as the last one this attempt finished (under ``--save``)."""
    if save is not None and os.path.isdir(save):
        atomic_write_text(os.path.join(save, PROGRESS_FILENAME), f"{iteration}\n")


def recorded_progress(save: str | None) -> int | None:
    """The last iteration the previous attempt finished, when it recorded one."""
    if save is None:
        return None
    try:
        with open(os.path.join(save, PROGRESS_FILENAME)) as handle:
            text = handle.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def restart_report(count: int, load: str, resumed_iteration: int | None,
                   reached: int | None) -> str:
    """The log line of a restarted attempt: where it resumes and what is run again."""
    where = (f"iteration {resumed_iteration} of {load}" if resumed_iteration is not None
             else f"scratch (no checkpoint in {load} yet)")
    start = resumed_iteration or 0
    lost = ""
    if reached is not None and reached >= start:
        lost = (f"; the previous attempt finished iteration {reached}, so {reached - start} "
                f"iteration{'s' if reached - start != 1 else ''} since the checkpoint "
                f"{'are' if reached - start != 1 else 'is'} lost and run again")
    return f" restart {count} of this job: resuming from {where}{lost}"


def injected_kill(env: Mapping[str, str] = os.environ) -> tuple[int, int] | None:
    """``(rank, iteration)`` of the fault ``MEGATRON_CHIMERA_KILL_AT=RANK:ITERATION`` injects
    (None when unset or in a restarted attempt); UserError when it is malformed."""
    text = env.get(KILL_ENV, "").strip()
    if not text or restart_count(env) > 0:
        return None
    rank, _, iteration = text.partition(":")
    if not (rank.isdigit() and iteration.isdigit()):
        raise UserError(f"{KILL_ENV}={text}: expected RANK:ITERATION (two integers)")
    return int(rank), int(iteration)


def kill_if_injected(fault: tuple[int, int] | None, rank: int, iteration: int) -> None:
    """``kill -9`` this process when ``fault`` names this rank and iteration."""
    if fault is not None and fault == (rank, iteration):
        print(f" rank {rank}: {KILL_ENV} kills this rank (SIGKILL) after iteration {iteration}",
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def save_interval_advice(save_seconds: float, iteration_seconds: float, interval: int,
                         target: float = 0.01) -> str:
    """The log line after the first save: what ``--save-interval`` costs in time saving (the
    save's blocking part over the iterations between saves) and the smallest interval that
    keeps it within ``target``; a failure loses up to an interval of iterations."""
    cost = save_seconds / max(interval * iteration_seconds, 1e-9)
    smallest = max(1, math.ceil(save_seconds / max(target * iteration_seconds, 1e-9)))
    verdict = "within" if cost <= target else "over"
    return (f" save cost: {save_seconds:.2f} s blocking training per save, an iteration "
            f"{iteration_seconds * 1000:.0f} ms: --save-interval {interval} spends {cost:.1%} "
            f"of the time saving, {verdict} the {target:.0%} target (--save-interval {smallest} "
            f"or more meets it); a failure loses up to {interval} iterations")
