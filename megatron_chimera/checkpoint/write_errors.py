"""Checkpoint write and read failures as one line: DCP's wrapped per-rank exceptions unwrapped,
OSErrors in a staging directory named with the file. Kept apart from :mod:`.dcp_io` so the
``torch`` format and the loaders report errors without importing torch.distributed.checkpoint.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator

from megatron_chimera.errors import UserError


def failure_message(exc: BaseException) -> str:
    """One line for a failed DCP call: the first failing rank's own error (DCP wraps every
    rank's exception and traceback into one CheckpointException)."""
    failures = getattr(exc, "failures", None)
    if failures:
        rank, (inner, _trace) = min(failures.items(), key=lambda item: item[0])
        text = str(inner).strip().splitlines()
        return f"rank {rank}: {text[0] if text else type(inner).__name__}"
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class CheckpointWriteError(UserError):
    """A checkpoint that could not be written (a full disk, a quota, an I/O error); the message
    names the file and says that the previous checkpoint is kept."""


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind a failed save: ``exc`` itself or, in a CheckpointException, the first
    failing rank's."""
    if isinstance(exc, OSError):
        return exc
    for _rank, (inner, _trace) in sorted((getattr(exc, "failures", None) or {}).items(),
                                         key=lambda item: item[0]):
        if isinstance(inner, OSError):
            return inner
    return None


@contextlib.contextmanager
def write_errors_reported(staging: str, iteration: int, remove: bool) -> Iterator[None]:
    """Turn a failed write into the staging directory (``No space left on device`` and other
    OSErrors, on this rank or, through DCP, on another) into one CheckpointWriteError line
    naming the file; ``remove``: delete the unpublished staging directory then (frees the
    space; one rank does it)."""
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - DCP wraps every rank's failure
        error = _os_error(exc)
        if error is None:
            raise
        if remove:
            shutil.rmtree(staging, ignore_errors=True)
        where = error.filename or staging
        raise CheckpointWriteError(
            f"{error.strerror or error}: {where} (the checkpoint of iteration {iteration} was "
            f"not saved; the previous checkpoint is intact)") from None
