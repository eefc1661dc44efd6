#!/usr/bin/env python
"""One command that checks the CUDA path on one GPU and prints the figures for docs/GPU.md.

Example (one GPU, under 10 minutes)::

    python tools/gpu_check.py --output docs/GPU.md

Sections, each with its figures and PASS / FAIL:

1. bf16 and fp16 GPT-2 training in one process (``pretrain_gpt2.py``, mock data): the loss falls,
   the fp16 loss scale behaves (finite, few skipped iterations);
2. the fused-AdamW resume round trip on CUDA: a resumed run equals the uninterrupted one bit for
   bit, and every ``step`` tensor sits on the parameter's device;
3. the attention kernel scaled_dot_product_attention actually selects (flash, memory-efficient)
   at the model's shapes, and the model's ``--use-flash-attn`` path;
4. ``tools/benchmark_layer.py``: TFLOP/s and MFU at hidden 1280 / seq 632 and hidden 2048 / seq
   2048 against the bf16 matmul peak measured in the same run and against the device's dense
   bf16 spec peak (989 TFLOP/s on H100 SXM; issue 32's bar: 45% at hidden 2048 / seq 2048);
   forward + backward through the gradient buffers timed apart from the optimizer step, with and
   without gradient-accumulation fusion;
5. the memory model's per-stage estimate against ``torch.cuda.max_memory_allocated``;
6. with more than one GPU visible: ``torchrun`` over NCCL -- Chimera D=2, bf16, the distributed
   optimizer and overlapped reduction on 2 GPUs, and T=2 x D=2 on 4 -- trains without a hang and
   its loss falls;
7. the training log's memory report (``pretrain_gpt2.py``, D=1, bf16): each rank's predicted
   total against the measured one (the allocator's peak on CUDA) within 10%.

``--device cpu --quick`` runs the same code with tiny shapes (CI checks the script works; the
CUDA-only parts report "skipped").
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from benchmark_layer import (
    matmul_peak_tflops,
    model_flops_per_step,
    time_training_phases,
    time_training_step,
)

from megatron_chimera.atomic import atomic_write_text
from megatron_chimera.checkpoint.checkpointing import (
    CheckpointContents,
    CheckpointTarget,
    StageSlice,
    load_checkpoint,
    save_checkpoint,
)
from megatron_chimera.config import ModelConfig, OptimizerConfig
from megatron_chimera.errors import ToolArgumentParser, run_tool
from megatron_chimera.model.family import GPT2
from megatron_chimera.model.gpt2 import GPTModel
from megatron_chimera.model.memory import estimate_stage_memory
from megatron_chimera.optimizer import get_megatron_optimizer

ROOT = Path(__file__).resolve().parent.parent


class Report:
    """Markdown sections with a PASS / FAIL verdict each."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.failures: list[str] = []

    def section(self, title: str) -> None:
        self.lines += ["", f"## {title}", ""]
        print(f"\n== {title}", flush=True)

    def line(self, text: str) -> None:
        self.lines.append(text)
        print(text, flush=True)

    def verdict(self, name: str, ok: bool, detail: str) -> None:
        self.line(f"- **{'PASS' if ok else 'FAIL'}** {name}: {detail}")
        if not ok:
            self.failures.append(name)


