"""Real CPU run of sequence-sliced Chimera against unsliced Chimera (issue #42's last check).

Run under torchrun, one process per pipeline rank (D ranks, gloo)::

    torchrun --nproc-per-node 4 tools/benchmark_sequence_slices.py --seq-length 2048 \\
        --sequences 2 --slices 4

A tiny GPT (``--hidden-size``, ``--num-layers``, one micro-batch of one sequence each) trains
with real compute: forward, backward, gradients (no optimizer step: the same for both). Per
iteration the time is the slowest rank's (an all-reduce MAX after a barrier). The two rows take
turns ``--rounds`` times (``--iters`` iterations each, after one warm-up), so load from other
processes falls on both alike; the medians and their ratio are printed, with the compute-busy
seconds summed over the ranks, the cores they kept busy on average (``busy / time``) and the
pipeline idle share ``1 - busy / (D x time)``; last the simulator's makespan ratio on D devices
for the same two orders (F = 1, B = 2, slices costed by their attention work).

On fewer cores than ranks the measured ratio is bounded by the cores: unsliced Chimera with one
sequence per pipe already keeps two ranks busy at every moment (each pipe's sequence is always on
one stage), so on a 2-core machine it saturates both cores and slicing cannot shorten it; the
check needs at least D cores (docs/LONG_SEQUENCES.md has the figures).

The unsliced row is ``--pipeline-schedule chimera`` itself (``chimera(D, N)``): with fewer
sequences than stages (N < D, a multiple of the pipes) it is the basic unit's slot order with
each pipe's other micro-batches removed -- at N = 2, one sequence per pipe
(``schedules/chimera.py``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pretrain_gpt2  # noqa: E402
from megatron_chimera import parallel_state  # noqa: E402
from megatron_chimera.config import ModelConfig  # noqa: E402
from megatron_chimera.errors import ToolArgumentParser, run_tool  # noqa: E402
from megatron_chimera.model.partition import partition_layers  # noqa: E402
from megatron_chimera.model.sequence_slices import split_into_slices  # noqa: E402
from megatron_chimera.pipeline.executor import Gradients, PipelineExecutor, StageWork  # noqa: E402
from megatron_chimera.pipeline.topology import PipelineTopology  # noqa: E402
from megatron_chimera.schedules.actions import Schedule  # noqa: E402
from megatron_chimera.schedules.chimera import chimera  # noqa: E402
from megatron_chimera.schedules.simulate import CostModel, simulate  # noqa: E402
from megatron_chimera.schedules.slices import sliced_schedule  # noqa: E402
from megatron_chimera.schedules.validate import validate  # noqa: E402
from megatron_chimera.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402

VOCAB = 256


def parse_args() -> argparse.Namespace:
    """The benchmark's flags."""
    parser = ToolArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--sequences", type=int, default=2, help="sequences per iteration (N)")
    parser.add_argument("--slices", type=int, default=4, help="k of the sliced row")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--num-layers", type=int, default=0,
                        help="layers (default: 2 per pipeline rank)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args()


def batch(seq: int, index: int) -> dict[str, torch.Tensor]:
    """One deterministic GPT micro-batch of one sequence."""
    g = torch.Generator().manual_seed(1000 + index)
    return {"text": torch.randint(0, VOCAB, (1, seq + 1), generator=g),
            "loss_mask": torch.ones(1, seq), "position_ids": torch.arange(seq).view(1, seq)}


def executor_for(schedule: Schedule, modules: dict, config: ModelConfig) -> PipelineExecutor:
    """A training executor of ``schedule`` over this rank's stage ``modules``."""
    seq = config.seq_length // schedule.sequence_slices
    return PipelineExecutor(schedule, PipelineTopology.from_parallel_state(),
                            StageWork(modules, pretrain_gpt2.forward_step,
                                      (seq, 1, config.hidden_size), torch.float32),
                            Gradients(loss_scale_divisor=schedule.num_sequences))


