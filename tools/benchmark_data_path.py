#!/usr/bin/env python
"""Main-process (host) time per GPT micro-batch: the previous data path against the current one.

Example::

    python tools/benchmark_data_path.py --seq-length 2048 --micro-batch-size 4 --iters 50

* **previous**: raw ``{"text"}`` batches; the main process builds loss mask and position ids and
  a dense ``s x s`` causal mask (Megatron's ``get_ltor_masks_and_position_ids``, rebuilt here as
  the baseline; the model never used the mask), then copies every field with a blocking
  ``.to(device)``.
* **current**: the DataLoader workers compute the fields (``GPTSampleDataset``), the batch is
  pinned on CUDA machines, the main process only moves the fields a stage reads with
  ``non_blocking`` copies and slices tokens and labels (``get_batch``); no mask exists.

Both read the same mock corpus through the same DataLoader settings; the figures are the median
main-process milliseconds per micro-batch (waiting for the workers is reported apart).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megatron_chimera.atomic import atomic_write
from megatron_chimera.data.gpt_dataset import MockGPTDataset, get_batch
from megatron_chimera.data.gpt_sample_fields import GPTSampleDataset, LtorOptions
from megatron_chimera.data.samplers import batch_to_device, build_data_iterator
from megatron_chimera.errors import ToolArgumentParser, run_tool

EOD = 0


def previous_get_batch(micro_batch: dict[str, torch.Tensor], device: torch.device) -> tuple:
    """The main-process work of the previous path (fields and dense mask built here)."""
    text = micro_batch["text"].long()
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    b, s = tokens.shape
    mask = torch.tril(torch.ones((1, s, s))).view(1, 1, s, s) < 0.5
    loss_mask = torch.ones((b, s), dtype=torch.float)
    position_ids = torch.arange(s, dtype=torch.long).unsqueeze(0).expand_as(tokens)
    return tuple(t.to(device) for t in (tokens, labels, loss_mask, mask, position_ids))


def current_get_batch(micro_batch: dict[str, torch.Tensor], device: torch.device) -> tuple:
    """The current main-process work of a stage that holds the first and the last stage."""
    fields = ("text", "position_ids", "loss_mask", "document_ids")
    return get_batch(batch_to_device(micro_batch, device, fields))


def measure(dataset, work, args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Median milliseconds per micro-batch: waiting for the workers, and main-process work."""
    iterator = build_data_iterator(dataset, 0, args.micro_batch_size, 0, 1, args.num_workers)
    waits, works = [], []
    for i in range(args.warmup + args.iters):
        start = time.perf_counter()
        batch = next(iterator)
        fetched = time.perf_counter()
        work(batch, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        done = time.perf_counter()
        if i >= args.warmup:
            waits.append(fetched - start)
            works.append(done - fetched)
    return {"wait_ms": 1e3 * statistics.median(waits), "work_ms": 1e3 * statistics.median(works)}


def main(argv: list[str] | None = None) -> int:
    """Run both paths and print (and optionally write) the figures."""
    p = ToolArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = p.parse_args(argv)
    if min(args.seq_length, args.micro_batch_size, args.iters) < 1 or args.warmup < 0:
        p.error("sizes and --iters must be positive, --warmup >= 0")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if args.device == "auto" else args.device)
    samples = (args.warmup + args.iters) * args.micro_batch_size
    raw = MockGPTDataset("train", samples, args.seq_length, 50304, EOD, seed=1)
    rows = {
        "previous": measure(raw, previous_get_batch, args, device),
        "current": measure(GPTSampleDataset(raw, LtorOptions(EOD)), current_get_batch, args,
                           device),
    }
    print(f"device {device}, seq {args.seq_length}, micro-batch {args.micro_batch_size}, "
          f"{args.num_workers} workers, median of {args.iters}")
    print("| path | main-process work ms / micro-batch | waiting for workers ms |")
    print("|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['work_ms']:.3f} | {row['wait_ms']:.3f} |")
    ratio = rows["previous"]["work_ms"] / max(rows["current"]["work_ms"], 1e-9)
    print(f"main-process work: {ratio:.0f}x less")
    if args.json:
        atomic_write(args.json, lambda f: json.dump({"device": str(device), **rows}, f, indent=1),
                     mode="w")
    return 0


if __name__ == "__main__":
    run_tool(main)