# ------------------------------------------------------------------------------ 1. training
def train_run(precision: str, quick: bool, device: str) -> dict[str, list[float]]:
    """One process of pretrain_gpt2.py; returns its TensorBoard scalars."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    size = (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "64", "--train-iters", "40"] if quick else
            ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
             "--seq-length", "1024", "--train-iters", "100"])
    with tempfile.TemporaryDirectory() as tb:
        cmd = [sys.executable, str(ROOT / "pretrain_gpt2.py"), *size,
               "--max-position-embeddings", size[size.index("--seq-length") + 1],
               "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "3e-3",
               "--lr-warmup-fraction", "0.1", "--mock-data", "--vocab-size", "256",
               "--log-interval", "10", "--eval-iters", "0", "--num-workers", "2",
               "--tensorboard-dir", tb, f"--{precision}"]
        if precision == "fp16":
            cmd += ["--initial-loss-scale", "65536"]
        if device == "cpu":
            cmd += ["--distributed-backend", "gloo", "--allow-cpu-training"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        if proc.returncode:
            raise RuntimeError(f"pretrain_gpt2.py --{precision} failed:\n{proc.stderr[-3000:]}")
        events = EventAccumulator(tb)
        events.Reload()
        tags = set(events.Tags()["scalars"])
        return {tag: [e.value for e in events.Scalars(tag)]
                for tag in ("lm loss", "loss-scale", "skipped-iterations") if tag in tags}


def check_training(report: Report, quick: bool, device: str) -> None:
    report.section("1. bf16 and fp16 GPT-2 training (one process, mock data)")
    for precision in ("bf16", "fp16"):
        if precision == "fp16" and device == "cpu":
            report.line("- fp16: skipped (CPU)")
            continue
        start = time.perf_counter()
        scalars = train_run(precision, quick, device)
        loss = scalars["lm loss"]
        head, tail = sum(loss[:5]) / 5, sum(loss[-5:]) / 5
        report.verdict(f"{precision} loss falls", tail < 0.9 * head,
                       f"mean of the first 5 iterations {head:.3f}, last 5 {tail:.3f} "
                       f"({time.perf_counter() - start:.0f} s)")
        if precision == "fp16":
            scales = scalars.get("loss-scale", [])
            skipped = scalars.get("skipped-iterations", [0])[-1]
            ok = bool(scales) and all(0 < s < float("inf") for s in scales) and skipped <= 20
            report.verdict("fp16 loss scale", ok, f"from {scales[0]:.0f} to {scales[-1]:.0f}, "
                                                  f"{skipped:.0f} skipped iterations")


# ------------------------------------------------------------------------------ 2. resume
def check_resume(report: Report, device: torch.device) -> None:
    report.section("2. fused-AdamW resume round trip")
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                         vocab_size=256, hidden_dropout=0.0, attention_dropout=0.0,
                         use_apex=False)
    optim = OptimizerConfig(lr=1e-2, clip_grad=1.0, use_apex=False)

    def build():
        model = GPTModel(config, seed=3).to(device)
        return model, get_megatron_optimizer(optim, [model])

    def steps(model, optimizer, span):
        for step in span:
            g = torch.Generator().manual_seed(step)
            tokens = torch.randint(0, 256, (2, 32), generator=g).to(device)
            positions = torch.arange(32, device=device).expand(2, -1)
            optimizer.zero_grad()
            model(tokens, positions, labels=tokens.roll(-1, 1)).mean().backward()
            optimizer.step()

    straight, opt = build()
    steps(straight, opt, range(6))
    kind = type(opt.optimizer).__name__ + (" (fused)" if opt.optimizer.defaults.get("fused")
                                           else "")
    model, opt = build()
    steps(model, opt, range(3))
    with tempfile.TemporaryDirectory() as root:
        stage = StageSlice(0, (0, 2), model)
        save_checkpoint(root, CheckpointContents(3, [stage], [(0, 2)], optimizer=opt), rank=0,
                        world_size=1)
        model, opt = build()
        load_checkpoint(root, CheckpointTarget([StageSlice(0, (0, 2), model)], 1, opt),
                        rank=0, world_size=1)
    placed = all(s["step"].device == p.device for p, s in opt.optimizer.state.items()
                 if torch.is_tensor(s.get("step")))
    steps(model, opt, range(3, 6))
    equal = all(torch.equal(a, b) for a, b in zip(straight.parameters(), model.parameters()))
    report.verdict(f"{kind} on {device}", equal and placed,
                   f"resumed == uninterrupted bitwise: {equal}; step tensors on the parameter "
                   f"device: {placed}")


# ------------------------------------------------------------------------------ 3. attention
def check_attention(report: Report, device: torch.device, quick: bool) -> None:
    report.section("3. attention kernels (scaled_dot_product_attention)")
    if device.type != "cuda":
        report.line("- skipped (no CUDA: flash and memory-efficient kernels are CUDA kernels)")
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name, heads, seq, head_dim in (("gpt2-1.3b", 20, 632, 64), ("h2048", 16, 2048, 128)):
        q, k, v = (torch.randn(2, heads, seq, head_dim, device=device, dtype=torch.bfloat16)
                   for _ in range(3))
        found = []
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel([backend]):
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                found.append(backend.name)
            except RuntimeError:
                pass
        report.verdict(f"{name} (heads {heads}, seq {seq}, bf16, causal)", bool(found),
                       f"usable fused kernels: {', '.join(found) or 'none'}")
    config = ModelConfig(num_layers=1, hidden_size=1280, num_attention_heads=20, seq_length=632,
                         vocab_size=1024, params_dtype="bf16", use_flash_attn=True,
                         attention_dropout=0.0)
    model = GPTModel(config).to(device)
    tokens = torch.randint(0, 1024, (2, 632), device=device)
    try:
        model(tokens, torch.arange(632, device=device).expand(2, -1)).float().sum().backward()
        report.verdict("model with --use-flash-attn", True, "forward and backward ran")
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        report.verdict("model with --use-flash-attn", False, f"{type(exc).__name__}: {exc}")


# ------------------------------------------------------------------------------ 4. throughput
# dense bf16 tensor-core peaks (TFLOP/s) from the vendors' data sheets, by device-name substring
# (checked in this order: the PCIe H100 before the SXM default)
SPEC_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))
MFU_TARGET = 0.45  # of the spec peak at hidden 2048 / seq 2048 (issue 32)


def spec_peak_tflops(device_name: str) -> float | None:
    """The device's dense bf16 spec peak, or None for a device not in the table."""
    for key, tflops in SPEC_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return None


