"""End-to-end: with the default dropout (0.1), resume is bitwise exact on every schedule, and
runs agree across layouts up to float summation order (keyed dropout, model/dropout_rng.py).

Each case trains 6 iterations saving at 3, points the checkpoint's tracker back at 3 and
resumes: iterations 4..6 must repeat bit for bit, and so must the weights at iteration 6. The
split-backward schedules profile their first 3 iterations and rebuild their order (the
default); the resumed run rebuilds from the costs its checkpoint recorded instead of profiling
again, so it runs the same order.

What a resume restores does not depend on the order of the actions, only on what the schedule
puts on a rank, so the cases are one per kind of rank state: one stage per rank (1F1B, with
fp16's loss scaler), virtual stages (interleaved), two replicas of opposite pipes with profiled
split-backward costs (Chimera-ZB, which also resumes onto BitPipe-ZB's chunks), V-shaped chunks
(ZBV) and both (BitPipe-ZB). GPipe, ZB-H1 and plain Chimera hold nothing the others do not (the
layout and exit-signal tests resume plain Chimera bit for bit without dropout, the test below
with it onto 1F1B); the distributed exactness tests run every schedule.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_chimera.checkpoint.sharded import read_full_tensors
from megatron_chimera.schedules.registry import SPLIT_BACKWARD_SCHEDULES

from .launcher import scalars, train

pytestmark = [pytest.mark.functional, pytest.mark.slow]

# dropout back on (TINY turns it off), a smaller model
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--num-layers", "4",
           "--hidden-size", "32", "--train-iters", "6", "--log-interval", "1"]
RTOL = 1e-5

SCHEDULES = {
    # virtual stages through Megatron's flag: 4 layers / D=2 / 1 layer each = 2 per rank
    "interleaved": ["--pipeline-schedule", "interleaved",
                    "--num-layers-per-virtual-pipeline-stage", "1"],
    # fp16: the dynamic loss scale doubles every 2 iterations (x2 at 2, 4, 6), so the resume
    # must restore the scaler's scale and growth tracker for iterations 4..6 to repeat
    "1f1b-fp16": ["--pipeline-schedule", "1f1b", "--fp16", "--initial-loss-scale", "65536",
                  "--loss-scale-window", "2", "--hysteresis", "1"],
    "chimera-zb": ["--pipeline-schedule", "chimera-zb", "--chimera-pipes", "2"],
    "zbv": ["--pipeline-schedule", "zbv"],
    "bitpipe-zb": ["--pipeline-schedule", "bitpipe-zb"],
}


def stage_tensors(checkpoint: Path, iteration: int) -> dict[str, torch.Tensor]:
    """Every model tensor of every stage file of one saved iteration, by global name."""
    tensors: dict[str, torch.Tensor] = {}
    directory = checkpoint / f"iter_{iteration:07d}"
    if (directory / ".metadata").exists():  # torch_dist (the default format)
        return {name[len("model/"):]: value
                for name, value in read_full_tensors(str(directory), prefix="model/")}
    for path in sorted(directory.glob("layers_*.pt")):
        tensors.update(torch.load(path, map_location="cpu", weights_only=True)["model"])
    assert tensors, f"no stage files under {checkpoint}"
    return tensors


def straight_then_resume(tmp_path: Path, nproc: int, flags: list[str],
                         resume_nproc: int | None = None,
                         resume_flags: list[str] | None = None) -> tuple[dict, dict, Path, Path]:
    """6 straight iterations (saving at 3 and 6), then 4..6 again from the iteration-3 save."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train("pretrain_gpt2.py", [*DROPOUT, *flags, "--save", str(straight), "--save-interval", "3"],
          nproc, tmp_path / "tb-straight")
    (straight / "latest_checkpointed_iteration.txt").write_text("3\n")
    train("pretrain_gpt2.py", [*DROPOUT, *(flags if resume_flags is None else resume_flags),
                               "--load", str(straight), "--save", str(resumed)],
          resume_nproc or nproc, tmp_path / "tb-resumed")
    return (scalars(tmp_path / "tb-straight", "lm loss"), scalars(tmp_path / "tb-resumed",
                                                                  "lm loss"), straight, resumed)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_resume_with_dropout_is_bitwise_exact(schedule, tmp_path):
    flags = ["--pipeline-model-parallel-size", "2", *SCHEDULES[schedule]]
    straight, resumed, ckpt_a, ckpt_b = straight_then_resume(tmp_path, 2, flags)
    assert sorted(resumed) == [4, 5, 6]
    assert resumed == {k: straight[k] for k in (4, 5, 6)}, (straight, resumed)
    if "--fp16" in flags:
        scale = scalars(tmp_path / "tb-straight", "loss-scale")
        assert scale[3] != scale[4] != 65536  # the scaler's state matters after the resume
        assert scalars(tmp_path / "tb-resumed", "loss-scale") == {k: scale[k] for k in (4, 5, 6)}
    a, b = stage_tensors(ckpt_a, 6), stage_tensors(ckpt_b, 6)
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"{schedule}: weights at iteration 6 differ: {different}"
    if schedule in SPLIT_BACKWARD_SCHEDULES:  # profiled, rebuilt after 3; the resume reused it
        record = common_args(ckpt_a, 3)["profiled_stage_costs"]
        assert record["costs"]["F"] and common_args(ckpt_b, 6)["profiled_stage_costs"] == record
    if schedule == "chimera-zb":
        # the same checkpoint (2 stages of 2 layers) resumed by BitPipe-ZB (4 half-size chunks
        # of 1 layer, two opposite V pipes) continues the curve up to float summation order
        train("pretrain_gpt2.py", [*DROPOUT, "--pipeline-model-parallel-size", "2",
                                   *SCHEDULES["bitpipe-zb"], "--load", str(ckpt_a)], 2,
              tmp_path / "tb-bitpipe")
        onto_chunks = scalars(tmp_path / "tb-bitpipe", "lm loss")
        assert sorted(onto_chunks) == [4, 5, 6]
        for step in (4, 5, 6):
            assert abs(onto_chunks[step] - straight[step]) <= RTOL * abs(straight[step]), (
                step, straight, onto_chunks)


