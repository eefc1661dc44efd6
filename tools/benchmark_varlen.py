#!/usr/bin/env python3
"""Tokens per second of packed variable-length vs padded fixed-length training.

    python tools/benchmark_varlen.py --documents 48 --median 512 --max-length 4096

Draws ``--documents`` documents with log-normal lengths (median ``--median``, at most
``--max-length`` tokens) and trains a small GPT on them (forward, backward, SGD step), twice:

* packed (``--variable-seq-lengths``): the documents packed whole into micro-batches of at most
  ``--max-length`` tokens (``data/packing.py``), one row ``[1, T_m]`` each, attention within each
  document through ``DocumentMask`` (``--document-attention auto``: per-document SDPA on the
  CPU, FlashAttention varlen on CUDA with fp16/bf16), positions restarting per document;
* padded: one document per sample, padded to the fixed ``--max-length`` (Megatron's fixed
  ``[s, b]`` micro-batches without packing), ``--padded-batch`` samples per micro-batch, the
  padding masked out of the loss.

Both train the same tokens (every document once). Prints each run's trained (non-padding)
tokens per second and the ratio packed / padded (the target is >= 1.5 on the CPU).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_chimera.config import ModelConfig  # noqa: E402
from megatron_chimera.data.packed_dataset import MockDocuments, PackedDataset  # noqa: E402
from megatron_chimera.errors import ToolArgumentParser, run_tool  # noqa: E402
from megatron_chimera.model.document_attention import DocumentMask  # noqa: E402
from megatron_chimera.model.gpt2 import GPTModel  # noqa: E402


def _step(model: GPTModel, optimizer: torch.optim.Optimizer, tokens, labels, positions,
          loss_mask, mask) -> None:
    losses = model(tokens, positions, attention_mask=mask, labels=labels)
    loss = (losses * loss_mask).sum() / loss_mask.sum().clamp_min(1)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def packed_batches(dataset: PackedDataset, device: torch.device) -> list[tuple]:
    """(tokens, labels, positions, loss mask, DocumentMask) of every packed micro-batch."""
    out = []
    for i in range(len(dataset.plan.micro_batches)):
        f = {k: torch.from_numpy(v)[None].to(device) for k, v in dataset[i].items()}
        out.append((f["tokens"], f["labels"], f["position_ids"], f["loss_mask"],
                    DocumentMask(f["document_ids"], device)))
    return out


def padded_batches(documents: MockDocuments, seq: int, batch: int, device: torch.device
                   ) -> list[tuple]:
    """Micro-batches of ``batch`` documents, each padded to ``seq`` inputs (causal attention;
    the padding's loss masked)."""
    out = []
    count = len(documents.sizes())
    for first in range(0, count, batch):
        rows = range(first, min(first + batch, count))
        tokens = torch.zeros(len(rows), seq, dtype=torch.int64)
        labels = torch.zeros_like(tokens)
        loss_mask = torch.zeros(len(rows), seq)
        for r, d in enumerate(rows):
            ids = torch.from_numpy(documents[d])[:seq + 1]
            n = ids.shape[0] - 1
            tokens[r, :n], labels[r, :n], loss_mask[r, :n] = ids[:-1], ids[1:], 1.0
        positions = torch.arange(seq).expand(len(rows), seq)
        out.append(tuple(t.to(device) for t in (tokens, labels, positions, loss_mask))
                   + (None,))
    return out


def tokens_per_second(model: GPTModel, batches: list[tuple], repeats: int) -> float:
    """Trained (loss-masked-in) tokens per second over ``repeats`` passes (after one warm-up
    micro-batch)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    tokens, labels, positions, loss_mask, mask = batches[0]
    _step(model, optimizer, tokens, labels, positions, loss_mask, mask)
    trained = sum(float(b[3].sum()) for b in batches) * repeats
    start = time.perf_counter()
    for _ in range(repeats):
        for tokens, labels, positions, loss_mask, mask in batches:
            _step(model, optimizer, tokens, labels, positions, loss_mask, mask)
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()
    return trained / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    """Parse flags, time both layouts, print tokens/s and the ratio."""
    parser = ToolArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=48)
    parser.add_argument("--median", type=int, default=512)
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--padded-batch", type=int, default=1)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    config = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                         num_attention_heads=args.num_attention_heads,
                         seq_length=args.max_length, vocab_size=1024, hidden_dropout=0.0,
                         attention_dropout=0.0)
    # documents of up to max_length + 1 ids: at most max_length inputs, the packing budget
    documents = MockDocuments(args.documents, args.median, args.max_length + 1, 1024, 0,
                              args.seed)
    dataset = PackedDataset(documents, args.max_length, args.documents)
    lengths = documents.sizes() - 1
    print(f"{args.documents} documents: median {int(sorted(lengths)[len(lengths) // 2])}, max "
          f"{int(lengths.max())}, {int(lengths.sum())} tokens; {dataset.describe()}")
    results = {}
    for name, batches in (("packed", packed_batches(dataset, device)),
                          ("padded", padded_batches(documents, args.max_length,
                                                    args.padded_batch, device))):
        model = GPTModel(config, seed=args.seed).to(device)
        results[name] = tokens_per_second(model, batches, args.repeats)
        print(f"{name:>7}: {len(batches):4d} micro-batches, {results[name]:10.1f} trained "
              f"tokens/s")
    print(f"packed / padded tokens per second: {results['packed'] / results['padded']:.2f}x "
          "(target >= 1.5x)")


if __name__ == "__main__":
    run_tool(main)
