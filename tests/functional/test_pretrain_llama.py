"""End to end with Megatron's decoder flags: ``pretrain_gpt2.py`` with RMSNorm, SwiGLU,
grouped-query attention, bias-free linears, RoPE (base 500000, Llama 3.1 scaling, positions reset
per document) and an untied head reproduces the one-process loss curve (1e-5 relative, fp32,
dropout 0) under T=2 + --sequence-parallel x Chimera D=2 and under Chimera-ZB D=4, and a run
resumed from the one-process checkpoint of iteration 5 under T=2 continues on that curve."""

from __future__ import annotations

from pathlib import Path

import pytest

from .launcher import assert_close, scalars, train

pytestmark = [pytest.mark.functional, pytest.mark.slow]

RTOL = 1e-5
LLAMA = ("--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --ffn-hidden-size 128 "
         "--group-query-attention --num-query-groups 2 --disable-bias-linear "
         "--position-embedding-type rope --rotary-base 500000 --use-rope-scaling "
         "--untie-embeddings-and-output-weights --reset-position-ids --train-iters 10").split()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process: the loss curve and a checkpoint at iterations 5 and 10."""
    root = tmp_path_factory.mktemp("llama-reference")
    train("pretrain_gpt2.py", [*LLAMA, "--save", str(root / "ckpt"), "--save-interval", "5"],
          1, root / "tb")
    losses = scalars(root / "tb", "lm loss")
    assert sorted(losses) == list(range(1, 11))
    assert losses[10] < losses[1] - 0.1, "the tiny model must learn (else equality is vacuous)"
    return losses, root / "ckpt"


@pytest.mark.timeout(300)
def test_t2_sequence_parallel_chimera_d2(reference, tmp_path):
    losses, _ = reference
    train("pretrain_gpt2.py", [*LLAMA, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                               "--pipeline-model-parallel-size", "2",
                               "--pipeline-schedule", "chimera"], 4, tmp_path / "tb",
          timeout=280)
    assert_close(scalars(tmp_path / "tb", "lm loss"), losses, RTOL, "T=2 +SP Chimera D=2")


@pytest.mark.timeout(300)
def test_chimera_zb_d4(reference, tmp_path):
    losses, _ = reference
    train("pretrain_gpt2.py", [*LLAMA, "--pipeline-model-parallel-size", "4",
                               "--pipeline-schedule", "chimera-zb"], 4, tmp_path / "tb",
          timeout=280)
    assert_close(scalars(tmp_path / "tb", "lm loss"), losses, RTOL, "Chimera-ZB D=4")


@pytest.mark.timeout(300)
def test_resume_under_t2(reference, tmp_path):
    losses, checkpoints = reference
    copy = tmp_path / "ckpt"
    _copy_iteration(checkpoints, copy, 5)
    train("pretrain_gpt2.py", [*LLAMA, "--tensor-model-parallel-size", "2",
                               "--pipeline-model-parallel-size", "2", "--load", str(copy)],
          4, tmp_path / "tb", timeout=280)
    assert_close(scalars(tmp_path / "tb", "lm loss"),
                 {k: v for k, v in losses.items() if k > 5}, RTOL, "T=2 D=2 1F1B resumed")


def _copy_iteration(source: Path, target: Path, iteration: int) -> None:
    """A checkpoint directory holding ``source``'s iteration ``iteration`` as the latest."""
    import shutil

    shutil.copytree(source, target)
    assert (target / f"iter_{iteration:07d}").is_dir()
    (target / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
