#!/usr/bin/env python
"""Per-rank bytes of parameters, gradients and optimizer state: 1F1B, Chimera, Chimera + the
distributed optimizer -- counted from the real tensors, compared with the memory model.

Example::

    python tools/benchmark_optimizer_memory.py                 # GPT-2 64 layers and 24/1024
    python tools/benchmark_optimizer_memory.py --models gpt2-medium -D 8 -W 1 4 --json out.json

Every stage of the model is built with the real model class (bf16, Adam) and moved to the meta
device; for every pipeline rank of each layout its stages get gradient buffers and an optimizer
(local, or distributed with the rank's shard of every stage-replica group -- ``2f x W`` ranks
for Chimera, ``W`` for 1F1B -- and of the embedding group for a tied embedding), which takes one
step so Adam creates its moments; then the tensors are
counted (:func:`megatron_chimera.optimizer.accounting.measure_state_bytes`). The largest rank of
each layout is printed next to the memory model's figure
(:func:`megatron_chimera.tuning.rank_memory.rank_memory`) and their ratio.

Target: Chimera with 2 pipes and the distributed optimizer at W=1 holds no more optimizer-state
bytes per rank than 1F1B without it (each Chimera rank keeps two stage replicas, but its
stage-replica groups are twice as wide).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import dataclass

from torch import nn

from megatron_chimera.atomic import atomic_write
from megatron_chimera.config import OptimizerConfig
from megatron_chimera.distributed.grad_buffer import TIED
from megatron_chimera.errors import ToolArgumentParser, run_tool
from megatron_chimera.model.family import ModelFamily
from megatron_chimera.model.partition import partition_layers
from megatron_chimera.model.presets import MODEL_PRESETS, make_model
from megatron_chimera.optimizer.accounting import StateBytes, measure_state_bytes
from megatron_chimera.schedules import build_schedule
from megatron_chimera.tuning.analytic_costs import ModelSpec, pieces_of
from megatron_chimera.tuning.rank_memory import embedding_group_size, rank_memory, stage_replicas

GIB = 2**30
LAYOUTS = (("1f1b", {}, False), ("chimera", {"pipes": 2}, False),
           ("chimera", {"pipes": 2}, True), ("1f1b", {}, True))


@dataclass(frozen=True)
class Row:
    """The largest rank of one layout: measured and modelled bytes."""

    model: str
    layout: str
    D: int
    W: int
    measured: StateBytes
    modelled: StateBytes

    def to_dict(self) -> dict:
        """JSON record."""
        return {"model": self.model, "layout": self.layout, "D": self.D, "W": self.W,
                "measured": self.measured.__dict__, "model_estimate": self.modelled.__dict__}


def build_stages(family: ModelFamily, config, num_stages: int) -> list[nn.Module]:
    """Every stage of the model (real classes), moved to the meta device (shapes only)."""
    from megatron_chimera.model.bert import BertModel
    from megatron_chimera.model.gpt2 import GPTModel

    cls = BertModel if family.sentence_heads else GPTModel
    stages = []
    for stage, layers in enumerate(partition_layers(config.num_layers, num_stages)):
        module = cls(config, pre_process=stage == 0, post_process=stage == num_stages - 1,
                     layer_range=layers)
        stages.append(module.to("meta"))
    return stages


def measure_layout(name: str, family: ModelFamily, config, stages: list[nn.Module], D: int,
                   W: int, schedule_name: str, options: dict, sharded: bool) -> Row:
    """Measured and modelled bytes of the largest rank (by total) of one layout."""
    schedule = build_schedule(schedule_name, D, 2 * D, **options)
    replicas = stage_replicas(schedule)
    optimizer = OptimizerConfig(bf16=config.params_dtype == "bf16")
    model = rank_memory(ModelSpec(config, family),
                        schedule, pieces_of(partition_layers(config.num_layers, D)), 1, False,
                        data_parallel_size=W, distributed_optimizer=sharded)
    worst: tuple[int, StateBytes, StateBytes] | None = None
    for rank in range(D):
        held = schedule.stages_of_rank(rank)
        modules = {s: copy.deepcopy(stages[s]) for s in held}
        shards = None
        if sharded:
            shards = {s: replicas[s] * W for s in held}
            shards[TIED] = embedding_group_size(schedule, W)
        real = measure_state_bytes(modules, optimizer, config.params_dtype == "bf16", shards)
        estimate = StateBytes(model[rank].param_bytes, model[rank].grad_bytes,
                              model[rank].optimizer_bytes)
        total = real.param_bytes + real.grad_bytes + real.optimizer_bytes
        if worst is None or total > sum(worst[1].__dict__.values()):
            worst = (rank, real, estimate)
    label = schedule_name + (f" {options['pipes']} pipes" if options else "")
    label += " + distributed optimizer" if sharded else ""
    return Row(name, label, D, W, worst[1], worst[2])


def format_rows(rows: list[Row]) -> str:
    """The table: GiB per rank (measured, model, model/measured) for each kind of state."""
    head = (f"{'model':<12}{'W':>3}  {'layout':<36}"
            f"{'params':>8}{'grads':>8}{'optim':>8}   {'model: params':>13}{'grads':>8}"
            f"{'optim':>8}{'optim ratio':>13}")
    lines = [head, "-" * len(head)]
    for row in rows:
        m, e = row.measured, row.modelled
        ratio = e.optimizer_bytes / m.optimizer_bytes if m.optimizer_bytes else float("nan")
        lines.append(
            f"{row.model:<12}{row.W:>3}  {row.layout:<36}"
            f"{m.param_bytes / GIB:>8.2f}{m.grad_bytes / GIB:>8.2f}{m.optimizer_bytes / GIB:>8.2f}"
            f"   {e.param_bytes / GIB:>13.2f}{e.grad_bytes / GIB:>8.2f}"
            f"{e.optimizer_bytes / GIB:>8.2f}{ratio:>13.4f}")
    return "\n".join(lines)


def target_check(rows: list[Row]) -> list[str]:
    """Chimera 2 pipes + distributed optimizer (W=1) vs 1F1B without it, per model."""
    lines = []
    for model in dict.fromkeys(r.model for r in rows):
        found = {(r.layout, r.W): r for r in rows if r.model == model}
        chimera = found.get(("chimera 2 pipes + distributed optimizer", 1))
        plain = found.get(("1f1b", 1))
        if chimera is None or plain is None:
            continue
        a, b = chimera.measured.optimizer_bytes, plain.measured.optimizer_bytes
        verdict = "meets" if a <= b else "MISSES"
        lines.append(f"{model}: Chimera + distributed optimizer (W=1) {a / GIB:.3f} GiB optimizer "
                     f"state per rank vs 1F1B {b / GIB:.3f} GiB (ratio {a / b:.3f}): {verdict} "
                     f"the target")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Parse flags, measure every model x W x layout, print the table (and JSON)."""
    parser = ToolArgumentParser(description=__doc__.splitlines()[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gpt2-64", "gpt2-medium"],
                        choices=sorted(MODEL_PRESETS))
    parser.add_argument("-D", "--pipeline-size", type=int, default=8)
    parser.add_argument("-W", "--data-parallel-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--params-dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.pipeline_size < 2 or args.pipeline_size % 2:
        parser.error("-D must be an even pipeline size >= 2 (Chimera)")
    if min(args.data_parallel_sizes) < 1:
        parser.error("-W values must be positive")
    rows: list[Row] = []
    for name in args.models:
        family, config = make_model(name, params_dtype=args.params_dtype)
        stages = build_stages(family, config, args.pipeline_size)
        for W in args.data_parallel_sizes:
            for schedule_name, options, sharded in LAYOUTS:
                if sharded and schedule_name == "1f1b" and W == 1:
                    continue  # one-rank stage-replica groups: nothing to shard
                rows.append(measure_layout(name, family, config, stages, args.pipeline_size, W,
                                           schedule_name, options, sharded))
                print(f"measured {name} W={W} {rows[-1].layout}", file=sys.stderr, flush=True)
    print(f"Per-rank training state (largest rank), D={args.pipeline_size}, "
          f"{args.params_dtype} + Adam, GiB: measured from the tensors | memory model")
    print(format_rows(rows))
    for line in target_check(rows):
        print(line)
    if args.json:
        payload = json.dumps([r.to_dict() for r in rows], indent=2).encode()
        atomic_write(args.json, lambda handle: handle.write(payload))
    return 0


if __name__ == "__main__":
    run_tool(main)