def check_throughput(report: Report, device: torch.device, quick: bool) -> None:
    report.section("4. one layer stack: TFLOP/s and MFU (tools/benchmark_layer.py)")
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    peak = matmul_peak_tflops(device, dtype, 8192 if gpu else 256, iters=10)
    spec = spec_peak_tflops(torch.cuda.get_device_name(device)) if gpu else None
    report.line(f"measured {str(dtype).split('.')[-1]} matmul peak: {peak:.1f} TFLOP/s; spec "
                f"peak: {f'{spec:.0f} TFLOP/s' if spec else 'unknown device'}")
    report.line("")
    report.line("| shape | path | step ms | TFLOP/s | MFU (measured peak) | MFU (spec peak) |")
    report.line("|---|---|---|---|---|---|")
    shapes = ([("gpt2-1.3b", 1280, 20, 632, 8), ("h2048-s2048", 2048, 16, 2048, 2)] if gpu
              else [("tiny", 64, 4, 32, 2)])
    for name, hidden, heads, seq, batch in shapes:
        for fused in (True, False):
            config = ModelConfig(num_layers=4, hidden_size=hidden, num_attention_heads=heads,
                                 seq_length=seq, params_dtype="bf16" if gpu else "fp32",
                                 masked_softmax_fusion=fused, bias_gelu_fusion=fused,
                                 bias_dropout_fusion=fused)
            seconds = time_training_step(config, batch, device, 3 if quick else 10, 3)
            tflops = model_flops_per_step(config, batch) / seconds / 1e12
            of_spec = f"{100 * tflops / spec:.1f}%" if spec else "-"
            report.line(f"| {name} | {'fused' if fused else 'unfused'} | {seconds * 1e3:.2f} | "
                        f"{tflops:.2f} | {100 * tflops / peak:.1f}% | {of_spec} |")
            if spec and fused and hidden == 2048:
                mfu = tflops / spec
                report.verdict(f"MFU at hidden 2048 / seq 2048 >= {MFU_TARGET:.0%} of spec",
                               mfu >= MFU_TARGET, f"{mfu:.1%} ({tflops:.0f} of {spec:.0f})")
            if gpu:
                torch.cuda.empty_cache()
    _phases(report, shapes[-1], device, gpu, quick)


