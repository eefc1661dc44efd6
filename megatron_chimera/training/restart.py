"""In-job restart: a job whose rank died restarts from its last complete checkpoint.

Under ``torchrun --max-restarts N`` (``TORCHELASTIC_RESTART_COUNT``) or a SLURM requeue
(``SLURM_RESTART_COUNT``) a restarted attempt loads ``--save`` when no ``--load`` is given, and
says what was lost: rank 0 of every attempt that may be restarted records the last finished
iteration under ``--save`` (a few bytes, atomically, after each iteration), so the next attempt
names the iterations since the checkpoint that it runs again.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from megatron_chimera.atomic import atomic_write_text

RESTART_COUNT_ENVS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
PROGRESS_FILENAME = "last_finished_iteration.txt"


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
