#!/usr/bin/env python
"""Benchmark one training step of a GPT-2-style pipeline stage: TFLOP/s and MFU, fused vs unfused.

A step is forward + backward + optimizer (fp32 main params + Adam) of a middle stage of
``--num-layers`` transformer layers. Model FLOPs per layer and micro-batch follow Megatron
(Narayanan et al., 2021): ``72*b*s*h^2 * (1 + s/(6h))`` for forward + backward with a 4h MLP
(recomputation is not counted, as in MFU). MFU is relative to the dense matmul peak measured in
the same run (``--peak-size`` square matmuls in the benchmark dtype).

On a GPU it runs bf16 at the issue's shapes (hidden 1280 / 20 heads / seq 632 and hidden 2048 /
16 heads / seq 2048); on the CPU it runs tiny fp32 shapes, only to show that it works::

    python tools/benchmark_layer.py                  # auto: GPU shapes on CUDA, tiny on CPU
    python tools/benchmark_layer.py --output out.json

``--host-overhead`` instead measures the host (Python and dispatch) time of one transformer layer,
forward and backward, at tiny host-bound shapes (fp32 on the CPU), against a plain eager torch
layer of the same math (``nn.LayerNorm``, ``nn.Linear``, SDPA, tanh GeLU, dropout, residuals).
Ours runs as in training: keyed dropout, gradient buffers with their hooks and
gradient-accumulation fusion, T = 1. It prints both per-layer times and their ratios (JSON keys
``forward_ratio``, ``backward_ratio`` with ``--json FILE``); ``--clock cpu`` times this thread's
CPU time instead of the wall clock, which leaves out the time a busy machine gives other
processes::

    python tools/benchmark_layer.py --host-overhead --json host.json
    python tools/benchmark_layer.py --host-overhead --clock cpu
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron_chimera.atomic import atomic_write
from megatron_chimera.config import ModelConfig, OptimizerConfig
from megatron_chimera.distributed.grad_buffer import build_grad_buffers
from megatron_chimera.errors import ToolArgumentParser, run_tool
from megatron_chimera.model.dropout_rng import dropout_stream
from megatron_chimera.model.flops import layer_forward_flops
from megatron_chimera.model.gpt2 import GPTModel
from megatron_chimera.optimizer import get_megatron_optimizer
from megatron_chimera.tensor_parallel.weight_grad import (
    deferrable_modules,
    fusion_saves_work,
    set_weight_grad_deferral,
)

# (name, hidden, heads, seq, micro-batch)
GPU_SHAPES = [("gpt2-1.3b", 1280, 20, 632, 8), ("h2048-s2048", 2048, 16, 2048, 2)]
CPU_SHAPES = [("tiny", 64, 4, 32, 2)]


@dataclass
class Result:
    """One benchmark row."""

    shape: str
    path: str
    step_ms: float
    tflops: float
    mfu: float


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (CUDA) before reading the clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_tflops(device: torch.device, dtype: torch.dtype, m: int, k: int, n: int,
                iters: int) -> float:
    """Best measured throughput of an ``[m, k] @ [k, n]`` matmul (TFLOP/s)."""
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize(device)
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best / 1e12


def matmul_peak_tflops(device: torch.device, dtype: torch.dtype, size: int, iters: int) -> float:
    """Best measured throughput of ``size``-cubed matmuls (TFLOP/s)."""
    return gemm_tflops(device, dtype, size, size, size, iters)


def model_flops_per_step(config: ModelConfig, batch: int) -> float:
    """Forward + backward FLOPs of the stage's transformer layers (no head, no recompute)."""
    weights, attention = layer_forward_flops(config, batch)
    return 3.0 * config.num_layers * (weights + attention)


def time_training_step(config: ModelConfig, batch: int, device: torch.device, steps: int,
                       warmup: int) -> float:
    """Median seconds of forward + backward + optimizer step of a middle stage."""
    model = GPTModel(config, pre_process=False, post_process=False).to(device)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-4, bf16=config.params_dtype == "bf16", clip_grad=1.0), [model])
    shape = (config.seq_length, batch, config.hidden_size)
    hidden = torch.randn(shape, device=device, dtype=config.torch_dtype, requires_grad=True)
    grad = torch.randn(shape, device=device, dtype=config.torch_dtype)
    times = []
    for i in range(warmup + steps):
        synchronize(device)
        start = time.perf_counter()
        model.set_input_tensor(hidden)
        model(None, None).backward(grad)
        optimizer.step()
        optimizer.zero_grad()
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


