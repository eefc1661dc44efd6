"""Simulated context parallelism chosen per micro-batch against fixed context parallelism (issue
50; the runtime runs one CP size, this is the performance model's prediction).

Example (the defaults: a Llama-2-7B-shaped model, D = 8 pipeline stages, CP groups of 4 across
nodes, 4096 tokens per rank, 1000 documents of a log-normal mix, median 512, capped at 16384)::

    python tools/benchmark_dynamic_cp.py

The same documents run both ways on the same D x CP GPUs, each micro-batch priced by its own
documents (``tuning/length_mix.py``: linear layers by tokens, attention by squared document
lengths, ring attention's exposed messages) under ``--pipeline-schedule`` (1F1B by default),
micro-batches dearest first in both:

* **fixed**: documents packed into micro-batches of CP x capacity tokens, every one split over
  the CP group (per-document zigzag, documents padded to 2 CP);
* **per micro-batch** (``tuning/dynamic_cp.py``): documents longer than one rank's capacity
  packed into such micro-batches at CP; the others into lanes of ``capacity`` tokens, CP lanes
  one micro-batch at CP = 1 (each rank its own documents), unless CP is cheaper for it.

Prints the mix, the micro-batches each way and the makespan ratio fixed / per-micro-batch for
the CP ring on the inter-node link and on the intra-node link (where its messages hide behind
compute and the choice gains little).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_chimera.config import ModelConfig  # noqa: E402
from megatron_chimera.errors import ToolArgumentParser, run_tool  # noqa: E402
from megatron_chimera.tuning.analytic_costs import ModelSpec, partition_stages  # noqa: E402
from megatron_chimera.tuning.dynamic_cp import (  # noqa: E402
    fixed_units,
    per_microbatch_units,
    simulate_units,
    unit_seconds,
)
from megatron_chimera.tuning.hardware import load_hardware  # noqa: E402
from megatron_chimera.tuning.perf_model import AnalyticCompute  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags."""
    p = ToolArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--hardware", default="a100")
    p.add_argument("--num-layers", type=int, default=32)
    p.add_argument("--hidden-size", type=int, default=4096)
    p.add_argument("--num-attention-heads", type=int, default=32)
    p.add_argument("--num-query-groups", type=int, default=32)
    p.add_argument("--ffn-hidden-size", type=int, default=11008)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=8)
    p.add_argument("--pipeline-schedule", default="1f1b")
    p.add_argument("--context-parallel-size", type=int, default=4)
    p.add_argument("--capacity", type=int, default=4096, help="tokens per rank")
    p.add_argument("--documents", type=int, default=1000)
    p.add_argument("--median", type=float, default=512.0)
    p.add_argument("--sigma", type=float, default=1.2, help="log-normal shape")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    """Print the mix, both plans and the makespan ratios."""
    args = build_parser().parse_args(argv)
    cp, capacity, D = args.context_parallel_size, args.capacity, args.pipeline_model_parallel_size
    if min(cp, capacity, D, args.documents) < 1 or cp < 2:
        raise ValueError("--context-parallel-size >= 2; --capacity, "
                         "--pipeline-model-parallel-size and --documents >= 1")
    hardware = load_hardware(args.hardware)
    config = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                         num_attention_heads=args.num_attention_heads,
                         num_query_groups=args.num_query_groups,
                         ffn_hidden_size=args.ffn_hidden_size, seq_length=capacity,
                         max_position_embeddings=cp * capacity, vocab_size=args.vocab_size,
                         swiglu=True, position_embedding_type="rope", params_dtype="bf16",
                         masked_softmax_fusion=True)
    spec = ModelSpec(config, "gpt2")
    compute = AnalyticCompute(spec, hardware)
    pieces = partition_stages(spec, D)
    rng = np.random.default_rng(args.seed)
    lengths = np.clip(rng.lognormal(np.log(args.median), args.sigma, args.documents).astype(int),
                      16, cp * capacity).tolist()
    mix = np.asarray(lengths)
    print(f"mix: {len(lengths)} documents, {mix.sum()} tokens, median {np.median(mix):.0f}, "
          f"max {mix.max()}, {mix[mix > capacity].sum() / mix.sum():.0%} of the tokens in "
          f"documents over the {capacity}-token capacity of one rank")
    print(f"model: {args.num_layers} layers, hidden {args.hidden_size}, "
          f"{args.num_attention_heads} heads / {args.num_query_groups} key-value groups, "
          f"{args.hardware}, D = {D} ({args.pipeline_schedule}), CP = {cp}")
    fixed = fixed_units(lengths, cp, capacity)
    for name in ("inter_node", "intra_node"):
        link = hardware.message_link(getattr(hardware, name))
        chosen = per_microbatch_units(lengths, cp, capacity, unit_seconds(compute, pieces, link))
        kinds = collections.Counter(u.context_parallel for u in chosen)
        a = simulate_units(compute, pieces, fixed, args.pipeline_schedule, link).makespan
        b = simulate_units(compute, pieces, chosen, args.pipeline_schedule, link).makespan
        print(f"CP ring on the {name.replace('_', '-')} link ({link.bandwidth_gbps:g} GB/s): "
              f"fixed {len(fixed)} micro-batches {a:.3f} s; per micro-batch "
              f"{kinds[1]} at CP = 1 + {kinds[cp]} at CP = {cp}: {b:.3f} s; "
              f"ratio {a / b:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