def _phases(report: Report, shape: tuple, device: torch.device, gpu: bool, quick: bool) -> None:
    """Forward + backward into the gradient buffers and the optimizer step, timed apart, with
    and without gradient-accumulation fusion."""
    name, hidden, heads, seq, batch = shape
    config = ModelConfig(num_layers=4, hidden_size=hidden, num_attention_heads=heads,
                         seq_length=seq, params_dtype="bf16" if gpu else "fp32")
    report.line("")
    report.line(f"{name}, 4 layers: forward + backward into the gradient buffers, then the "
                "optimizer step")
    report.line("")
    report.line("| gradient-accumulation fusion | forward+backward ms | optimizer ms |")
    report.line("|---|---|---|")
    for fusion in (True, False):
        compute, step = time_training_phases(config, batch, device, 3 if quick else 10, 3,
                                             gradient_accumulation_fusion=fusion)
        report.line(f"| {'on' if fusion else 'off'} | {compute * 1e3:.2f} | {step * 1e3:.2f} |")
        if gpu:
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ 5. memory
def check_memory(report: Report, device: torch.device) -> None:
    report.section("5. memory model vs torch.cuda.max_memory_allocated")
    if device.type != "cuda":
        report.line("- skipped (no CUDA allocator statistics on the CPU)")
        return
    config = ModelConfig(num_layers=4, hidden_size=1280, num_attention_heads=20, seq_length=632,
                         vocab_size=50257, params_dtype="bf16")
    batch = 4
    (stage,) = estimate_stage_memory(config, GPT2, [(0, 4)], batch, device_type="cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = GPTModel(config, pre_process=False, post_process=False, layer_range=(0, 4)).to(device)
    weights = torch.cuda.memory_allocated() - base
    hidden = torch.randn(632, batch, 1280, device=device, dtype=torch.bfloat16,
                         requires_grad=True)
    model.set_input_tensor(hidden)
    before = torch.cuda.memory_allocated()
    out = model(None, None)
    activations = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    out.float().sum().backward()
    layer_estimate = stage.activation_bytes  # this stage holds 4 layers, no ends
    report.line("| figure | estimate MiB | measured MiB | measured / estimate |")
    report.line("|---|---|---|---|")
    for name, est, got in (("parameters", stage.param_bytes, weights),
                           ("activations of one micro-batch", layer_estimate, activations)):
        report.line(f"| {name} | {est / 2**20:.1f} | {got / 2**20:.1f} | {got / est:.3f} |")
    ok = (abs(activations / layer_estimate - 1) < 0.15
          and abs(weights / stage.param_bytes - 1) < 0.02)
    report.verdict("estimates within 15% (activations) and 2% (parameters)", ok,
                   f"peak allocated {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")


# ------------------------------------------------------------------------------ 6. multi-GPU
MULTI_GPU_RUNS = (  # (name, GPUs, flags)
    ("Chimera D=2, bf16, distributed optimizer, overlapped reduction", 2,
     ["--pipeline-model-parallel-size", "2", "--chimera-pipes", "2",
      "--use-distributed-optimizer", "--overlap-grad-reduce", "--bf16"]),
    ("T=2 x Chimera D=2, bf16, sequence parallel", 4,
     ["--tensor-model-parallel-size", "2", "--sequence-parallel",
      "--pipeline-model-parallel-size", "2", "--chimera-pipes", "2", "--bf16"]),
)


def check_multi_gpu(report: Report, quick: bool) -> None:
    report.section("6. several GPUs: torchrun over NCCL")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        report.line(f"- skipped ({gpus} GPU visible)")
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    size = ["--num-layers", "4", "--hidden-size", "256" if quick else "1024",
            "--num-attention-heads", "8", "--seq-length", "256", "--max-position-embeddings",
            "256", "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "3e-3",
            "--train-iters", "30", "--mock-data", "--vocab-size", "512", "--log-interval", "10",
            "--eval-iters", "0", "--distributed-timeout-minutes", "2"]
    for name, needed, flags in MULTI_GPU_RUNS:
        if gpus < needed:
            report.line(f"- {name}: skipped (needs {needed} GPUs, {gpus} visible)")
            continue
        with tempfile.TemporaryDirectory() as tb:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={needed}",
                   str(ROOT / "pretrain_gpt2.py"), *size, *flags, "--tensorboard-dir", tb]
            start = time.perf_counter()
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
            if proc.returncode:
                report.verdict(name, False, f"exit {proc.returncode}: {proc.stderr[-500:]}")
                continue
            events = EventAccumulator(tb)
            events.Reload()
            loss = [e.value for e in events.Scalars("lm loss")]
            report.verdict(name, loss[-1] < 0.9 * loss[0],
                           f"lm loss {loss[0]:.3f} -> {loss[-1]:.3f} "
                           f"({time.perf_counter() - start:.0f} s)")


