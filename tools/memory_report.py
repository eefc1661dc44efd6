#!/usr/bin/env python
"""Print the per-rank memory a training command would use, without running it.

Example (Chimera D=4 with uneven stages, 8 ranks)::

    python tools/memory_report.py --world-size 8 --model gpt2 --num-layers 8 --hidden-size 1024 \\
        --num-attention-heads 16 --seq-length 1024 --micro-batch-size 2 --global-batch-size 64 \\
        --lr 1e-4 --train-iters 10 --pipeline-model-parallel-size 4 --chimera-pipes 2 \\
        --pipeline-model-parallel-layout "Et*3|t*2|t*2|tL" --bf16

Takes ``pretrain_gpt2.py`` / ``pretrain_bert.py``'s flags (checked as the entry script checks
them; without ``--data-path`` they run on mock data, with ``--vocab-size`` or the GPT-2 / BERT
vocabulary) and prints the stages (as a layout string) and, per pipeline rank, the predicted
weights, gradients, optimizer state, peak activations and pipeline receive buffers in MB -- the
prediction the training log prints beside its measurement after the first iteration.
"""

from __future__ import annotations

import sys

from megatron_chimera.errors import run_tool
from megatron_chimera.model.family import get_family
from megatron_chimera.model.stage_split import format_layout, stage_partition
from megatron_chimera.training.arguments import parse_args_and_schedule
from megatron_chimera.training.memory_report import predicted_memory

DEFAULT_VOCAB = {"gpt2": 50257, "bert": 30522}


def _take(argv: list[str], flag: str, default: str) -> tuple[str, list[str]]:
    """The value of ``flag`` (removed from ``argv``), or ``default``."""
    if flag in argv:
        i = argv.index(flag)
        if i + 1 >= len(argv):
            raise SystemExit(f"{flag} needs a value")
        return argv[i + 1], argv[:i] + argv[i + 2:]
    return default, argv


def main(argv: list[str] | None = None) -> int:
    """Parse the training flags, partition the model and print every rank's predicted memory."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    world, argv = _take(argv, "--world-size", "1")
    model, argv = _take(argv, "--model", "gpt2")
    device, argv = _take(argv, "--device", "cuda")
    if "--data-path" not in argv and "--mock-data" not in argv:
        argv.append("--mock-data")
    family = get_family(model)
    config, schedule = parse_args_and_schedule(
        argv, int(world), defaults={"vocab_size": DEFAULT_VOCAB[family.name]})
    parallel = config.parallel
    method = config.training.partition_method
    partition = stage_partition(config.training.layer_split,
                                "uniform" if method == "time" else method, config.model,
                                family, schedule.num_stages,
                                parallel.pipeline_model_parallel_size)
    print(f"{family.title}: {schedule.describe()}, T={parallel.tensor_model_parallel_size} "
          f"W={parallel.data_parallel_size}; stages {format_layout(partition)}"
          + (" (--partition-method time is measured at run time: uniform shown)"
             if method == "time" else ""))
    for rank, figures in enumerate(predicted_memory(config, family, schedule, partition,
                                                    device)):
        print(f" pipeline rank {rank} (stages {sorted(schedule.stages_of_rank(rank))}) memory "
              f"(MB): {figures.line()}")
    return 0


if __name__ == "__main__":
    run_tool(main)
