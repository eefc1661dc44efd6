"""Who died: heartbeats in the store name the rank that stopped beating without leaving."""

from __future__ import annotations

import threading

import torch.distributed as dist

from megatron_chimera.pipeline import failures


def test_silent_ranks_names_the_rank_whose_heartbeat_stopped():
    """Ranks 0, 1 and 3 keep beating (3 after leaving on purpose, 1 by marking itself left
    midway), rank 2 beat and then stopped, rank 4 never beat: only rank 2 is named."""
    store = dist.HashStore()
    for rank in range(4):
        failures.heartbeat(store, rank)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.05):
            failures.heartbeat(store, 0)
            failures.heartbeat(store, 3)

    thread = threading.Thread(target=beat)
    thread.start()
    failures.mark_left(1, store)
    try:
        assert failures.silent_ranks(5, rank=0, store=store, wait_s=0.6) == [2]
    finally:
        stop.set()
        thread.join()
    # a rank that beats again was only slow; with nobody silent the watch ends at once
    failures.heartbeat(store, 2)
    assert failures.silent_ranks(3, rank=2, store=store, wait_s=0.6) == [0]  # 0 stopped now
    assert failures.silent_ranks(2, rank=0, store=None) == []  # no store: nobody to ask
