"""Atomic file writes: a temp file beside the target, fsync, rename, fsync the directory.

The one helper every checkpoint, dataset index, tokenizer, plot and JSON output goes through, so
a crash leaves either the old file or the new one, never a partial one. Torch-free (usable from
the schedule IR and the tools).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import IO, Any


def temp_path_beside(path: str) -> str:
    """A unique temporary name next to ``path``, to be renamed onto it with ``os.replace``."""
    return f"{path}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def fsync_dir(path: str) -> None:
    """Make a rename inside directory ``path`` durable."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(tmp: str, path: str) -> None:
    """Rename the finished ``tmp`` onto ``path`` (usual 0666-less-umask mode) and fsync the
    directory."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write(path: str, write: Callable[[IO[Any]], None], mode: str = "wb") -> None:
    """Write ``path`` via ``write(file)`` into a temp file beside it, fsync, rename into place.

    ``mode`` is ``"wb"`` (bytes) or ``"w"`` (text). The temp file is removed on any failure.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_write mode must be 'wb' or 'w', got {mode!r}")
    tmp = temp_path_beside(path)
    try:
        with open(tmp, mode) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        replace_atomically(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    atomic_write(path, lambda handle: handle.write(text), mode="w")