# ------------------------------------------------------------------------------ 7. memory report
def check_memory_report(report: Report, quick: bool, device: str) -> None:
    report.section("7. the training log's memory report: predicted vs measured per rank")
    size = (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "64"] if quick else
            ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
             "--seq-length", "1024"])
    cmd = [sys.executable, str(ROOT / "pretrain_gpt2.py"), *size, "--train-iters", "2",
           "--max-position-embeddings", size[size.index("--seq-length") + 1],
           "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "3e-3",
           "--mock-data", "--vocab-size", "50257", "--eval-iters", "0", "--num-workers", "0",
           "--bf16"]
    if device == "cpu":
        cmd += ["--distributed-backend", "gloo", "--allow-cpu-training"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"pretrain_gpt2.py failed:\n{proc.stderr[-3000:]}")
    lines = [line for line in proc.stdout.splitlines() if "] memory (MB) predicted:" in line]
    for line in lines:
        report.line(f"- `{line.strip()}`")
        predicted = float(line.split("|| measured:")[0].split("total ")[1].split()[0])
        measured = float(line.split("|| measured:")[1].split("total ")[1].split()[0])
        report.verdict("predicted total within 10% of measured", bool(lines) and
                       abs(predicted / measured - 1) <= 0.10,
                       f"predicted {predicted:.1f} MB, measured {measured:.1f} MB")
    if not lines:
        report.verdict("memory report in the log", False, "no memory report line")


def main(argv: list[str] | None = None) -> int:
    """Run every section, print the report, optionally write it (atomically)."""
    p = ToolArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test of the script)")
    p.add_argument("--output", default=None, help="write the Markdown report here")
    p.add_argument("--sections",
                   default="training,resume,attention,throughput,memory,multi-gpu,"
                           "memory-report",
                   help="comma-separated sections to run (default: all)")
    args = p.parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if args.device == "auto" else args.device)
    report = Report()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    report.line(f"# GPU check: {name}")
    report.line("")
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else "-"
    report.line(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, "
                f"`python tools/gpu_check.py{' --quick' if args.quick else ''}`")
    start = time.perf_counter()
    checks = {"training": lambda: check_training(report, args.quick, device.type),
              "resume": lambda: check_resume(report, device),
              "attention": lambda: check_attention(report, device, args.quick),
              "throughput": lambda: check_throughput(report, device, args.quick),
              "memory": lambda: check_memory(report, device),
              "multi-gpu": lambda: check_multi_gpu(report, args.quick),
              "memory-report": lambda: check_memory_report(report, args.quick, device.type)}
    for name in args.sections.split(","):
        if name not in checks:
            p.error(f"--sections: unknown section {name!r}; choose from {', '.join(checks)}")
    for name in args.sections.split(","):
        try:
            checks[name]()
        except Exception as exc:  # noqa: BLE001 - one failing section must not hide others
            report.verdict(f"{name} section", False, f"{type(exc).__name__}: {exc}")
    report.line("")
    report.line(f"{len(report.failures)} failed checks; {time.perf_counter() - start:.0f} s")
    if args.output:
        atomic_write_text(args.output, "\n".join(report.lines) + "\n")
    return 1 if report.failures else 0


if __name__ == "__main__":
    run_tool(main)
