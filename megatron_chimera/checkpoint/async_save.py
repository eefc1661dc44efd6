"""``--async-save``: a ``torch_dist`` checkpoint written in the background while training goes on.

The save's state is captured at its iteration in host memory of its own
(:func:`.checkpointing.prepare_sharded_save` with ``copy``); a thread then writes it with DCP and
publishes it (staging directory, barrier, rename, tracker). The thread's collectives run on a
process group of their own (gloo), so they never interleave with the training's. One save is in
flight at a time: the next save and the end of training wait for it. A rank killed during the
write leaves the staging directory unpublished: the tracker still names the previous checkpoint.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from megatron_chimera.checkpoint.checkpointing import SaveJob


class AsyncCheckpointer:
    """Runs one :class:`SaveJob` at a time in the background over ``group``."""

    def __init__(self, group: Any) -> None:
        # the torch_dist writer and torch.distributed.checkpoint (about 1 s of CPU) are imported
        # now: the first save's capture must not pay it inside a training step
        import megatron_chimera.checkpoint.sharded  # noqa: F401

        self.group = group
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._path: str | None = None
        self._froze = False

    def start(self, job: SaveJob, on_done: Callable[[SaveJob], None] | None = None) -> None:
        """Wait for the previous save, then write ``job`` in the background; ``on_done(job)``
        runs in the background once it is published."""
        self.wait()

        def write() -> None:
            try:
                self._path = job.run(lambda: dist.barrier(group=self.group), self.group)
                if on_done is not None:
                    on_done(job)
            except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
                self._error = exc

        if not self._froze:
            # A full garbage collection in the writer would traverse every object of the
            # process (~0.2 s of CPU here) holding the GIL the training thread needs. The
            # objects alive at the first save -- the imports, the model, the optimizer -- are
            # moved out of the collector's reach once, so later full collections (in either
            # thread) see only what was made since. They are still freed when their last
            # reference goes; only cycles among them that die later are never collected.
            gc.freeze()
            self._froze = True
        self._thread = threading.Thread(target=write, name="async-save", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        """Whether a save is being written."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> str | None:
        """Block until the save in flight is published; returns its directory (None when there
        was none) and raises its error, if it failed."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self._path
