#!/usr/bin/env python
"""The steps of ``tools/gpu_check.sh``: one GPU lease, one run, every figure written to ``$OUT``.

``tools/gpu_check.sh`` runs each step as its own process under ``timeout`` (so one hang or crash
costs only its step) and then ``summary``::

    python tools/gpu_check.py step <name>[,<name>..] --out DIR [--device cuda|cpu] [--budget S]
    python tools/gpu_check.py summary --out DIR

A step appends one JSON line to ``DIR/results.jsonl``: ``{"step", "status", "seconds",
"summary", ...figures}`` with status PASS, FAIL, INFO (figures, no verdict) or SKIP (not on this
device). ``summary`` turns the lines into ``DIR/gpu_check.md`` (a table per step) and
``DIR/gpu_check.json`` and prints both. Files under ``DIR`` (at most 8; only ``$OUT`` comes back
from a lent machine): ``results.jsonl``, ``gpu_check.log`` (every step's output, written by the
shell script), ``gpu_check.md``, ``gpu_check.json``, ``sync_audit.txt``, ``hardware_profile.json``.

The steps, in priority order (:data:`STEPS`; a later check is one more function registered with
:func:`step`, here or in a module imported below, and one line in the shell script's step list):

``env``
    torch, CUDA, NCCL, cuDNN, Triton versions, the device; whether NVIDIA Apex loaded; the
    attention kernel ``scaled_dot_product_attention`` selects at the model's shapes; whether
    ``torch.compile`` runs here (the bias-dropout-add fusion's probe).
``layer_mfu``
    a stack of transformer layers, forward + backward into the fp32 gradient buffers as training
    runs it (gradient-accumulation fusion where training uses it; no optimizer step), bf16, at
    hidden 2048 / seq 2048 and hidden 4096 / seq 4096, GPT and Llama shapes: TFLOP/s and MFU
    against the spec peak and the matmul peak measured in the same run. Model FLOPs as Megatron
    counts them (``layer_forward_flops`` x 3; attention over the full square, recomputation not
    counted). Verdict: issue 32's bar, 45% of the spec peak at hidden 2048 / seq 2048 (GPT).
``training`` (this and the next four steps: ``gpu_check_training.py``)
    ``pretrain_gpt2.py`` bf16 and fp16 (one process, mock data): the loss falls; fp16's loss
    scale stays finite with few skipped iterations. Keeps the log's memory-report lines.
``sync_audit``
    20 training iterations in this process under ``torch.cuda.set_sync_debug_mode("warn")``:
    every synchronizing call site with its count and Python stack (``sync_audit.txt``); FAIL when
    one is inside the micro-batch loop (the pipeline executor).
``recompute``
    full recomputation (``--recompute-granularity full``) with dropout on, so the compiled
    bias-dropout-add runs and is replayed: the losses equal the run without recomputation.
``resume``
    ``--async-save`` torch_dist checkpoints: a run stopped at iteration 10 and resumed gives the
    losses and, bit for bit, the iteration-20 checkpoint of the uninterrupted run.
    Both run ``pretrain_gpt2.py`` in deterministic mode (``torch.use_deterministic_algorithms``,
    warn only; ``CUBLAS_WORKSPACE_CONFIG=:4096:8``); where a CUDA kernel has no deterministic
    version the comparison falls back to a stated tolerance (2^-7 relative), said in the
    summary -- non-determinism alone cannot fail them.
``memory``
    the memory model's per-layer estimate against the allocator (``max_memory_allocated``), and
    the training log's predicted vs measured totals (from ``training``).
``hardware``
    a GEMM-efficiency sweep (tokens x hidden 4096), the HBM bandwidth (a device copy) and the
    gap per kernel, written as ``hardware_profile.json``: a
    :class:`~megatron_chimera.tuning.hardware.HardwareProfile` that ``--hardware FILE`` loads
    (the preset's data-sheet peaks with the measured fractions of them; the links are the
    preset's: one GPU measures no network).
``moe_experts`` (``gpu_check_moe_cp.py``, issue 41)
    one MoE layer (EP = 1, bf16; Mixtral-8x7B's and a 64-expert fine-grained shape, 8192
    tokens), forward + backward timed per piece with CUDA events -- route + dispatch, experts,
    combine -- with the grouped GEMM (``torch._grouped_mm``) and with the per-expert loop: ms and
    the expert GEMMs' TFLOP/s; PASS when the grouped result equals the loop's (bf16 bar 2^-5).
``ring_attention`` (``gpu_check_moe_cp.py``, issue 42)
    ring (``p2p``) attention at 32K tokens, causal, bf16, CP 2 and 4, its ranks run serially on
    the one GPU (``context_parallel/serial.py``): output and dQ/dK/dV against one SDPA call over
    the whole sequence (PASS within SDPA's own bf16 error, measured against an fp32 SDPA, plus
    2^-6), and the ranks' compute time (summed, slowest) against SDPA's (INFO).

``kernels`` (``gpu_check_kernels.py``, issue 49)
    cuDNN vs FlashAttention-2 vs memory-efficient SDPA at the layer shape (and SDPA's default
    and ``--use-flash-attn`` choices), and the fused weight gradient at a real transposed shape
    (error vs fp32, time vs unfused, the path training takes).
``moe_syncs`` (``gpu_check_moe_syncs.py``, issue 49)
    one MoE layer whose expert 0 receives no token: host synchronisations per forward
    (``torch.cuda.set_sync_debug_mode``, dropless and capacity modes, bar 1) and the zero-token
    expert against the per-expert loop.

``slices_cpu`` (only in the ``--device cpu`` run: a CPU question never spends a GPU lease)
    issue 42's real-CPU check, which needs more cores than the development machine has:
    ``tools/benchmark_sequence_slices.py`` under ``torch.distributed.run`` (4 gloo ranks, one
    thread each, ``CUDA_VISIBLE_DEVICES=""``), 2 sequences of 2048 tokens, sliced (k = 4) against
    unsliced Chimera at D = 4; PASS when their iteration-time ratio is <= 0.8 with >= 4 cores.

``--device cpu`` (``bash tools/gpu_check.sh --device cpu``) runs the CPU-runnable parts at tiny
shapes in fp32 -- the dry run that shows the script works before a lease is spent.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a bare checkout: nothing installed
sys.path.insert(0, str(ROOT / "tools"))

import torch  # noqa: E402

from megatron_chimera.errors import ToolArgumentParser, run_tool  # noqa: E402

RESULTS = "results.jsonl"
MFU_TARGET = 0.45  # of the spec peak at hidden 2048 / seq 2048, GPT shape (issue 32)
# dense bf16 tensor-core peaks (TFLOP/s) from the vendors' data sheets, by device-name substring
# (checked in this order: the PCIe H100 before the SXM default)
SPEC_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
                    ("H200", 989.0), ("A100", 312.0))


def spec_peak_tflops(device_name: str) -> float | None:
    """The device's dense bf16 spec peak, or None for a device not in the table."""
    for key, tflops in SPEC_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return None


