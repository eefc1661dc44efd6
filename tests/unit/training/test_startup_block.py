"""The start-up block names the layout, the expert groups and the schedule that took effect."""

from __future__ import annotations

from megatron_chimera.training.arguments import parse_args_and_schedule
from megatron_chimera.training.monitor import predicted_bubble_ratio
from megatron_chimera.training.startup_block import startup_block

FLAGS = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
         "--micro-batch-size 1 --global-batch-size 8 --train-iters 1 --lr 1e-3 --mock-data "
         "--vocab-size 128 --hidden-dropout 0 --attention-dropout 0 "
         "--pipeline-model-parallel-size 2 --pipeline-schedule chimera --chimera-pipes 2 "
         "--num-experts 4 --moe-router-topk 2 "
         "--expert-model-parallel-size 2 --bf16 --recompute-granularity full "
         "--recompute-method uniform --recompute-num-layers 1")


def block(flags: str, world_size: int) -> tuple[str, object]:
    config, schedule = parse_args_and_schedule(flags.split(), world_size=world_size)
    bubble = predicted_bubble_ratio(schedule)
    return "\n".join(startup_block(config, schedule, world_size, bubble)), schedule, bubble


def test_the_block_names_t_cp_d_w_ep_the_schedule_and_n():
    # MoE with CP > 1 is refused for now, so CP and EP are shown by two Chimera runs
    text, _, _ = block(FLAGS.replace("--num-experts 4 --moe-router-topk 2 --expert-model-"
                                     "parallel-size 2", "--context-parallel-size 2"), 8)
    assert " layout: world 8 = T 1 x CP 2 x D 2 x W 2 " in text and "experts" not in text, text
    text, schedule, bubble = block(FLAGS + " --tensor-model-parallel-size 2 --sequence-parallel", 8)
    assert " layout: world 8 = T 2 x CP 1 x D 2 x W 2 " in text, text
    assert " experts: 4 (top-2), EP 2 x expert-data 2 per pipeline rank" in text, text
    assert f"schedule: chimera, 2 pipes, N = {schedule.num_microbatches} micro-batches" in text
    assert f"predicted bubble {bubble:.2f}" in text and "precision bf16" in text, text
    assert "recomputation full (uniform, 1 layers)" in text, text
    assert "distributed optimizer off" in text and "sequence slices 1" in text, text