class PlainLayer(nn.Module):
    """The same pre-LN layer in plain eager torch: the host-overhead baseline."""

    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]``."""
        s, b, h = x.shape
        qkv = self.qkv(self.ln1(x)).view(s, b, self.heads, 3 * h // self.heads)
        q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.split(h // self.heads, dim=-1))
        p = self.dropout if self.training else 0.0
        context = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        context = context.permute(2, 0, 1, 3).reshape(s, b, h)
        x = x + F.dropout(self.proj(context), p, self.training)
        mlp = self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))
        return x + F.dropout(mlp, p, self.training)


# ``--clock``: wall time, or this thread's CPU time -- the host work itself, without the time
# the scheduler gave other processes (on the CPU, one thread: autograd runs the backward of a
# CPU graph in the calling thread, so both phases are this thread's work)
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def _step_times(step, layers: int, clock=time.perf_counter) -> tuple[float, float]:
    """Forward and backward seconds per layer of one ``step()`` -> (output, grad)."""
    start = clock()
    output, grad = step()
    middle = clock()
    output.backward(grad)
    end = clock()
    return (middle - start) / layers, (end - middle) / layers


def _interleaved_medians(steps: dict, layers: int, count: int, warmup: int,
                         clock=time.perf_counter) -> dict[str, tuple[float, float]]:
    """Median forward and backward seconds per layer of each step, the steps taken in turn
    (one of each per round, the order rotated every round so that none always follows the
    same one), so that a change of machine load or cache state hits them alike."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    names = list(steps)
    for i in range(warmup + count):
        for name in names[i % len(names):] + names[:i % len(names)]:
            measured = _step_times(steps[name], layers, clock)
            if i >= warmup:
                times[name].append(measured)
    medians = {}
    for name, pairs in times.items():
        forward, backward = sorted(p[0] for p in pairs), sorted(p[1] for p in pairs)
        medians[name] = (forward[len(forward) // 2], backward[len(backward) // 2])
    return medians


def _our_stack(config: ModelConfig, split_backward: bool, fuse: bool):
    """Our layers with gradient buffers (and their hooks), as a training rank holds them:
    deferrable forwards only for a split-backward schedule (``set_weight_grad_deferral``, as the
    executor does), gradient-accumulation fusion when ``fuse``."""
    model = GPTModel(config, pre_process=False, post_process=False)
    buffers = build_grad_buffers({0: model}, grad_reduce_in_fp32=False,
                                 fuse_wgrad_accumulation=fuse)
    set_weight_grad_deferral(deferrable_modules(model), split_backward)
    return model, buffers


def host_overhead(layers: int, steps: int, warmup: int, hidden: int = 32, heads: int = 2,
                  seq: int = 4, batch: int = 1, dropout: float = 0.1,
                  repeats: int = 1, clock: str = "wall") -> dict[str, float]:
    """Per-layer forward/backward microseconds of our layer stack and the plain one (CPU, fp32,
    T = 1), and their ratios. ``ours`` is trained as on this device by a schedule without a
    split backward (gradient-accumulation fusion where :func:`fusion_saves_work`: not on the
    CPU); ``split`` is the path of a split-backward schedule, and of fusion on CUDA: every
    linear through our deferrable autograd function. The steps run interleaved; with
    ``repeats`` > 1 each figure is the least of that many medians. ``clock``: ``"wall"`` or
    ``"cpu"`` (this thread's CPU time, see :data:`CLOCKS`)."""
    torch.set_num_threads(1)
    config = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                         seq_length=seq, hidden_dropout=dropout, attention_dropout=dropout)
    ours, ours_buffers = _our_stack(
        config, split_backward=False,
        fuse=fusion_saves_work(torch.device("cpu"), torch.float32, torch.float32))
    split, split_buffers = _our_stack(config, split_backward=True, fuse=True)
    plain = nn.Sequential(*(PlainLayer(hidden, heads, dropout) for _ in range(layers)))
    shape = (seq, batch, hidden)
    x = torch.randn(shape, requires_grad=True)
    grad = torch.randn(shape)
    keys = iter(range(1 << 30))

    def stepper(model):
        def step():
            model.set_input_tensor(x)
            with dropout_stream(next(keys)):
                return model(None, None), grad
        return step

    stacks = {"ours": stepper(ours), "split": stepper(split), "plain": lambda: (plain(x), grad)}
    result: dict[str, float] = {}
    for _ in range(repeats):
        for name, (forward, backward) in _interleaved_medians(stacks, layers, steps, warmup,
                                                              CLOCKS[clock]).items():
            for phase, seconds in (("forward", forward), ("backward", backward)):
                key = f"{name}_{phase}_us"
                result[key] = min(result.get(key, float("inf")), 1e6 * seconds)
    for buffers in (ours_buffers, split_buffers):
        buffers.remove_hooks()
    for name in ("ours", "split"):
        prefix = "" if name == "ours" else "split_"
        for phase in ("forward", "backward"):
            result[f"{prefix}{phase}_ratio"] = (result[f"{name}_{phase}_us"]
                                                / result[f"plain_{phase}_us"])
    return result


def time_training_phases(config: ModelConfig, batch: int, device: torch.device, steps: int,
                         warmup: int, gradient_accumulation_fusion: bool | None = None
                         ) -> tuple[float, float]:
    """Median seconds of (forward + backward into the gradient buffers, optimizer step) of a
    middle stage, timed apart: the buffers as in training (fp32 ``main_grad`` for bf16, with
    gradient-accumulation fusion where training uses it -- :func:`fusion_saves_work` -- unless
    ``gradient_accumulation_fusion`` forces it on or off), the optimizer reading them."""
    model = GPTModel(config, pre_process=False, post_process=False).to(device)
    bf16 = config.params_dtype == "bf16"
    if gradient_accumulation_fusion is None:
        gradient_accumulation_fusion = fusion_saves_work(
            device, config.torch_dtype, torch.float32 if bf16 else config.torch_dtype)
    buffers = build_grad_buffers({0: model}, grad_reduce_in_fp32=bf16,
                                 fuse_wgrad_accumulation=gradient_accumulation_fusion)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-4, bf16=bf16, clip_grad=1.0),
                                       [model], grad_buffers=buffers)
    shape = (config.seq_length, batch, config.hidden_size)
    hidden = torch.randn(shape, device=device, dtype=config.torch_dtype, requires_grad=True)
    grad = torch.randn(shape, device=device, dtype=config.torch_dtype)
    compute, step = [], []
    for i in range(warmup + steps):
        buffers.zero_()
        synchronize(device)
        start = time.perf_counter()
        model.set_input_tensor(hidden)
        model(None, None).backward(grad)
        synchronize(device)
        middle = time.perf_counter()
        optimizer.step()
        synchronize(device)
        if i >= warmup:
            compute.append(middle - start)
            step.append(time.perf_counter() - middle)
    buffers.remove_hooks()
    return sorted(compute)[len(compute) // 2], sorted(step)[len(step) // 2]


def run(args: argparse.Namespace) -> tuple[float, list[Result]]:
    """Measure the peak, then every shape on the fused and unfused paths."""
    device = torch.device(args.device if args.device != "auto"
                          else ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    dtype = "bf16" if on_gpu else "fp32"
    shapes = GPU_SHAPES if on_gpu else CPU_SHAPES
    peak = matmul_peak_tflops(device, torch.bfloat16 if on_gpu else torch.float32,
                              args.peak_size or (8192 if on_gpu else 256), iters=10)
    results = []
    for name, hidden, heads, seq, batch in shapes:
        for fused in (True, False):
            config = ModelConfig(num_layers=args.num_layers, hidden_size=hidden,
                                 num_attention_heads=heads, seq_length=seq, params_dtype=dtype,
                                 masked_softmax_fusion=fused, bias_gelu_fusion=fused,
                                 bias_dropout_fusion=fused,
                                 use_apex=False if args.no_apex else None)
            seconds = time_training_step(config, batch, device, args.steps, args.warmup)
            tflops = model_flops_per_step(config, batch) / seconds / 1e12
            results.append(Result(name, "fused" if fused else "unfused", seconds * 1e3, tflops,
                                  tflops / peak))
            if on_gpu:
                torch.cuda.empty_cache()
    return peak, results


def main() -> None:
    """Parse flags, run, print a Markdown table (and write JSON with ``--output``)."""
    parser = ToolArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="auto", help="auto | cuda | cpu")
    parser.add_argument("--peak-size", type=int, default=None, help="matmul size for the peak")
    parser.add_argument("--no-apex", action="store_true", help="force torch-native kernels")
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    parser.add_argument("--host-overhead", action="store_true",
                        help="host time per layer against a plain eager layer (CPU, tiny)")
    parser.add_argument("--json", default=None, help="--host-overhead: write the figures here")
    parser.add_argument("--repeats", type=int, default=5,
                        help="--host-overhead: the least of this many medians (default 5)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="--host-overhead: time by the wall clock (default) or by this "
                             "thread's CPU time (the host work without the time other "
                             "processes took: steadier on a busy machine)")
    args = parser.parse_args()
    if args.host_overhead:
        _print_host_overhead(args)
        return
    peak, results = run(args)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"device: {device}; measured matmul peak {peak:.1f} TFLOP/s")
    print("| shape | path | step ms | TFLOP/s | MFU |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r.shape} | {r.path} | {r.step_ms:.2f} | {r.tflops:.2f} | {100 * r.mfu:.1f}% |")
    if args.output:
        payload = {"device": device, "peak_tflops": peak, "results": [vars(r) for r in results]}
        atomic_write(args.output, lambda handle: json.dump(payload, handle, indent=2), mode="w")


def _print_host_overhead(args: argparse.Namespace) -> None:
    figures = host_overhead(args.num_layers, max(args.steps, 50), args.warmup,
                            repeats=args.repeats, clock=args.clock)
    print(f"clock: {args.clock}")
    print("| layer | forward us | backward us |\n|---|---|---|")
    for name, label in (("ours", "ours (as trained here)"),
                        ("split", "ours, split-backward / fused path"), ("plain", "plain eager")):
        print(f"| {label} | {figures[name + '_forward_us']:.1f} | "
              f"{figures[name + '_backward_us']:.1f} |")
    print(f"forward ratio {figures['forward_ratio']:.2f}, "
          f"backward ratio {figures['backward_ratio']:.2f} (target <= 1.2); split-backward / "
          f"fused path {figures['split_forward_ratio']:.2f} / "
          f"{figures['split_backward_ratio']:.2f}")
    if args.json:
        atomic_write(args.json, lambda handle: json.dump(figures, handle, indent=2), mode="w")


if __name__ == "__main__":
    run_tool(main)
