"""The training-run steps of ``tools/gpu_check.py`` (registered with its :func:`~gpu_check.step`):
``training`` (bf16 and fp16 runs of ``pretrain_gpt2.py``: the loss falls), ``sync_audit`` (host
syncs inside the micro-batch loop), ``recompute`` (full recomputation with the compiled
bias-dropout-add replayed), ``resume`` (async torch_dist save and exact resume) and ``memory``
(the memory model against the allocator). What each checks: ``tools/gpu_check.py``'s docstring.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import gpu_check  # read_results, timeout_raises: defined after this module is imported
import torch
from gpu_check import ROOT, Context, skip, step

# ------------------------------------------------------------------------------ training runs
LOSS_RE = re.compile(r" iteration\s+(\d+)/\s*\d+ .*? lm loss: ([0-9.E+-]+)")
SCALE_RE = re.compile(r" iteration\s+(\d+)/.*? loss scale: ([0-9.]+).*? number of skipped "
                      r"iterations:\s+(\d+)")


def model_flags(gpu: bool, dropout: float = 0.0, layers: int = 4) -> list[str]:
    """A small GPT-2 for the training steps (tiny on the CPU)."""
    hidden, heads, seq = (1024, 16, 1024) if gpu else (64, 4, 32)
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads",
            str(heads), "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--micro-batch-size", "4" if gpu else "2", "--global-batch-size", "16" if gpu else "4",
            "--lr", "3e-3" if gpu else "1e-2", "--lr-warmup-fraction", "0.1", "--mock-data",
            "--vocab-size", "512",
            "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
            "--hidden-dropout", str(dropout), "--attention-dropout", str(dropout), "--seed", "7"]


#: runs ``pretrain_gpt2.py`` (``sys.argv[0]``) with torch's deterministic algorithms on (warn
#: only: a kernel without a deterministic version still runs, and the comparison's tolerance
#: covers it); cuBLAS needs CUBLAS_WORKSPACE_CONFIG for deterministic GEMMs
DETERMINISTIC = ("import runpy, sys, torch; torch.use_deterministic_algorithms(True, "
                 "warn_only=True); sys.argv = sys.argv[1:]; "
                 "runpy.run_path(sys.argv[0], run_name='__main__')")
#: relative tolerance of the resume / recompute comparisons where a run is not bit-identical
#: (a CUDA kernel without a deterministic version, e.g. memory-efficient attention's backward):
#: 2^-7, bf16's unit roundoff x 2 -- a real resume or recompute bug shows orders above it
RERUN_TOLERANCE = 2.0 ** -7


def _run_script(script: str, argv: list[str], env: dict, deterministic: bool) -> None:
    """A forked child's run of ``script`` as ``__main__`` with its own environment and
    arguments (``deterministic``: as :data:`DETERMINISTIC` does)."""
    import runpy

    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *argv]
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    runpy.run_path(script, run_name="__main__")


def _forked(target: Callable[..., None], args: tuple, out: int, err: int) -> None:
    os.dup2(out, 1)  # the child's output goes to the parent's files
    os.dup2(err, 2)
    os.chdir(ROOT)
    target(*args)


def import_training() -> None:
    """What a training run imports, once in this process before its forks (torch.optim imports
    torch._dynamo at the first optimizer)."""
    import torch._dynamo  # noqa: F401

    import megatron_chimera.training  # noqa: F401


def run_forked(calls: list[tuple[Callable[..., None], tuple]],
               timeout: float) -> list[subprocess.CompletedProcess]:
    """Each ``target(*args)`` of ``calls`` in a child forked from this process (the CPU dry run),
    all at once; their exit codes and outputs. A run of ``pretrain_gpt2.py``
    (:func:`_run_script`) is the same run as a fresh ``python pretrain_gpt2.py`` without the
    interpreter's start (torch, torch._dynamo and the framework imported once here: ~4 s of CPU
    saved per process). As under torchrun, the first child to fail ends the others. Only where
    this process has run no computation yet (no thread pool to inherit); never on CUDA (a CUDA
    context does not survive a fork)."""
    import multiprocessing
    import multiprocessing.connection
    import tempfile

    with contextlib.ExitStack() as stack:
        files = [tuple(stack.enter_context(tempfile.TemporaryFile()) for _ in "oe")
                 for _ in calls]
        sys.stdout.flush()
        sys.stderr.flush()
        fork = multiprocessing.get_context("fork")
        children = [fork.Process(target=_forked, args=(target, args, out.fileno(), err.fileno()))
                    for (target, args), (out, err) in zip(calls, files)]
        for child in children:
            child.start()
        deadline = time.monotonic() + timeout
        try:
            running = list(children)
            while running and time.monotonic() < deadline:
                multiprocessing.connection.wait([c.sentinel for c in running],
                                                deadline - time.monotonic())
                running = [c for c in running if c.exitcode is None]
                if any(c.exitcode for c in children):  # one failed: the others would hang
                    break
        finally:  # a timeout, a failure, or the step's own StepTimeout: the children go too
            timed_out = any(c.exitcode is None for c in children) and not any(
                c.exitcode for c in children)
            for child in children:
                if child.exitcode is None:
                    child.kill()
                child.join()
        if timed_out:
            raise subprocess.TimeoutExpired(f"{len(calls)} forked process(es)", timeout)
        results = []
        for child, (_target, args), (out, err) in zip(children, calls, files):
            out.seek(0)
            err.seek(0)
            results.append(subprocess.CompletedProcess(
                args, child.exitcode, out.read().decode(errors="replace"),
                err.read().decode(errors="replace")))
    return results


def pretrain(ctx: Context, flags: list[str], reserve: float = 5.0,
             deterministic: bool = False) -> str:
    """Run ``pretrain_gpt2.py`` (one process; ``deterministic``: with torch's deterministic
    algorithms); its stdout, or RuntimeError with its stderr. On the CPU the process is forked
    from this one (:func:`run_forked`), on CUDA a fresh interpreter."""
    script = str(ROOT / "pretrain_gpt2.py")
    cmd = ([sys.executable, "-c", DETERMINISTIC, script] if deterministic
           else [sys.executable, script]) + list(flags)
    if not ctx.gpu:
        cmd += ["--distributed-backend", "gloo", "--allow-cpu-training"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if deterministic:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    if ctx.gpu:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env,
                              timeout=ctx.remaining(reserve))
    else:
        import_training()
        proc, = run_forked([(_run_script, (script, cmd[cmd.index(script) + 1:], env,
                                           deterministic))], ctx.remaining(reserve))
    print(proc.stdout[-2000:], proc.stderr[-2000:], sep="\n", flush=True)
    if proc.returncode:
        raise RuntimeError(f"pretrain_gpt2.py exited {proc.returncode}: "
                           f"{proc.stderr.strip().splitlines()[-1:] or proc.stdout[-300:]}")
    return proc.stdout


def losses(log: str) -> dict[int, str]:
    """Iteration -> the logged lm loss (as printed, 7 significant digits)."""
    return {int(m.group(1)): m.group(2) for m in LOSS_RE.finditer(log)}


def close_losses(a: dict[int, str], b: dict[int, str]) -> tuple[bool, bool]:
    """(bit-identical as logged, within :data:`RERUN_TOLERANCE` relative) of two loss logs."""
    if not a or a.keys() != b.keys():
        return False, False
    return a == b, all(abs(float(a[i]) - float(b[i])) <= RERUN_TOLERANCE * abs(float(a[i]))
                       for i in a)


def falls(values: list[float]) -> tuple[bool, float, float]:
    """Whether the mean of the last 5 values is under 0.9x the mean of the first 5."""
    head, tail = sum(values[:5]) / 5, sum(values[-5:]) / 5
    return tail < 0.9 * head, head, tail


@step("training", "training bf16 and fp16: the loss falls")
def check_training(ctx: Context) -> dict:
    """bf16 and (CUDA) fp16 runs of pretrain_gpt2.py."""
    iters = 100 if ctx.gpu else 20
    runs, ok, memory_lines = {}, True, []
    for precision in ("bf16", "fp16") if ctx.gpu else ("bf16",):
        flags = model_flags(ctx.gpu, layers=8 if ctx.gpu else 2) + [
            "--train-iters", str(iters), f"--{precision}"]
        if precision == "fp16":
            flags += ["--initial-loss-scale", "65536"]
        start = time.perf_counter()
        log = pretrain(ctx, flags, reserve=40.0 if precision == "bf16" and ctx.gpu else 5.0)
        values = [float(v) for _, v in sorted(losses(log).items())]
        good, head, tail = falls(values)
        run = {"falls": good, "first5": round(head, 4), "last5": round(tail, 4),
               "iterations": len(values), "seconds": round(time.perf_counter() - start, 1)}
        if precision == "fp16":
            scales = [(float(m.group(2)), int(m.group(3))) for m in SCALE_RE.finditer(log)]
            skipped = sum(s for _, s in scales)
            run.update(loss_scale_first=scales[0][0] if scales else None,
                       loss_scale_last=scales[-1][0] if scales else None, skipped=skipped)
            good = good and bool(scales) and all(0 < s < float("inf") for s, _ in scales) \
                and skipped <= 20
        memory_lines += [line.strip() for line in log.splitlines()
                         if "memory (MB) predicted:" in line]
        runs[precision] = run
        ok = ok and good
    return {"status": "PASS" if ok else "FAIL", "runs": runs, "memory_report": memory_lines,
            "summary": "; ".join(f"{p}: loss {r['first5']} -> {r['last5']} in {r['iterations']} "
                                 f"iterations ({r['seconds']} s)"
                                 + (f", loss scale {r['loss_scale_first']} -> "
                                    f"{r['loss_scale_last']}, {r['skipped']} skipped"
                                    if p == "fp16" else "") for p, r in runs.items())}


# ------------------------------------------------------------------------------ sync audit
SYNC_MESSAGE = "called a synchronizing CUDA operation"


def _where(stack: list[traceback.FrameSummary]) -> tuple[str, str]:
    """(call site: the innermost frame in the project, region: where in training it is)."""
    ours = [f for f in stack if str(ROOT) in f.filename and "gpu_check" not in f.filename]
    site = ours[-1] if ours else stack[-1]
    files = " ".join(f.filename for f in ours)
    if "pipeline/executor.py" in files or "pipeline/program.py" in files:
        region = "micro-batch loop"
    elif "training/training.py" in files:
        region = "per iteration (outside the micro-batch loop)"
    else:
        region = "setup / other"
    relative = os.path.relpath(site.filename, ROOT)
    return f"{relative}:{site.lineno} in {site.name}: {site.line}", region


def _train_audited(gpu: bool, sites: collections.Counter, regions: dict[str, str],
                   stacks: dict[str, str]) -> None:
    """Train in this process (20 iterations; 4 on the CPU), every synchronizing call counted in
    ``sites`` with its region and stack."""
    import runpy
    import warnings

    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if SYNC_MESSAGE not in str(message):
            return original(message, category, filename, lineno, file, line)
        stack = traceback.extract_stack()[:-1]
        site, region = _where(stack)
        sites[site] += 1
        regions[site] = region
        stacks.setdefault(site, "".join(traceback.format_list(stack[-8:])))
        return None

    warnings.showwarning = record
    warnings.filterwarnings("always", message=SYNC_MESSAGE)
    argv = sys.argv
    sys.argv = ["pretrain_gpt2.py", *model_flags(gpu), "--train-iters",
                "20" if gpu else "4", "--bf16"]
    if gpu:
        torch.cuda.set_sync_debug_mode("warn")
    else:
        sys.argv += ["--distributed-backend", "gloo", "--allow-cpu-training"]
    try:
        runpy.run_path(str(ROOT / "pretrain_gpt2.py"), run_name="__main__")
    finally:
        if gpu:
            torch.cuda.set_sync_debug_mode("default")
        sys.argv, warnings.showwarning = argv, original
        gpu_check.timeout_raises()  # run_main ignored SIGTERM from its end on


@step("sync_audit", "host-sync audit: 20 iterations under set_sync_debug_mode")
def check_sync_audit(ctx: Context) -> dict:
    """Train 20 iterations in this process; record every synchronizing call with its stack.
    On the CPU the in-process run is exercised (4 iterations, in a child forked from this
    process: the steps after it need a process that has not trained) with nothing to audit."""
    sites: collections.Counter = collections.Counter()
    regions: dict[str, str] = {}
    stacks: dict[str, str] = {}
    if not ctx.gpu:
        import_training()
        proc, = run_forked([(_train_audited, (False, sites, regions, stacks))],
                           ctx.remaining())
        print(proc.stdout[-2000:], proc.stderr[-2000:], sep="\n", flush=True)
        if proc.returncode:
            raise RuntimeError(f"the audited run exited {proc.returncode}: "
                               f"{proc.stderr.strip().splitlines()[-1:] or proc.stdout[-300:]}")
        return skip("trained 4 iterations in this process (forked); set_sync_debug_mode "
                    "watches CUDA synchronizations only")
    _train_audited(True, sites, regions, stacks)
    in_loop = {s: n for s, n in sites.items() if regions[s] == "micro-batch loop"}
    lines = [f"{n:6d}  [{regions[s]}]  {s}" for s, n in sites.most_common()]
    text = ["synchronizing call sites over 20 iterations (count, region, innermost project "
            "frame); stacks below", *lines, ""]
    for site, stack in stacks.items():
        text += [f"== {site}", stack]
    (ctx.out / "sync_audit.txt").write_text("\n".join(text) + "\n")
    return {"status": "FAIL" if in_loop else "PASS",
            "sites": [{"site": s, "count": n, "region": regions[s]} for s, n in
                      sites.most_common()],
            "summary": f"{sum(sites.values())} synchronizing calls at {len(sites)} sites; "
                       f"{len(in_loop)} inside the micro-batch loop"
                       + (f" ({'; '.join(in_loop)})" if in_loop else "")
                       + " (sync_audit.txt)"}


# ------------------------------------------------------------------------------ recompute
@step("recompute", "full recomputation with the compiled bias-dropout-add")
def check_recompute(ctx: Context) -> dict:
    """The same run with and without full recomputation, dropout on: equal losses."""
    iters = 10 if ctx.gpu else 4
    base = model_flags(ctx.gpu, dropout=0.1, layers=4) + ["--train-iters", str(iters),
                                                          "--bf16"]
    plain = pretrain(ctx, base, reserve=30.0 if ctx.gpu else 15.0, deterministic=True)
    full = pretrain(ctx, base + ["--recompute-granularity", "full", "--recompute-method",
                                 "uniform", "--recompute-num-layers", "1"], deterministic=True)
    a, b = losses(plain), losses(full)
    fallback = "torch.compile cannot run" in plain + full
    same, close = close_losses(a, b)
    how = ("eager (the compiler fell back)" if fallback else "compiled" if ctx.gpu
           else "eager (CPU)")
    verdict = ("equal" if same else f"within {RERUN_TOLERANCE:.0e} (not bit-identical)"
               if close else "DIFFER")
    return {"status": "PASS" if close else "FAIL", "losses": a, "recomputed_losses": b,
            "compile_fell_back": fallback, "bit_identical": same,
            "summary": f"{len(a)} iterations, deterministic mode, losses {verdict} with full "
                       f"recomputation; bias-dropout-add {how}"}


# ------------------------------------------------------------------------------ resume
@step("resume", "async torch_dist save and exact resume")
def check_resume(ctx: Context) -> dict:
    """Uninterrupted run vs a run stopped at half and resumed from its async checkpoint."""
    from megatron_chimera.checkpoint.checkpointing import read_tracker
    from megatron_chimera.checkpoint.sharded import read_full_tensors

    iters, half = (20, 10) if ctx.gpu else (6, 3)
    base = model_flags(ctx.gpu, layers=2) + ["--train-iters", str(iters), "--bf16",
                                             "--ckpt-format", "torch_dist", "--async-save"]
    with tempfile.TemporaryDirectory() as root:
        straight, resumed = Path(root, "straight"), Path(root, "resumed")
        whole = pretrain(ctx, base + ["--save", str(straight), "--save-interval", str(iters)],
                         reserve=40.0 if ctx.gpu else 20.0, deterministic=True)
        pretrain(ctx, base + ["--save", str(resumed), "--save-interval", str(half),
                              "--exit-interval", str(half)], reserve=20.0 if ctx.gpu else 10.0,
                 deterministic=True)
        stopped_at = read_tracker(str(resumed))
        second = pretrain(ctx, base + ["--save", str(resumed), "--load", str(resumed),
                                       "--save-interval", str(iters)], deterministic=True)
        a, b = losses(whole), losses(second)
        same_losses, close_enough = close_losses({i: v for i, v in a.items() if i > half}, b)
        name = f"iter_{iters:07d}"
        mismatched, off, count, worst = [], [], 0, 0.0
        tensors = dict(read_full_tensors(str(straight / name)))
        for fqn, tensor in read_full_tensors(str(resumed / name)):
            count += 1
            if fqn not in tensors or tensors[fqn].shape != tensor.shape:
                off.append(fqn)
            elif not torch.equal(tensors[fqn], tensor):
                mismatched.append(fqn)
                if tensor.is_floating_point():
                    ref = tensors[fqn].double()
                    err = float((tensor.double() - ref).abs().max()
                                / ref.abs().max().clamp_min(1e-30))
                    worst = max(worst, err)
                    if err > RERUN_TOLERANCE:
                        off.append(fqn)
                else:
                    off.append(fqn)
        if count != len(tensors):
            off.append(f"{len(tensors)} tensors saved straight, {count} resumed")
    ok = close_enough and not off and stopped_at == half
    losses_word = ("equal" if same_losses else f"within {RERUN_TOLERANCE:.0e} (not bit-identical)"
                   if close_enough else "DIFFER")
    ckpt_word = ("bitwise equal" if not mismatched and not off else
                 f"within {RERUN_TOLERANCE:.0e} (max rel {worst:.1e}, not bit-identical)"
                 if not off else "DIFFERS")
    return {"status": "PASS" if ok else "FAIL", "stopped_at": stopped_at, "losses": a,
            "resumed_losses": b, "mismatched_tensors": mismatched[:10],
            "out_of_tolerance": off[:10], "max_relative_difference": worst,
            "summary": f"deterministic mode; stopped at {stopped_at}, resumed: losses of "
                       f"iterations {half + 1}-{iters} {losses_word}; iteration-{iters} "
                       f"checkpoint {ckpt_word} ({count} tensors, model and optimizer)"}


# ------------------------------------------------------------------------------ memory
def allocator_check(device: torch.device) -> dict:
    """The memory model's parameter and activation bytes of a 4-layer middle stage against the
    allocator (one forward of one micro-batch; the old check compared a whole-model estimate,
    embedding and head included, with a stage that has neither)."""
    from megatron_chimera.config import ModelConfig
    from megatron_chimera.model.family import GPT2
    from megatron_chimera.model.gpt2 import GPTModel
    from megatron_chimera.model.memory import estimate_stage_memory

    config = ModelConfig(num_layers=6, hidden_size=2048, num_attention_heads=16,
                         seq_length=2048, vocab_size=50257, params_dtype="bf16")
    batch = 2
    # the middle stage of three: 4 layers, neither the embedding nor the head
    stage = estimate_stage_memory(config, GPT2, [(0, 1), (1, 5), (5, 6)], batch,
                                  device_type="cuda")[1]
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = GPTModel(config, pre_process=False, post_process=False, layer_range=(1, 5)).to(device)
    weights = torch.cuda.memory_allocated() - base
    hidden = torch.randn(2048, batch, 2048, device=device, dtype=torch.bfloat16,
                         requires_grad=True)
    model.set_input_tensor(hidden)
    before = torch.cuda.memory_allocated()
    out = model(None, None)
    activations = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    out.float().sum().backward()
    return {"param_ratio": round(weights / stage.param_bytes, 4),
            "activation_ratio": round(activations / stage.activation_bytes, 4),
            "activation_mib": round(activations / 2**20, 1),
            "activation_estimate_mib": round(stage.activation_bytes / 2**20, 1),
            "max_memory_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1)}


def report_ratios(lines: list[str]) -> list[float]:
    """Predicted / measured totals of the training log's memory-report lines."""
    ratios = []
    for line in lines:
        with contextlib.suppress(IndexError, ValueError):
            predicted = float(line.split("|| measured:")[0].split("total ")[1].split()[0])
            measured = float(line.split("|| measured:")[1].split("total ")[1].split()[0])
            ratios.append(predicted / measured)
    return ratios


