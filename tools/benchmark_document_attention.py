#!/usr/bin/env python3
"""Time and size the per-document attention kernels of ``--reset-attention-mask``.

    python tools/benchmark_document_attention.py --seq-length 1024 --doc-length 128

Forward + backward of the attention core on ``[b, heads, s, head_dim]`` tensors whose samples
pack documents of about ``--doc-length`` tokens, for each kernel that runs on the device (loop,
mask, varlen / flex on CUDA) and for plain causal attention (no documents) as the baseline. Prints
a Markdown table: median milliseconds, and on CUDA the peak memory above the inputs (the dense
mask's ``b x s x s`` bytes show up there).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_chimera.errors import ToolArgumentParser, run_tool  # noqa: E402
from megatron_chimera.model.document_attention import (  # noqa: E402
    DocumentMask,
    document_attention,
)
from megatron_chimera.model.fused import attention  # noqa: E402


def document_ids(batch: int, seq: int, doc_length: int, seed: int = 0) -> torch.Tensor:
    """``[b, s]`` ids of documents of uniform lengths in ``[doc_length/2, 3 doc_length/2]``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(batch, seq, dtype=torch.int64)
    for row in range(batch):
        position, doc = 0, 0
        while position < seq:
            length = int(torch.randint(doc_length // 2, doc_length * 3 // 2 + 1, (1,),
                                       generator=g))
            ids[row, position:position + length] = doc
            position, doc = position + length, doc + 1
    return ids


def time_kernel(run, inputs: list[torch.Tensor], steps: int, device: torch.device
                ) -> tuple[float, float | None]:
    """(median ms of forward + backward, peak MiB above the inputs on CUDA)."""
    times = []
    for i in range(steps + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        out = run(*inputs)
        out.backward(torch.ones_like(out))
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
        for tensor in inputs:
            tensor.grad = None
    peak = None
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return sorted(times)[len(times) // 2] * 1e3, peak


def main(argv: list[str] | None = None) -> None:
    """Parse flags, time every applicable kernel, print the table."""
    parser = ToolArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--doc-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="auto", help="auto | cuda | cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device if args.device != "auto"
                          else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = (args.micro_batch_size, args.num_attention_heads, args.seq_length, args.head_dim)
    inputs = [torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
              for _ in range(3)]
    mask = DocumentMask(document_ids(args.micro_batch_size, args.seq_length, args.doc_length),
                        device)
    kernels = {"causal, no documents (baseline)":
               lambda q, k, v: attention(q, k, v, None, True, 0.0, True)}
    impls = ["loop", "mask"] + (["varlen", "flex"] if device.type == "cuda" else [])
    for impl in impls:
        kernels[impl] = (lambda name: lambda q, k, v: document_attention(
            q, k, v, mask, 0.0, True, implementation=name))(impl)
    mean = args.seq_length * shape[0] / len(mask.segments)
    print(f"device {device}, {str(dtype).replace('torch.', '')}, shape {list(shape)}, "
          f"{len(mask.segments)} documents (mean {mean:.0f} tokens)")
    print("| kernel | fwd+bwd ms | peak MiB |\n|---|---|---|")
    for name, run in kernels.items():
        try:
            ms, peak = time_kernel(run, inputs, args.steps, device)
        except Exception as exc:  # noqa: BLE001 - report and go on with the other kernels
            print(f"| {name} | failed: {str(exc).splitlines()[0][:80]} | |")
            continue
        print(f"| {name} | {ms:.1f} | {'-' if peak is None else f'{peak:.0f}'} |")


if __name__ == "__main__":
    run_tool(main)
