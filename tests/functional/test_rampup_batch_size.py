"""End-to-end: --rampup-batch-size under Chimera (D=4, 2 pipes) and 1F1B (D=2) gives the losses
of one process with the same ramp, across a resume in the middle of the ramp.

The ramp 4 -> 16 in steps of 4 over 48 samples runs N = 4, 4, 4, 4, 8, 8, 12, 12, then 16
(Megatron's rule; 120 samples = 12 iterations). Chimera D=4 saves at iteration 5 (N = 8, the
ramp half done); a 1F1B D=2 run resumed from that checkpoint (another layout) repeats
iterations 6..12 of one process up to float summation order (RTOL as the layout tests: 1e-5):
a ramp restored at the wrong point would change the batch sizes and the losses.
"""

from __future__ import annotations

import re

import pytest

from .launcher import assert_close, scalars, train

pytestmark = [pytest.mark.functional, pytest.mark.slow]

RAMP = ["--num-layers", "4", "--hidden-size", "32", "--global-batch-size", "16",
        "--train-samples", "120", "--rampup-batch-size", "4", "4", "48", "--log-interval", "1"]
CHIMERA = ["--pipeline-model-parallel-size", "4", "--chimera-pipes", "2"]
ONE_F_ONE_B = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b"]
RTOL = 1e-5
BATCHES = [4, 4, 4, 4, 8, 8, 12, 12, 16, 16, 16, 16]


@pytest.mark.timeout(400)
def test_rampup_matches_one_process_across_a_resume(tmp_path):
    one = train("pretrain_gpt2.py", RAMP, 1, tmp_path / "tb-one")
    reference = scalars(tmp_path / "tb-one", "lm loss")
    assert sorted(reference) == list(range(1, 13))
    sizes = [int(b) for b in re.findall(r"global batch size: +(\d+)", one.stdout)]
    assert sizes == BATCHES and scalars(tmp_path / "tb-one", "batch-size") == \
        {i + 1: float(b) for i, b in enumerate(BATCHES)}

    ckpt = tmp_path / "ckpt"
    train("pretrain_gpt2.py", [*RAMP, *CHIMERA, "--save", str(ckpt), "--save-interval", "5"], 4,
          tmp_path / "tb-chimera")
    straight = scalars(tmp_path / "tb-chimera", "lm loss")
    assert_close(straight, reference, RTOL, "chimera D=4 ramp")

    (ckpt / "latest_checkpointed_iteration.txt").write_text("5\n")  # mid-ramp: N = 8
    resumed = train("pretrain_gpt2.py", [*RAMP, *ONE_F_ONE_B, "--load", str(ckpt)], 2,
                    tmp_path / "tb-1f1b")
    assert [int(b) for b in re.findall(r"global batch size: +(\d+)", resumed.stdout)] == \
        BATCHES[5:]
    assert_close(scalars(tmp_path / "tb-1f1b", "lm loss"),
                 {k: reference[k] for k in range(6, 13)}, RTOL, "1f1b D=2 resumed mid-ramp")