@step("memory", "memory model vs the allocator")
def check_memory(ctx: Context) -> dict:
    """Allocator check (CUDA) and the training step's memory-report lines."""
    training = gpu_check.read_results(ctx.out).get("training")
    if training is None and not ctx.gpu:
        return skip("the training step did not run; the allocator check is CUDA only")
    training = training or {}
    ratios = report_ratios(training.get("memory_report", []))
    result: dict = {"report_lines": training.get("memory_report", []),
                    "report_ratios": [round(r, 3) for r in ratios]}
    ok = bool(ratios) and all(abs(r - 1) <= 0.10 for r in ratios)
    parts = [f"training log: predicted/measured total {', '.join(f'{r:.3f}' for r in ratios)}"
             if ratios else "no memory-report line from the training step"]
    if ctx.gpu:
        alloc = allocator_check(ctx.device)
        result["allocator"] = alloc
        ok = ok and abs(alloc["activation_ratio"] - 1) < 0.15 and abs(alloc["param_ratio"] - 1) \
            < 0.02
        parts.append(f"4 layers h2048 s2048 b2: activations {alloc['activation_mib']} MiB "
                     f"measured / {alloc['activation_estimate_mib']} estimated "
                     f"({alloc['activation_ratio']}), parameters {alloc['param_ratio']}, peak "
                     f"{alloc['max_memory_allocated_mib']} MiB")
    else:
        parts.append("allocator check skipped (CUDA only)")
    return {"status": "PASS" if ok else "FAIL", **result, "summary": "; ".join(parts)}
