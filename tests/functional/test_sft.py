"""pretrain_gpt2.py --sft under Chimera D=4 x W=2 with 2 sequences per micro-batch equals one
process that runs every conversation of each global batch on its own (fp32, plain SGD, every
iteration's loss within 1e-5 relative; the weights move). The reference is split-independent
(one conversation at a time), so this also covers a different micro-batch split. The 12-iteration
comparison over 1F1B, Chimera, ZBV, Chimera-ZB + SP, CP and slices is
``tools/check_sft_equality.py`` (docs/TRAINING.md). Packed variable-length SFT
(--variable-seq-lengths: micro-batches of their own lengths, loss masks carried) under 1F1B D=2
equals the same reference over its packing."""

from __future__ import annotations

import re

import pytest

from megatron_chimera.training.arguments import parse_args
from megatron_chimera.training.sft_reference import (
    SGD_FLAGS,
    global_batches,
    reference_losses,
    write_sft_dataset,
)
from megatron_chimera.training.training import build_tokenizer_for

from .launcher import launch_ranks, scalars

pytestmark = [pytest.mark.functional, pytest.mark.slow]

ITERS = 3
FLAGS = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 64 "
         "--max-position-embeddings 64 --global-batch-size 8 --lr 0.5 "
         "--tokenizer-type NullTokenizer --vocab-size 500 --hidden-dropout 0 "
         "--attention-dropout 0 --num-workers 0 --eval-iters 0 --log-interval 1 "
         f"--split 100,0,0 --distributed-timeout-minutes 1 --sft --train-iters {ITERS}").split()


@pytest.mark.timeout(300)
def test_sft_chimera_equals_every_conversation_alone(tmp_path):
    data = write_sft_dataset(str(tmp_path / "chat"), 120, 500, (4, 60), seed=1)
    flags = [*FLAGS, *SGD_FLAGS, "--data-path", data]
    ranks = launch_ranks("pretrain_gpt2.py", [
        *flags, "--micro-batch-size", "2", "--pipeline-model-parallel-size", "4",
        "--chimera-pipes", "2", "--tensorboard-dir", str(tmp_path / "tb")], 4, timeout=240)
    for rank in ranks:
        assert rank.returncode == 0, f"{rank.stdout}\n{rank.stderr}"
    losses = scalars(tmp_path / "tb", "lm loss")
    want = reference_losses([*flags, "--micro-batch-size", "1"], ITERS)
    assert sorted(losses) == list(range(1, ITERS + 1))
    for step, value in zip(range(1, ITERS + 1), want):
        assert abs(losses[step] - value) <= 1e-5 * value, (step, losses[step], value)
    assert abs(want[-1] - want[0]) > 1e-3 * want[0]  # the weights moved


@pytest.mark.timeout(200)
def test_packed_variable_length_sft_equals_every_conversation_alone(tmp_path):
    data = write_sft_dataset(str(tmp_path / "chat"), 80, 500, (4, 40), seed=1)
    flags = [*FLAGS, *SGD_FLAGS, "--data-path", data, "--micro-batch-size", "1",
             "--variable-seq-lengths", "--micro-batch-tokens", "48"]
    # Chimera D=2 x CP=2: rows padded to a multiple of 2 x CP, each document zigzag-split
    # (conversations of 4-40 tokens: shorter and longer than the 4 chunks of a split)
    ranks = launch_ranks("pretrain_gpt2.py", [
        *flags, "--pipeline-model-parallel-size", "2", "--chimera-pipes", "2",
        "--context-parallel-size", "2", "--tensorboard-dir", str(tmp_path / "tb")], 4,
        timeout=150)
    for rank in ranks:
        assert rank.returncode == 0, f"{rank.stdout}\n{rank.stderr}"
    losses = scalars(tmp_path / "tb", "lm loss")
    want = reference_losses(flags, ITERS)
    assert sorted(losses) == list(range(1, ITERS + 1))
    for step, value in zip(range(1, ITERS + 1), want):
        assert abs(losses[step] - value) <= 1e-5 * value, (step, losses[step], value)
    # the weights moved: the last loss is 50x the tolerance away from a frozen model's
    frozen = reference_losses([*flags, "--lr", "0"], ITERS)
    assert abs(want[-1] - frozen[-1]) > 5e-4 * frozen[-1]
    # tokens per second counts the packed tokens: x elapsed time = the global batch's inputs
    tokenizer, config = build_tokenizer_for(parse_args(flags, world_size=1))
    packed = [sum(len(ids) - 1 for ids, _ in conversations)
              for conversations in global_batches(config, tokenizer, ITERS)]
    logged = re.findall(r"elapsed time per iteration \(ms\): ([\d.]+) .* tokens per second: "
                        r"([\d.]+)", ranks[-1].stdout)
    assert len(logged) == ITERS
    for (ms, per_second), want_tokens in zip(logged, packed):
        assert float(ms) * float(per_second) / 1000 == pytest.approx(want_tokens, rel=1e-2)
