"""End-to-end: Megatron's data-parallel flags on Chimera, and checkpoints across optimizer layouts.

``--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather`` with small buckets
on Chimera D=4 x W=2 (8 ranks) trains the tiny GPT to the one-process losses. One chain of runs
crosses the optimizer layouts both ways: a 1F1B D=2 checkpoint (local optimizer) resumes on the
sharded Chimera run, whose checkpoint resumes on 1F1B D=2 again, each piece continuing the
one-process curve (fp32: 1e-5, summation order).
"""

from __future__ import annotations

import pytest

from .launcher import assert_close, reference_curve, scalars, train

pytestmark = [pytest.mark.functional, pytest.mark.slow]

ITERS = ["--train-iters", "10"]
RTOL = 1e-5
CHIMERA_SHARDED = ["--pipeline-model-parallel-size", "4", "--chimera-pipes", "2",
                   "--use-distributed-optimizer", "--overlap-grad-reduce",
                   "--overlap-param-gather", "--accumulate-allreduce-grads-in-fp32",
                   "--ddp-bucket-size", "20000"]
ONE_F_ONE_B = ["--pipeline-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, whole model, local optimizer: the reference loss curve."""
    return reference_curve(tmp_path_factory.mktemp("one-process"), 10, min_drop=0.05)


def _iterations(reference: dict[int, float], first: int, last: int) -> dict[int, float]:
    return {k: v for k, v in reference.items() if first <= k <= last}


@pytest.mark.timeout(480)
def test_checkpoints_cross_between_local_and_sharded_optimizers(reference, tmp_path):
    local, sharded = tmp_path / "local-ckpt", tmp_path / "sharded-ckpt"
    train("pretrain_gpt2.py", [*ITERS, *ONE_F_ONE_B, "--save", str(local),
                               "--exit-interval", "3"], 2, tmp_path / "local")
    assert_close(scalars(tmp_path / "local", "lm loss"), _iterations(reference, 1, 3), RTOL,
                 "1F1B D=2")
    train("pretrain_gpt2.py", [*ITERS, *CHIMERA_SHARDED, "--load", str(local), "--save",
                               str(sharded), "--exit-interval", "6"], 8, tmp_path / "sharded",
          timeout=300)
    assert_close(scalars(tmp_path / "sharded", "lm loss"), _iterations(reference, 4, 6), RTOL,
                 "Chimera D=4 x W=2 with the distributed optimizer, resumed from 1F1B")
    train("pretrain_gpt2.py", [*ITERS, *ONE_F_ONE_B, "--load", str(sharded)], 2,
          tmp_path / "resumed")
    assert_close(scalars(tmp_path / "resumed", "lm loss"), _iterations(reference, 7, 10), RTOL,
                 "1F1B D=2 resumed from the sharded checkpoint")


@pytest.mark.timeout(300)
def test_bf16_sharded_chimera_tracks_fp32(reference, tmp_path):
    """bf16 parameters, fp32 buffers and fp32 main shards: within bf16's 2% of fp32."""
    train("pretrain_gpt2.py", [*ITERS, "--bf16", "--pipeline-model-parallel-size", "4",
                               "--chimera-pipes", "2", "--use-distributed-optimizer",
                               "--overlap-grad-reduce", "--ddp-bucket-size", "20000"], 4,
          tmp_path)
    bf16 = scalars(tmp_path, "lm loss")
    assert_close(bf16, reference, 2e-2, "bf16 vs fp32")
    assert bf16[10] < bf16[1] - 0.05
