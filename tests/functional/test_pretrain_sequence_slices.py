"""End to end with sequence-sliced pipelines: ``pretrain_gpt2.py --pipeline-sequence-slices k``
(k = 2 and 4) under Chimera, 1F1B and Chimera-ZB at D=2 reproduces the one-process run on the
whole sequences: training losses, gradient norms and the validation loss (1e-6 relative; fp32,
dropout 0, TensorBoard's float32 scalars round at 6e-8)."""

from __future__ import annotations

import pytest

from .launcher import assert_close, scalars, train

pytestmark = [pytest.mark.functional, pytest.mark.slow]

RTOL = 1e-6
FLAGS = ("--num-layers 4 --global-batch-size 4 --train-iters 3 --eval-iters 1 "
         "--eval-interval 3 --position-embedding-type rope --normalization RMSNorm").split()
TAGS = ("lm loss", "grad-norm", "lm loss validation")


@pytest.mark.timeout(300)
def test_sliced_pipelines_equal_one_process(tmp_path):
    train("pretrain_gpt2.py", FLAGS, 1, tmp_path / "one")
    reference = {tag: scalars(tmp_path / "one", tag) for tag in TAGS}
    assert sorted(reference["lm loss"]) == [1, 2, 3]
    for schedule, k in (("chimera", 2), ("1f1b", 4), ("chimera-zb", 4)):
        out = tmp_path / f"{schedule}-{k}"
        train("pretrain_gpt2.py", [*FLAGS, "--pipeline-model-parallel-size", "2",
                                   "--pipeline-schedule", schedule,
                                   "--pipeline-sequence-slices", str(k)], 2, out)
        for tag in TAGS:
            assert_close(scalars(out, tag), reference[tag], RTOL, f"{schedule} k={k} {tag}")


@pytest.mark.timeout(200)
def test_profile_rebuild_of_a_sliced_order_equals_one_process(tmp_path):
    """``--profile-iterations 1`` with ``--pipeline-sequence-slices 2`` (Chimera-ZB, D=2): after
    iteration 1 the measured per-stage costs rebuild the sliced order (logged), and the run stays
    on the one-process curve (a rebuild reorders, it never changes the arithmetic)."""
    train("pretrain_gpt2.py", FLAGS, 1, tmp_path / "one")
    reference = {tag: scalars(tmp_path / "one", tag) for tag in TAGS}
    result = train("pretrain_gpt2.py", [*FLAGS, "--pipeline-model-parallel-size", "2",
                                        "--pipeline-schedule", "chimera-zb",
                                        "--pipeline-sequence-slices", "2",
                                        "--profile-iterations", "1"], 2, tmp_path / "sliced")
    assert "schedule rebuild after iteration 1: measured F/B/W per stage" in result.stdout
    assert "chimera-zb-sliced" in result.stdout
    for tag in TAGS:
        assert_close(scalars(tmp_path / "sliced", tag), reference[tag], RTOL, f"rebuilt {tag}")