@dataclass(frozen=True)
class Context:
    """What every step gets: the device, the output folder and the step's deadline."""

    device: torch.device
    out: Path
    deadline: float  # time.monotonic() by which the step must be done

    @property
    def gpu(self) -> bool:
        """Whether the step runs on CUDA (else the CPU dry run)."""
        return self.device.type == "cuda"

    def remaining(self, reserve: float = 5.0) -> float:
        """Seconds left for a subprocess, keeping ``reserve`` for the step's own report."""
        return max(1.0, self.deadline - time.monotonic() - reserve)


StepFunction = Callable[[Context], dict]
STEPS: dict[str, tuple[str, StepFunction]] = {}  # name -> (title, function), priority order


def step(name: str, title: str) -> Callable[[StepFunction], StepFunction]:
    """Register a step (the hook point for later checks: MoE expert GEMMs, ring attention)."""
    def register(function: StepFunction) -> StepFunction:
        STEPS[name] = (title, function)
        return function
    return register


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (CUDA) before reading the clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def skip(why: str) -> dict:
    """A step's result where it cannot run on this device."""
    return {"status": "SKIP", "summary": why}


# ------------------------------------------------------------------------------ env
SDPA_SHAPES = (  # (name, heads, K/V heads, seq, head_dim)
    ("h2048 16 heads", 16, 16, 2048, 128), ("h2048 32 heads GQA 8", 32, 8, 2048, 64),
    ("gpt2-1.3b h1280", 20, 20, 632, 64))


