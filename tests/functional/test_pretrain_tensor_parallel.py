"""End-to-end tensor parallelism: ``pretrain_gpt2.py --tensor-model-parallel-size 2
--pipeline-model-parallel-size 4 --chimera-pipes 2`` on 8 CPU ranks under torchrun, with
Megatron's data-parallel flags (``--use-distributed-optimizer``, sharded over the two pipes'
replicas of each tensor rank's shard, ``--overlap-grad-reduce`` with small buckets,
``--overlap-param-gather``), draws the one-process TensorBoard loss curve, and checkpoints move
between T = 1 and T = 2 both ways (with a vocabulary whose padding differs between them: 600
pads to 640 for one rank, 768 for two); test_data_parallel_flags.py moves them between the
distributed and the local optimizer.

The resumed runs start from iteration 5 of checkpoints written every 5 iterations (the tracker
is pointed back at iteration 5) and must continue on the one-process curve.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from .launcher import scalars, train
from .test_pretrain_layouts import assert_close

pytestmark = [pytest.mark.functional, pytest.mark.slow]

ITERS = ["--train-iters", "10", "--vocab-size", "600"]
RTOL = 1e-5
T2_D4_CHIMERA = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
                 "--chimera-pipes", "2"]
DATA_PARALLEL_FLAGS = ["--use-distributed-optimizer", "--overlap-grad-reduce",
                       "--overlap-param-gather", "--ddp-bucket-size", "20000"]


def _save(path: Path) -> list[str]:
    return ["--save", str(path), "--save-interval", "5"]


def _rewind(checkpoints: Path, iteration: int) -> None:
    """Point the tracker at an earlier saved iteration (both were written)."""
    assert (checkpoints / f"iter_{iteration:07d}").is_dir()
    (checkpoints / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process: the loss curve, and a T = 1 checkpoint at iterations 5 and 10."""
    root = tmp_path_factory.mktemp("tp-reference")
    train("pretrain_gpt2.py", [*ITERS, *_save(root / "ckpt")], 1, root / "tb")
    losses = scalars(root / "tb", "lm loss")
    assert sorted(losses) == list(range(1, 11))
    assert losses[10] < losses[1] - 0.1, "the tiny model must learn (else equality is vacuous)"
    return losses, root / "ckpt"


@pytest.mark.timeout(420)
def test_t2_chimera_d4_matches_one_process(reference, tmp_path):
    losses, _ = reference
    result = train("pretrain_gpt2.py", [*ITERS, *T2_D4_CHIMERA, *DATA_PARALLEL_FLAGS],
                   8, tmp_path / "tb", timeout=400)
    assert_close(scalars(tmp_path / "tb", "lm loss"), losses, RTOL,
                 "T=2 D=4 Chimera, distributed optimizer")
    assert "bubble ratio predicted:" in result.stdout


@pytest.mark.timeout(300)
def test_t1_checkpoint_resumes_with_t2_sequence_parallel(reference, tmp_path):
    losses, checkpoints = reference
    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoints, copy)
    _rewind(copy, 5)
    train("pretrain_gpt2.py", [*ITERS, "--tensor-model-parallel-size", "2",
                               "--pipeline-model-parallel-size", "2", "--sequence-parallel",
                               "--load", str(copy)], 4, tmp_path / "tb", timeout=280)
    assert_close(scalars(tmp_path / "tb", "lm loss"),
                 {k: v for k, v in losses.items() if k > 5}, RTOL,
                 "T=2 D=2 1F1B sequence parallel resumed")


@pytest.mark.timeout(600)
def test_async_sharded_checkpoint_resumes_on_t1_1f1b_d4(reference, tmp_path):
    """The issue's layout: T=2 x Chimera D=2 x W=2 with the distributed optimizer saves with
    --async-save (torch_dist); T=1 x 1F1B D=4 x W=2 resumes on the one-process curve."""
    losses, _ = reference
    sharded = ["--use-distributed-optimizer"]
    train("pretrain_gpt2.py", [*ITERS, "--tensor-model-parallel-size", "2",
                               "--pipeline-model-parallel-size", "2", "--chimera-pipes", "2",
                               *sharded, "--async-save", *_save(tmp_path / "ckpt")],
          8, tmp_path / "tb", timeout=400)
    assert_close(scalars(tmp_path / "tb", "lm loss"), losses, RTOL, "T=2 D=2 Chimera W=2")
    _rewind(tmp_path / "ckpt", 5)
    train("pretrain_gpt2.py", [*ITERS, "--pipeline-model-parallel-size", "4", *sharded,
                               "--load", str(tmp_path / "ckpt")], 8, tmp_path / "resumed",
          timeout=400)
    assert_close(scalars(tmp_path / "resumed", "lm loss"),
                 {k: v for k, v in losses.items() if k > 5}, RTOL, "T=1 D=4 1F1B W=2 resumed")
