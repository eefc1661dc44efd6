"""End to end with context parallelism: ``pretrain_gpt2.py --context-parallel-size 2`` (ring
attention, Llama-style decoder, documents masked with --reset-attention-mask) under Chimera D=2
reproduces the one-process loss curve (1e-5 relative, fp32, dropout 0), and its checkpoint of
iteration 2 resumes in one process (CP=1) on that curve."""

from __future__ import annotations

import shutil

import pytest

from .launcher import assert_close, scalars, train

pytestmark = [pytest.mark.functional, pytest.mark.slow]

RTOL = 1e-5
FLAGS = ("--normalization RMSNorm --swiglu --ffn-hidden-size 128 --group-query-attention "
         "--num-query-groups 2 --disable-bias-linear --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --reset-position-ids --reset-attention-mask "
         "--num-layers 4 --train-iters 4").split()


@pytest.mark.timeout(400)
def test_context_parallel_chimera_equals_one_process_and_resumes_into_cp1(tmp_path):
    train("pretrain_gpt2.py", FLAGS, 1, tmp_path / "one")
    reference = scalars(tmp_path / "one", "lm loss")
    assert sorted(reference) == list(range(1, 5))
    train("pretrain_gpt2.py", [*FLAGS, "--context-parallel-size", "2", "--cp-comm-type", "p2p",
                               "--pipeline-model-parallel-size", "2",
                               "--pipeline-schedule", "chimera",
                               "--save", str(tmp_path / "ckpt"), "--save-interval", "2"],
          4, tmp_path / "cp", timeout=280)
    assert_close(scalars(tmp_path / "cp", "lm loss"), reference, RTOL, "CP=2 Chimera D=2")
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "ckpt", resumed)
    (resumed / "latest_checkpointed_iteration.txt").write_text("2\n")
    train("pretrain_gpt2.py", [*FLAGS, "--load", str(resumed)], 1, tmp_path / "cp1")
    assert_close(scalars(tmp_path / "cp1", "lm loss"),
                 {k: v for k, v in reference.items() if k > 2}, RTOL, "CP=2 -> CP=1 resume")