def sdpa_choice(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, seq: int,
                head_dim: int, dropout: float) -> str:
    """The kernel ``scaled_dot_product_attention`` selects for causal attention without a mask
    (the model's call; grouped-query K/V passed with ``enable_gqa``)."""
    q = torch.empty(1, heads, seq, head_dim, device=device, dtype=dtype)
    kv = torch.empty(1, kv_heads, seq, head_dim, device=device, dtype=dtype)
    choice = torch._fused_sdp_choice(q, kv, kv, attn_mask=None,  # noqa: SLF001
                                     dropout_p=dropout, is_causal=True,
                                     enable_gqa=kv_heads < heads)
    from torch.nn.attention import SDPBackend

    return SDPBackend(choice).name


def _version(module: str) -> str | None:
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        return version(module)
    return None


@step("env", "environment")
def check_env(ctx: Context) -> dict:
    """Versions, device, Apex, the SDPA kernel and whether torch.compile runs here."""
    from megatron_chimera.model import fused

    info: dict = {"python": sys.version.split()[0], "torch": torch.__version__,
                  "cuda": torch.version.cuda, "triton": _version("triton"),
                  "transformers": _version("transformers"), "device": "cpu"}
    if ctx.gpu:
        props = torch.cuda.get_device_properties(ctx.device)
        info.update(device=props.name, device_count=torch.cuda.device_count(),
                    memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}",
                    nccl=".".join(map(str, torch.cuda.nccl.version())),
                    cudnn=torch.backends.cudnn.version())
    info["apex"] = fused.apex_importable()
    info["fused_backend"] = fused.get_fused_backend().name
    dtype = torch.bfloat16 if ctx.gpu else torch.float32
    info["sdpa"] = {}
    for name, heads, kv, seq, head_dim in SDPA_SHAPES:
        for dropout in (0.0, 0.1):
            try:
                info["sdpa"][f"{name}, dropout {dropout:g}"] = sdpa_choice(
                    ctx.device, dtype, heads, kv, seq if ctx.gpu else 64, head_dim, dropout)
            except Exception as exc:  # noqa: BLE001 - recorded
                info["sdpa"][f"{name}, dropout {dropout:g}"] = f"{type(exc).__name__}: {exc}"
    if ctx.gpu:  # training compiles bias-dropout-add on CUDA only
        start = time.perf_counter()
        compiled = fused.fused_bias_dropout_add(ctx.device, dtype)
        info["torch_compile"] = ("runs" if compiled is not None else "falls back to eager") + \
            f" ({time.perf_counter() - start:.1f} s to probe)"
    else:
        info["torch_compile"] = "not probed (training compiles on CUDA only)"
    kernels = sorted(set(info["sdpa"].values()))
    return {"status": "INFO", **info,
            "summary": f"{info['device']}; torch {info['torch']}, CUDA {info['cuda']}, NCCL "
                       f"{info.get('nccl', '-')}, cuDNN {info.get('cudnn', '-')}, Triton "
                       f"{info['triton']}; Apex {'loaded' if info['apex'] else 'absent'}; SDPA "
                       f"{'/'.join(kernels)}; torch.compile {info['torch_compile']}"}


# ------------------------------------------------------------------------------ layer MFU
def layer_configs(gpu: bool) -> list[tuple[str, dict, int]]:
    """(name, ModelConfig fields, micro-batch) of the layer stacks to time."""
    llama = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                 add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)
    gpt = dict(hidden_dropout=0.0, attention_dropout=0.0)
    if not gpu:
        return [("gpt tiny", dict(gpt, hidden_size=64, num_attention_heads=4, seq_length=32), 2),
                ("llama tiny", dict(llama, hidden_size=64, num_attention_heads=4,
                                    num_query_groups=2, seq_length=32), 2)]
    return [
        ("gpt h2048 s2048", dict(gpt, hidden_size=2048, num_attention_heads=16,
                                 seq_length=2048), 2),
        ("llama h2048 s2048", dict(llama, hidden_size=2048, num_attention_heads=32,
                                   num_query_groups=8, ffn_hidden_size=5632,
                                   seq_length=2048), 2),
        ("gpt h4096 s4096", dict(gpt, hidden_size=4096, num_attention_heads=32,
                                 seq_length=4096), 1),
        ("llama h4096 s4096", dict(llama, hidden_size=4096, num_attention_heads=32,
                                   num_query_groups=8, ffn_hidden_size=14336,
                                   seq_length=4096), 1),
    ]


