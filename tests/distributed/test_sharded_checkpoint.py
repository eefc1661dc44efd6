"""Sharded (torch_dist) checkpoints on 8 ranks: every rank writes and reads about its share, and a
checkpoint loads exactly into another layout (T, schedule, D, distributed-optimizer shards)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from megatron_chimera.checkpoint.checkpointing import checkpoint_dir, read_tracker
from megatron_chimera.checkpoint.sharded import read_full_tensors

from .checkpoint_cases import run_async_save_killed, run_sharded_io
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


@pytest.mark.timeout(200)
@pytest.mark.parametrize("victim,moment", [(1, "start"), (1, "write"), (0, "publish")])
def test_a_rank_killed_during_an_async_save_leaves_the_previous_checkpoint(tmp_path, victim,
                                                                           moment):
    outcomes = spawn_world(run_async_save_killed, 2, str(tmp_path), victim, moment,
                           timeout_s=150, pg_timeout_s=20, kill_on_failure=False)
    assert outcomes[victim].exitcode == -signal.SIGKILL, outcomes[victim]
    assert read_tracker(str(tmp_path)) == 1
    assert not os.path.isdir(checkpoint_dir(str(tmp_path), 2))
    expected = torch.load(tmp_path / "snapshot.pt", weights_only=True)
    got = dict(read_full_tensors(checkpoint_dir(str(tmp_path), 1)))
    assert got.keys() == expected.keys() and len(got) > 10
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
