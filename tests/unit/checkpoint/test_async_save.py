"""AsyncCheckpointer: one save in the background at a time, its error re-raised by wait, the
objects alive at the first save out of the garbage collector's full collections."""

from __future__ import annotations

import gc

import pytest

from megatron_chimera.checkpoint.async_save import AsyncCheckpointer


class _Job:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.frozen, self.final = fail, None, "ckpt/iter_0000001"

    def run(self, barrier, group) -> str:
        self.frozen = gc.get_freeze_count()
        if self.fail:
            raise OSError("disk full")
        return self.final


@pytest.fixture(autouse=True)
def _unfreeze():
    yield
    gc.unfreeze()  # leave the collector as other tests expect it


def test_the_objects_alive_at_the_first_save_are_frozen_once():
    gc.unfreeze()
    saver, job, done = AsyncCheckpointer(group=None), _Job(), []
    saver.start(job, done.append)
    assert saver.wait() == job.final and done == [job]
    assert job.frozen > 0  # a full collection in the writer skips them
    frozen, later = gc.get_freeze_count(), _Job()
    made_since = [[] for _ in range(1000)]
    saver.start(later)
    saver.wait()
    assert later.frozen == frozen and made_since  # frozen once: later objects stay collectable


def test_wait_raises_the_writer_error_once():
    saver = AsyncCheckpointer(group=None)
    saver.start(_Job(fail=True))
    with pytest.raises(OSError, match="disk full"):
        saver.wait()
    assert saver.wait() is None
