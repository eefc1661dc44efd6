"""End-to-end: Megatron's data-parallel flags on Chimera, and checkpoints across optimizer layouts.

``--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather`` with small buckets
on Chimera D=4 x W=2 (8 ranks) trains the tiny GPT to the one-process losses; its checkpoint
resumes on 1F1B D=2 without the distributed optimizer, and a 1F1B checkpoint resumes on the
sharded Chimera run, both continuing the one-process curve (fp32: 1e-5, summation order).
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


def _first_half(reference: dict[int, float]) -> dict[int, float]:
    return {k: v for k, v in reference.items() if k <= 5}


def _second_half(reference: dict[int, float]) -> dict[int, float]:
    return {k: v for k, v in reference.items() if k > 5}


@pytest.mark.timeout(420)
def test_sharded_chimera_matches_one_process_and_resumes_on_1f1b(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    train("pretrain_gpt2.py", [*ITERS, *CHIMERA_SHARDED, "--save", str(ckpt),
                               "--exit-interval", "5"], 8, tmp_path / "sharded", timeout=300)
    assert_close(scalars(tmp_path / "sharded", "lm loss"), _first_half(reference), RTOL,
                 "Chimera D=4 x W=2, distributed optimizer")
    train("pretrain_gpt2.py", [*ITERS, *ONE_F_ONE_B, "--load", str(ckpt)], 2,
          tmp_path / "resumed")
    assert_close(scalars(tmp_path / "resumed", "lm loss"), _second_half(reference), RTOL,
                 "1F1B D=2 resumed from the sharded checkpoint")


@pytest.mark.timeout(420)
def test_local_checkpoint_resumes_on_sharded_chimera(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    train("pretrain_gpt2.py", [*ITERS, *ONE_F_ONE_B, "--save", str(ckpt),
                               "--exit-interval", "5"], 2, tmp_path / "local")
    assert_close(scalars(tmp_path / "local", "lm loss"), _first_half(reference), RTOL,
                 "1F1B D=2")
    train("pretrain_gpt2.py", [*ITERS, *CHIMERA_SHARDED, "--load", str(ckpt)], 8,
          tmp_path / "resumed", timeout=300)
    assert_close(scalars(tmp_path / "resumed", "lm loss"), _second_half(reference), RTOL,
                 "Chimera D=4 x W=2 with the distributed optimizer, resumed")


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
