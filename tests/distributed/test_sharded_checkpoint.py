"""Sharded (torch_dist) checkpoints on 8 ranks: every rank writes and reads about its share, a
checkpoint loads exactly into another layout (T, schedule, D, distributed-optimizer shards) and
stock torch reads it (``dcp_to_torch_save``, ``dcp.load``) without our package; a disk that
fills during a save is named in one line and keeps the previous checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from megatron_chimera.checkpoint.checkpointing import checkpoint_dir, read_tracker
from megatron_chimera.checkpoint.safe_reader import CHECKSUMS, read_metadata
from megatron_chimera.checkpoint.sharded import read_full_tensors

from .checkpoint_cases import run_async_save_killed, run_disk_full, run_sharded_io
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
    _stock_torch_reads_it_bitwise(checkpoint_dir(str(tmp_path / "source"), 1), tmp_path)


STOCK_READER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "helpers",
                            "stock_dcp_reader.py")


def _stock_torch_reads_it_bitwise(checkpoint: str, tmp_path) -> None:
    """The T=2 x Chimera D=2 x W=2 distributed-optimizer checkpoint read by stock torch in a
    process that never imports megatron_chimera (``python -I``: no repository on sys.path)
    equals, tensor by tensor and bitwise, what our reader reads."""
    subprocess.run([sys.executable, "-I", STOCK_READER, checkpoint, str(tmp_path)], check=True,
                   timeout=120, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    infos = read_metadata(checkpoint).storage_data.values()  # every rank's chunks checksummed
    assert infos and all(getattr(info, CHECKSUMS, None) for info in infos)
    ours = dict(read_full_tensors(checkpoint))
    assert any(k.endswith("/exp_avg") for k in ours) and any(k.startswith("model/") for k in ours)
    for name in ("dcp_to_torch_save.pt", "dcp_load.pt"):
        stock = torch.load(tmp_path / name, weights_only=True)
        assert stock.keys() == ours.keys(), name
        for key, value in ours.items():
            assert stock[key].dtype == value.dtype and torch.equal(stock[key], value), (name, key)


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


@pytest.mark.timeout(120)
def test_a_disk_full_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    spawn_world(run_disk_full, 2, str(tmp_path), timeout_s=100, pg_timeout_s=20)
    staging = os.path.join(str(tmp_path), "iter_0000002.staging")
    expected = (f"No space left on device: {staging}/__1_0.distcp (the checkpoint of iteration 2 "
                "was not saved; the previous checkpoint is intact)")
    assert [(tmp_path / f"error_{r}.txt").read_text() for r in range(2)] == [expected] * 2
    assert read_tracker(str(tmp_path)) == 1 and not os.path.exists(staging)
    assert not os.path.isdir(checkpoint_dir(str(tmp_path), 2))
    expected = torch.load(tmp_path / "snapshot.pt", weights_only=True)
    got = dict(read_full_tensors(checkpoint_dir(str(tmp_path), 1)))
    assert got.keys() == expected.keys() and len(got) > 10
    assert all(torch.equal(got[name], value) for name, value in expected.items())