def time_forward_backward(config, batch: int, device: torch.device, steps: int,
                          warmup: int) -> tuple[float, bool]:
    """Median seconds of forward + backward of a middle stage into its gradient buffers, built
    as training builds them (fp32 ``main_grad`` for half-precision parameters; gradient-
    accumulation fusion where :func:`fusion_saves_work` says training uses it); no optimizer.
    Returns (seconds, fusion used)."""
    from megatron_chimera.distributed.grad_buffer import build_grad_buffers
    from megatron_chimera.model.gpt2 import GPTModel
    from megatron_chimera.tensor_parallel.weight_grad import fusion_saves_work

    model = GPTModel(config, pre_process=False, post_process=False).to(device)
    half = config.params_dtype in ("bf16", "fp16")
    fuse = fusion_saves_work(device, config.torch_dtype,
                             torch.float32 if half else config.torch_dtype)
    buffers = build_grad_buffers({0: model}, grad_reduce_in_fp32=half,
                                 fuse_wgrad_accumulation=fuse)
    shape = (config.seq_length, batch, config.hidden_size)
    hidden = torch.randn(shape, device=device, dtype=config.torch_dtype, requires_grad=True)
    grad = torch.randn(shape, device=device, dtype=config.torch_dtype)
    positions = torch.arange(config.seq_length, device=device).expand(batch, -1)
    times = []
    for i in range(warmup + steps):
        buffers.zero_()
        synchronize(device)
        start = time.perf_counter()
        model.set_input_tensor(hidden)
        model(None, positions).backward(grad)
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    buffers.remove_hooks()
    return sorted(times)[len(times) // 2], fuse


@step("layer_mfu", "layer MFU: forward + backward into the fp32 gradient buffers, no optimizer")
def check_layer_mfu(ctx: Context) -> dict:
    """TFLOP/s and MFU of each layer stack (see the module docstring)."""
    from benchmark_layer import matmul_peak_tflops, model_flops_per_step

    from megatron_chimera.config import ModelConfig

    dtype = torch.bfloat16 if ctx.gpu else torch.float32
    peak = matmul_peak_tflops(ctx.device, dtype, 8192 if ctx.gpu else 256, iters=10)
    spec = spec_peak_tflops(torch.cuda.get_device_name(ctx.device)) if ctx.gpu else None
    rows, verdict = [], None
    for name, fields, batch in layer_configs(ctx.gpu):
        config = ModelConfig(num_layers=2, params_dtype="bf16" if ctx.gpu else "fp32",
                             vocab_size=1024, **fields)
        try:
            seconds, fused_acc = time_forward_backward(config, batch, ctx.device,
                                                       10 if ctx.gpu else 3, 3 if ctx.gpu else 1)
        except torch.OutOfMemoryError as exc:
            rows.append({"shape": name, "error": f"out of memory: {str(exc)[:120]}"})
            continue
        finally:
            if ctx.gpu:
                torch.cuda.empty_cache()
        tflops = model_flops_per_step(config, batch) / seconds / 1e12
        row = {"shape": name, "micro_batch": batch, "ms": round(seconds * 1e3, 3),
               "tflops": round(tflops, 4), "mfu_measured_peak": round(tflops / peak, 4),
               "mfu_spec": round(tflops / spec, 4) if spec else None,
               "grad_accumulation_fusion": fused_acc}
        rows.append(row)
        if spec and name == "gpt h2048 s2048":
            verdict = tflops / spec >= MFU_TARGET
    result = {"peak_tflops_measured": round(peak, 1), "spec_peak_tflops": spec, "rows": rows,
              "status": "INFO" if verdict is None else ("PASS" if verdict else "FAIL")}
    parts = [f"matmul peak {peak:.3g} TFLOP/s measured, spec {spec or '-'}"]
    for r in rows:
        if "tflops" not in r:
            parts.append(f"{r['shape']}: {r['error']}")
            continue
        share, of = (r["mfu_spec"], "spec") if r["mfu_spec"] else (r["mfu_measured_peak"],
                                                                     "measured peak")
        parts.append(f"{r['shape']}: {r['tflops']} TFLOP/s ({100 * share:.1f}% of {of})")
    result["summary"] = "; ".join(parts)
    if verdict is not None:
        result["summary"] += f"; bar: {MFU_TARGET:.0%} of spec at gpt h2048 s2048"
    return result


# ------------------------------------------------------------------------------ training runs
# training, sync_audit, recompute, resume and memory are in gpu_check_training.py; it registers
# them with @step of this module (also when this file runs as the script).
sys.modules.setdefault("gpu_check", sys.modules[__name__])
import gpu_check_training  # noqa: E402,F401


# ------------------------------------------------------------------------------ hardware
def copy_bandwidth_gbps(device: torch.device, nbytes: int, iters: int) -> float:
    """Best device-memory bandwidth of a copy (GB/s; read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def kernel_gap_s(device: torch.device, launches: int) -> float:
    """Seconds per kernel of ``launches`` back-to-back tiny kernels (an upper bound on the device
    gap between two kernels: eager launches, so the host's launch rate may set it)."""
    x = torch.zeros(16, device=device)
    for _ in range(10):
        x.add_(1)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(launches):
        x.add_(1)
    synchronize(device)
    return (time.perf_counter() - start) / launches


def preset_for(device_name: str):
    """The published preset of this device (``tuning/hardware.py``), or None."""
    from megatron_chimera.tuning.hardware import PRESETS

    name = device_name.lower()
    for key in ("h200", "h100", "a100"):
        if key in name and "pcie" not in name and "nvl" not in name:
            return PRESETS[key]
    return None


@step("hardware", "GEMM-efficiency sweep and HBM bandwidth -> hardware_profile.json")
def check_hardware(ctx: Context) -> dict:
    """The sweep, the bandwidth, and a profile ``--hardware`` loads: the data-sheet peaks and
    HBM bandwidth of the device's preset, with the measured fractions of them (``efficiency``:
    the best GEMM of the sweep over the bf16 peak; ``memory_efficiency``: the device copy over
    the HBM bandwidth), the SM count and the measured gap per kernel. For a device without a
    preset (and on the CPU) the measured figures are the peaks (fractions 1)."""
    from benchmark_layer import gemm_tflops

    from megatron_chimera.tuning.hardware import PRESETS, load_hardware

    half = torch.bfloat16 if ctx.gpu else torch.float32
    hidden = 4096 if ctx.gpu else 256
    tokens = [256, 512, 1024, 2048, 4096, 8192, 16384] if ctx.gpu else [16, 64, 256]
    iters = 20 if ctx.gpu else 3
    sweep = []
    for m in tokens:  # a layer's GEMMs: [tokens, h] x [h, 4h] and [tokens, 4h] x [4h, h]
        up = gemm_tflops(ctx.device, half, m, hidden, 4 * hidden, iters)
        down = gemm_tflops(ctx.device, half, m, 4 * hidden, hidden, iters)
        sweep.append((m, (up + down) / 2))
    best = max(rate for _, rate in sweep)
    if ctx.gpu:
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        fp32 = gemm_tflops(ctx.device, torch.float32, 8192, 8192, 8192, 5)
        torch.backends.cuda.matmul.allow_tf32 = tf32
        props = torch.cuda.get_device_properties(ctx.device)
        name, memory_gb, per_node, sms = (props.name, props.total_memory / 1e9,
                                          torch.cuda.device_count(), props.multi_processor_count)
    else:
        fp32 = best
        name, memory_gb, per_node, sms = "cpu-dry-run", 1.0, 1, 0
    bandwidth = copy_bandwidth_gbps(ctx.device, (2 << 30) if ctx.gpu else (64 << 20),
                                    10 if ctx.gpu else 3)
    gap = kernel_gap_s(ctx.device, 2000 if ctx.gpu else 200)
    preset = preset_for(name) if ctx.gpu else None
    links = preset or PRESETS["h100"]
    peak_half = preset.peak_tflops_half if preset else best
    hbm = preset.hbm_bandwidth_gbps if preset and preset.hbm_bandwidth_gbps else bandwidth
    profile = {
        "name": name.replace(" ", "-").lower() + "-measured" if ctx.gpu else name,
        "peak_tflops_fp32": preset.peak_tflops_fp32 if preset else round(fp32, 2),
        "peak_tflops_half": peak_half, "efficiency": round(min(best / peak_half, 1.0), 4),
        "memory_gb": round(memory_gb, 2), "gpus_per_node": per_node,
        "intra_node": {"alpha_s": links.intra_node.alpha_s,
                       "bandwidth_gbps": links.intra_node.bandwidth_gbps},
        "inter_node": {"alpha_s": links.inter_node.alpha_s,
                       "bandwidth_gbps": links.inter_node.bandwidth_gbps},
        "hbm_bandwidth_gbps": round(hbm, 1),
        "memory_efficiency": round(min(bandwidth / hbm, 1.0), 4),
        "num_sms": sms, "kernel_overhead_s": round(gap, 9),
    }
    path = ctx.out / "hardware_profile.json"
    path.write_text(json.dumps(profile, indent=2) + "\n")
    loaded = load_hardware(str(path))  # the performance model reads it back
    layer = read_results(ctx.out).get("layer_mfu", {})
    layer_best = max((r["tflops"] for r in layer.get("rows", []) if "tflops" in r), default=None)
    return {"status": "INFO", "profile": profile, "fp32_tflops_measured": round(fp32, 2),
            "copy_bandwidth_gbps": round(bandwidth, 1),
            "sweep": [{"tokens": m, "tflops": round(r, 3)} for m, r in sweep],
            "summary": f"{'bf16' if ctx.gpu else 'fp32'} GEMM best {best:.3g} TFLOP/s "
                       f"({loaded.efficiency:.0%} of {peak_half:.4g}; smallest sweep point "
                       f"{sweep[0][1]:.3g}), fp32 {fp32:.3g}; copy {bandwidth:.0f} GB/s "
                       f"({loaded.memory_efficiency:.0%} of {hbm:.0f}); {1e6 * gap:.1f} us per "
                       f"kernel; best layer {layer_best} TFLOP/s; hardware_profile.json (links: "
                       f"the {links.name} preset's)"}


# ------------------------------------------------------------------------------ sliced Chimera, CPU
SLICES_RANKS, SLICES_TARGET = 4, 0.8  # issue 42: D = 4, sliced <= 0.8 x unsliced Chimera
SLICES_RE = re.compile(r"^\s+(chimera, .*?)\s+([0-9.]+) ms/iter .*?= ([0-9.]+) cores", re.M)


def forked_ranks(script: str, argv: list[str], env: dict,
                 timeout: float) -> subprocess.CompletedProcess:
    """``script`` on :data:`SLICES_RANKS` gloo ranks forked from this process (the environment
    torchrun gives its workers: rank, world size, rendezvous address); rank 0's output first."""
    import importlib.util
    import socket

    from gpu_check_training import _run_script, run_forked

    spec = importlib.util.spec_from_file_location("benchmark_sequence_slices", script)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # its imports, before forking
    with socket.socket() as sock:  # a free port for rank 0's store
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    world = str(SLICES_RANKS)
    calls = [(_run_script, (script, argv, dict(
        env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=world, LOCAL_WORLD_SIZE=world,
        GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)), False))
        for r in range(SLICES_RANKS)]
    procs = run_forked(calls, timeout)
    failed = [p for p in procs if p.returncode]
    return subprocess.CompletedProcess(
        script, failed[0].returncode if failed else 0, "".join(p.stdout for p in procs),
        "".join(p.stderr for p in failed or procs))


@step("slices_cpu", "CPU: sequence-sliced Chimera vs unsliced, D=4, 2 sequences")
def check_slices_cpu(ctx: Context) -> dict:
    """``tools/benchmark_sequence_slices.py`` on this machine's CPU cores (4 gloo ranks, one
    thread each, no GPU): issue 42's real-CPU check, which needs at least D = 4 free cores (the
    development VM has 2). Verdict only with the real sizes (CUDA machine) and >= 4 cores: PASS
    when the measured sliced / unsliced iteration time is <= 0.8; otherwise INFO."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    sizes = (["--seq-length", "2048", "--iters", "3", "--rounds", "3"] if ctx.gpu else
             ["--seq-length", "64", "--hidden-size", "32", "--num-layers", "4", "--iters", "1",
              "--rounds", "1"])
    script = str(ROOT / "tools" / "benchmark_sequence_slices.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(SLICES_RANKS), script, "--sequences", "2", "--slices", "4", *sizes]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get(
                   "PYTHONPATH")])]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if ctx.gpu:
        print(f"$ {' '.join(cmd[1:])}  ({cores} cores)", flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env,
                              timeout=ctx.remaining())
    else:  # the dry-run sizes: the ranks forked from this process (5 interpreter starts saved)
        print(f"$ {' '.join(cmd[cmd.index(script):])}  ({SLICES_RANKS} ranks forked from this "
              f"process, as torchrun sets them up; {cores} cores)", flush=True)
        proc = forked_ranks(script, cmd[cmd.index(script) + 1:], env, ctx.remaining())
    print(proc.stdout[-2000:], proc.stderr[-1500:], sep="\n", flush=True)
    measured = re.search(r"iteration time: ([0-9.]+) \(measured\)", proc.stdout)
    simulated = re.search(r"\(simulated.*?\): ([0-9.]+)", proc.stdout)
    if proc.returncode or not measured:
        raise RuntimeError(f"benchmark_sequence_slices.py exited {proc.returncode}: "
                           f"{proc.stderr.strip().splitlines()[-1:] or proc.stdout[-300:]}")
    ratio = float(measured.group(1))
    rows = [{"row": name, "ms_per_iter": float(ms), "cores_busy": float(busy)}
            for name, ms, busy in SLICES_RE.findall(proc.stdout)]
    judged = ctx.gpu and cores >= SLICES_RANKS
    status = ("PASS" if ratio <= SLICES_TARGET else "FAIL") if judged else "INFO"
    return {"status": status, "ratio": ratio, "cores": cores, "rows": rows,
            "simulated_ratio": float(simulated.group(1)) if simulated else None,
            "summary": f"sliced (k=4) / unsliced Chimera iteration time {ratio:.3f} on {cores} "
                       f"cores (target <= {SLICES_TARGET}"
                       f"{'' if judged else ', not judged: dry-run sizes or < 4 cores'}; "
                       + ", ".join(f"{r['ms_per_iter']:.1f} ms" for r in rows)
                       + f"; simulated on 4 devices {simulated.group(1) if simulated else '-'})"}


# ------------------------------------------------------------------------------ MoE, ring
# The MoE-experts and ring-attention steps (issues 41, 42) are in gpu_check_moe_cp.py; it
# registers them with @step of this module (also when this file runs as the script).
import gpu_check_kernels  # noqa: E402,F401
import gpu_check_moe_cp  # noqa: E402,F401
import gpu_check_moe_syncs  # noqa: E402,F401

# ------------------------------------------------------------------------------ running
#: this run's id (``gpu_check.sh`` sets it): results.jsonl keeps every run's lines
RUN = os.environ.get("GPU_CHECK_RUN")


def read_results(out: Path, run: str | None = RUN) -> dict[str, dict]:
    """The steps' results so far, by step (the last line of a step wins; only ``run``'s lines
    when given)."""
    results: dict[str, dict] = {}
    path = out / RESULTS
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                entry = json.loads(line)
                if run is None or entry.get("run") == run:
                    results[entry["step"]] = entry
    return results


def append_result(out: Path, entry: dict) -> None:
    """One JSON line in ``results.jsonl`` (appended, never truncated: the steps run one after
    another, and earlier runs' lines stay)."""
    with open(out / RESULTS, "a") as handle:
        handle.write(json.dumps(entry, default=str) + "\n")


class StepTimeout(BaseException):
    """SIGTERM from the shell's ``timeout``: end the step (its subprocesses are killed). Not an
    Exception: nothing on the way (a compile probe's fallback) may take it for a failure."""


def _raise_timeout(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    raise StepTimeout()


def timeout_raises() -> None:
    signal.signal(signal.SIGTERM, _raise_timeout)


def run_step(name: str, device: torch.device, out: Path, budget: float) -> int:
    """Run one step and record its result (a failure is a result too); 1 when it timed out."""
    title, function = STEPS[name]
    print(f"\n== {name}: {title}", flush=True)
    timeout_raises()
    start = time.monotonic()
    ctx = Context(device, out, start + budget)
    code = 0
    try:
        entry = function(ctx)
    except StepTimeout:
        entry = {"status": "FAIL", "summary": f"timed out after {budget:.0f} s"}
        code = 1
    except Exception as exc:  # noqa: BLE001 - recorded as the step's result
        traceback.print_exc()
        entry = {"status": "FAIL", "summary": f"{type(exc).__name__}: {str(exc)[:400]}"}
    entry = {"step": name, "run": RUN, "title": title,
             "seconds": round(time.monotonic() - start, 1), **entry}
    append_result(out, entry)
    print(f"-- {name}: {entry['status']} ({entry['seconds']} s): {entry['summary']}", flush=True)
    return code


def render(results: dict[str, dict]) -> str:
    """The Markdown report: one summary table, then the layer-MFU table."""
    lines = ["| step | status | s | result |", "|---|---|---|---|"]
    for name in [*STEPS, *(n for n in results if n not in STEPS)]:
        if name in results:
            r = results[name]
            lines.append(f"| {name} | {r['status']} | {r.get('seconds', '-')} | "
                         f"{str(r.get('summary', '')).replace('|', '/')} |")
    rows = results.get("layer_mfu", {}).get("rows", [])
    if rows:
        lines += ["", "| layer stack (2 layers) | micro-batch | ms | TFLOP/s | MFU (spec) | "
                  "MFU (measured peak) | grad-acc fusion |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            if "tflops" not in r:
                lines.append(f"| {r['shape']} | - | - | - | - | - | {r['error']} |")
                continue
            spec = f"{100 * r['mfu_spec']:.1f}%" if r.get("mfu_spec") else "-"
            lines.append(f"| {r['shape']} | {r['micro_batch']} | {r['ms']} | {r['tflops']} | "
                         f"{spec} | {100 * r['mfu_measured_peak']:.1f}% | "
                         f"{'on' if r['grad_accumulation_fusion'] else 'off'} |")
    for name in STEPS:  # a step's own table (Markdown lines), when it gives one
        if results.get(name, {}).get("table"):
            lines += ["", *results[name]["table"]]
    return "\n".join(lines) + "\n"


def summarize(out: Path) -> int:
    """Write gpu_check.md and gpu_check.json from the steps' lines and print both; exit 1 when
    a step failed."""
    results = read_results(out)
    table = render(results)
    (out / "gpu_check.md").write_text(table)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    print("\n" + table)
    print(json.dumps({name: {"status": r["status"], "summary": r.get("summary")}
                      for name, r in results.items()}, indent=1))
    failed = [n for n, r in results.items() if r["status"] == "FAIL"]
    print(f"\n{len(failed)} failed step(s){': ' + ', '.join(failed) if failed else ''}; "
          f"files in {out}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """``step NAME`` or ``summary`` (see the module docstring)."""
    p = ToolArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("step", "summary", "list"))
    p.add_argument("name", nargs="?", help="the step (with 'step')")
    p.add_argument("--out", default=os.environ.get("OUT"), help="output folder (default $OUT)")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--budget", type=float, default=600.0, help="the step's seconds")
    args = p.parse_args(argv)
    if args.command == "list":
        print(" ".join(STEPS))
        return 0
    if not args.out:
        p.error("--out (or $OUT) is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.command == "summary":
        return summarize(out)
    names = (args.name or "").split(",")
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        p.error(f"unknown step {unknown[0]!r}; choose from {', '.join(STEPS)}")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if args.device == "auto" else args.device)
    end = time.monotonic() + args.budget  # several steps (the CPU dry run): one budget
    for name in names:  # after a timeout the rest are left to the shell (recorded as killed)
        if run_step(name, device, out, end - time.monotonic()):
            return 1
    return 0


if __name__ == "__main__":
    run_tool(main)