def timed(executor: PipelineExecutor, schedule: Schedule, modules: dict,
          sequences: list[dict]) -> tuple[float, float]:
    """(slowest rank's seconds, this rank's compute-busy seconds) of one iteration."""
    k = schedule.sequence_slices
    units = ([u for b in sequences for u in split_into_slices(b, k)] if k > 1
             else list(sequences))
    for module in modules.values():
        module.zero_grad(set_to_none=True)
    dist.barrier()
    start = time.perf_counter()
    result = executor.run(units)
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    busy = executor.gather([result])
    return float(elapsed), busy


def main() -> None:
    """Build both orders over one set of groups and stages, time them in turns, print."""
    args = parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    ranks = dist.get_world_size()
    slices = sliced_schedule("chimera", ranks, args.sequences, args.slices,
                             attention_fraction=args.seq_length
                             / (args.seq_length + 12 * args.hidden_size))
    unsliced = chimera(ranks, args.sequences)
    for s in (slices, unsliced):
        validate(s)
    parallel_state.initialize_model_parallel(ranks, slices.placement, slices.num_stages,
                                             timeout=datetime.timedelta(minutes=10))
    model_parallel_cuda_manual_seed(1234)
    layers = args.num_layers or 2 * ranks
    config = ModelConfig(num_layers=layers, hidden_size=args.hidden_size,
                         num_attention_heads=args.num_attention_heads,
                         seq_length=args.seq_length, max_position_embeddings=args.seq_length,
                         vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0)
    partition = partition_layers(layers, slices.num_stages)
    prank = parallel_state.get_pipeline_model_parallel_rank()
    last = slices.num_stages - 1
    modules = {s: pretrain_gpt2.model_provider(config, 11, pre_process=s == 0,
                                               post_process=s == last, layer_range=partition[s],
                                               stage=s)
               for s in slices.stages_of_rank(prank)}
    rows = {"chimera, unsliced": unsliced,
            f"chimera, --pipeline-sequence-slices {args.slices}": slices}
    executors = {name: executor_for(s, modules, config) for name, s in rows.items()}
    sequences = [batch(args.seq_length, i) for i in range(args.sequences)]
    times: dict[str, list[float]] = {name: [] for name in rows}
    work: dict[str, list[float]] = {name: [] for name in rows}
    for name, s in rows.items():  # warm-up
        timed(executors[name], s, modules, sequences)
    for _ in range(args.rounds):
        for name, s in rows.items():
            for _ in range(args.iters):
                seconds, gathered = timed(executors[name], s, modules, sequences)
                times[name].append(seconds)
                if gathered:
                    work[name].append(sum(gathered[0].busy_seconds_per_rank))
    gathered_work = [None]
    if dist.get_rank() == ranks - 1:
        gathered_work = [work]
    dist.broadcast_object_list(gathered_work, src=ranks - 1)
    if dist.get_rank() == 0:
        work = gathered_work[0]
        print(f"D={ranks}, {args.sequences} sequences of {args.seq_length} tokens per iteration, "
              f"hidden {args.hidden_size}, {layers} layers, {os.cpu_count()} CPUs, "
              f"{args.rounds} rounds x {args.iters} iterations")
        medians = {}
        for name in rows:
            medians[name] = statistics.median(times[name])
            busy = statistics.median(work[name])
            print(f"  {name:54s} {medians[name] * 1e3:8.1f} ms/iter | busy over ranks "
                  f"{busy * 1e3:8.1f} ms = {busy / medians[name]:.2f} cores on average | "
                  f"idle {1 - busy / (ranks * medians[name]):.0%}")
        a, b = medians.values()
        print(f"  sliced / unsliced iteration time: {b / a:.3f} (measured)")
        costs = CostModel(forward_cost=1.0, backward_cost=2.0)
        simulated = simulate(slices, costs).makespan / simulate(unsliced, costs).makespan
        print(f"  sliced / unsliced makespan on {ranks} devices (simulated, B = 2F, slices "
              f"costed by their attention work): {simulated:.3f}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_tool(main)
