"""End-to-end: ``pretrain_gpt2.py`` with MoE flags. Chimera D=2 x W=2 with expert parallelism
EP=2 (all-to-all dispatch, distributed optimizer) logs the one-process run's language-model
loss, load-balancing and z losses -- averaged over the MoE layers and per layer -- at every
iteration (fp32: 1e-5, summation order): the auxiliary losses do not change with the layout."""

from __future__ import annotations

import pytest

from .launcher import assert_close, scalars, train

pytestmark = [pytest.mark.functional, pytest.mark.slow]

MOE = ["--train-iters", "4", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-layer-freq", "2", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
       "--moe-expert-capacity-factor", "1.5", "--moe-per-layer-logging"]
EP = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera",
      "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
      "--use-distributed-optimizer"]
TAGS = ["lm loss", "load_balancing_loss", "z_loss", "load_balancing_loss layer 1",
        "load_balancing_loss layer 7", "z_loss layer 3"]


@pytest.mark.timeout(300)
def test_expert_parallel_chimera_logs_the_one_process_losses(tmp_path):
    train("pretrain_gpt2.py", MOE, 1, tmp_path / "one")
    train("pretrain_gpt2.py", [*MOE, *EP], 4, tmp_path / "ep", timeout=240)
    for tag in TAGS:
        want = scalars(tmp_path / "one", tag)
        assert sorted(want) == [1, 2, 3, 4], tag
        assert_close(scalars(tmp_path / "ep", tag), want, 1e-5, tag)
