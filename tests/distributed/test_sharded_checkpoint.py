"""Sharded (torch_dist) checkpoints on 8 ranks: every rank writes and reads about its share, and a
checkpoint loads exactly into another layout (T, schedule, D, distributed-optimizer shards)."""

from __future__ import annotations

import json

import pytest

from .checkpoint_cases import run_sharded_io
from .harness import spawn_world

# the bound: no rank writes, or reads when resuming elsewhere, more than 1.25 x its share
SHARE_BOUND = 1.25


@pytest.mark.timeout(400)
def test_every_rank_writes_and_reads_its_share_and_the_load_is_exact(tmp_path):
    spawn_world(run_sharded_io, 8, str(tmp_path), timeout_s=380)
    io = json.loads((tmp_path / "io.json").read_text())
    share = io["size"] / 8
    print(f"checkpoint {io['size']} B; written per rank {io['written']}; "
          f"read per rank {io['read']}")
    assert all(w > 0 for w in io["written"]), "some rank wrote nothing: writes not spread"
    assert max(io["written"]) <= SHARE_BOUND * share, io
    assert max(io["read"]) <= SHARE_BOUND * share, io