def common_args(checkpoint: Path, iteration: int) -> dict:
    path = checkpoint / f"iter_{iteration:07d}" / "common.pt"
    return torch.load(path, map_location="cpu", weights_only=True)["args"]


@pytest.mark.timeout(400)
def test_dropout_agrees_across_layouts_and_resume_changes_layout(tmp_path):
    # Chimera D=4 with dropout equals one process with dropout (same masks: keyed by sample and
    # layer), and a Chimera checkpoint resumed by 1F1B D=2 continues the same curve.
    chimera = ["--pipeline-model-parallel-size", "4", "--chimera-pipes", "2"]
    straight, resumed, _, _ = straight_then_resume(
        tmp_path, 4, chimera, resume_nproc=2,
        resume_flags=["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b"])
    train("pretrain_gpt2.py", DROPOUT, 1, tmp_path / "tb-one")
    one = scalars(tmp_path / "tb-one", "lm loss")
    no_dropout = tmp_path / "tb-no-dropout"
    train("pretrain_gpt2.py", [*DROPOUT, "--hidden-dropout", "0", "--attention-dropout", "0"], 1,
          no_dropout)
    assert abs(scalars(no_dropout, "lm loss")[6] - one[6]) > 1e-3, "dropout must matter here"
    for step in one:
        assert abs(straight[step] - one[step]) <= RTOL * abs(one[step]), (step, straight, one)
    for step in (4, 5, 6):
        assert abs(resumed[step] - one[step]) <= RTOL * abs(one[step]), (step, resumed, one)
