"""Layout equivalence: the user's flags on a small proxy, one process against each layout.

The proxy keeps every flag that can break equality between layouts (layer kinds, MoE routing
and capacity, GQA, RoPE, tied embeddings, vocab padding, document and loss masks, recomputation,
the distributed optimizer, the global and micro-batch sizes, hence gradient accumulation, the
precision) and shrinks only width, depth and sequence length. Every run is ``pretrain_gpt2.py``
itself; losses and gradient norms are read back from its TensorBoard events, and every
parameter's value and gradient from the ``torch_dist`` checkpoint it saves after each step (full
tensors under layout-independent names, whatever the layout): the gradient as Adam's first
moment, which first differs at the step where the gradient first differs.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_chimera.errors import ConfigError
from megatron_chimera.training import forked_run
from megatron_chimera.training.equivalence_params import ParamDelta, param_deltas

# Flags the checker sets itself (the layout's or the proxy's); the user's values are dropped.
LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                "--context-parallel-size", "--expert-model-parallel-size", "--chimera-pipes",
                "--pipeline-schedule", "--pipeline-model-parallel-layout",
                "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
                "--expert-tensor-parallel-size", "--hierarchical-context-parallel-sizes",
                "--sequence-parallel")
RUN_FLAGS = ("--save", "--load", "--tensorboard-dir", "--train-iters", "--train-samples",
             "--log-interval", "--eval-iters", "--eval-interval", "--save-interval",
             "--exit-interval", "--exit-duration-in-mins", "--wandb-project", "--wandb-exp-name",
             "--wandb-save-dir", "--hidden-dropout", "--attention-dropout", "--pipeline-trace",
             "--num-workers", "--distributed-timeout-minutes", "--ckpt-format", "--no-save-optim",
             "--async-save", "--clip-grad")
# clipping never triggers (a scale bug would hide under it); its input, the norm, is compared
NO_CLIP = "1e30"
PROXY_SIZES = {"--hidden-size": "64", "--ffn-hidden-size": "128", "--moe-ffn-hidden-size": "64",
               "--num-attention-heads": "4", "--kv-channels": "16", "--seq-length": "64",
               "--max-position-embeddings": "64"}
# fp32 layouts agree up to summation order; bf16/fp16 keep ~3 significant digits.
RTOL = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-2}
# Per-parameter bounds (floors under rtol): Adam turns the rounding noise of a gradient that is
# zero in exact arithmetic (the key bias: softmax ignores it) into updates of full size, so
# values differ by ~1e-4 after one fp32 step, and the next steps' gradients, taken at those
# values, by ~1e-5 per tensor (small expert biases); the loss and the norm stay within 1e-7.
GRAD_RTOL = 1e-3
VALUE_RTOL = 1e-2
SCHEDULES = ("gpipe", "1f1b", "interleaved", "chimera", "chimera-zb", "zb-h1", "zbv", "v-half",
             "bitpipe", "bitpipe-zb", "dualpipe", "dualpipev", "combined-1f1b")


@dataclass(frozen=True)
class Layout:
    """One target layout: ``T2,CP2,EP2,D4,DP2,MB4,chimera:W2`` (any order; omitted sizes are 1,
    ``MB<n>`` sets the micro-batch size, hence the gradient accumulation steps)."""

    text: str
    tp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1
    dp: int = 1
    schedule: str | None = None
    pipes: int | None = None
    mb: int | None = None

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def flags(self) -> list[str]:
        out = ["--tensor-model-parallel-size", str(self.tp), "--context-parallel-size",
               str(self.cp), "--pipeline-model-parallel-size", str(self.pp)]
        if self.tp > 1:  # MoE with T > 1 needs it; for dense layers it changes no number
            out.append("--sequence-parallel")
        if self.ep > 1:
            out += ["--expert-model-parallel-size", str(self.ep)]
        if self.schedule is not None:
            out += ["--pipeline-schedule", self.schedule]
        if self.pipes is not None:
            out += ["--chimera-pipes", str(self.pipes)]
        if self.mb is not None:
            out += ["--micro-batch-size", str(self.mb)]
        return out


def parse_layout(text: str) -> Layout:
    """``"T2,CP2,D4,chimera:W2"`` -> :class:`Layout`; ConfigError naming the bad part."""
    sizes: dict[str, int] = {}
    schedule, pipes = None, None
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, option = part.lower().partition(":")
        if name in SCHEDULES:
            schedule = name
            if option:
                if not (option.startswith("w") and option[1:].isdigit()):
                    raise ConfigError(f"layout {text!r}: {part!r}: the only schedule option is "
                                      "W<pipes> (e.g. chimera:W2)")
                pipes = int(option[1:])
            continue
        for key, field in (("cp", "cp"), ("ep", "ep"), ("dp", "dp"), ("mb", "mb"), ("t", "tp"),
                           ("d", "pp")):
            if name.startswith(key) and name[len(key):].isdigit() and int(name[len(key):]) > 0:
                sizes[field] = int(name[len(key):])
                break
        else:
            raise ConfigError(f"layout {text!r}: unknown part {part!r} (expected T<n>, CP<n>, "
                              f"EP<n>, D<n> (pipeline), DP<n>, MB<n> (micro-batch size), or a "
                              f"schedule: "
                              f"{', '.join(SCHEDULES)}[:W<pipes>])")
    return Layout(text, schedule=schedule, pipes=pipes, **sizes)


def _drop(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` without ``names`` and their values (the tokens up to the next ``--flag``)."""
    out, skipping = [], False
    for token in argv:
        if token.startswith("--"):
            skipping = token.split("=", 1)[0] in names
        if not skipping:
            out.append(token)
    return out


def _value(argv: list[str], name: str) -> str | None:
    for i, token in enumerate(argv):
        if token == name and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith(name + "="):
            return token.split("=", 1)[1]
    return None


def proxy_flags(user: list[str], layouts: list[Layout], steps: int,
                keep_dropout: bool = False) -> list[str]:
    """The user's flags with the layout and run flags dropped, width, depth and sequence shrunk
    (kept when absent), dropout off (unless ``keep_dropout``) and mock data unless a data path
    is given."""
    kept = ("--hidden-dropout", "--attention-dropout") if keep_dropout else ()
    run_flags = tuple(f for f in RUN_FLAGS if f not in kept)
    argv = _drop(user, LAYOUT_FLAGS + run_flags + tuple(PROXY_SIZES) + ("--num-layers",
                                                                          "--num-query-groups"))
    for name, value in PROXY_SIZES.items():
        if name in ("--ffn-hidden-size", "--moe-ffn-hidden-size", "--kv-channels") and \
                _value(user, name) is None:
            continue
        argv += [name, value]
    groups = _value(user, "--num-query-groups")
    if groups is not None and int(groups) < int(_value(user, "--num-attention-heads") or 0):
        argv += ["--num-query-groups", "2"]  # GQA kept: 2 groups of 2 heads
    depth = max(2 * max(lay.pp * (lay.pipes or 1) for lay in layouts), 2)
    argv += ["--num-layers", str(depth)]
    if _value(user, "--data-path") is None and "--mock-data" not in argv:
        argv.append("--mock-data")
    dropout = [] if keep_dropout else ["--hidden-dropout", "0", "--attention-dropout", "0"]
    return [*argv, "--train-iters", str(steps), "--log-interval", "1", "--eval-iters", "0",
            *dropout, "--num-workers", "0",
            "--distributed-timeout-minutes", "2", "--ckpt-format", "torch_dist",
            "--clip-grad", NO_CLIP]


def precision(flags: list[str]) -> str:
    """fp32, bf16 or fp16, as the flags say."""
    return "bf16" if "--bf16" in flags else "fp16" if "--fp16" in flags else "fp32"


def check_fits(flags: list[str], layout: Layout) -> None:
    """The framework's own flag parser and config checks for this layout (ConfigError)."""
    from megatron_chimera.training.arguments import parse_args

    try:
        parse_args([*flags, *layout.flags()], world_size=layout.world_size)
    except SystemExit as exc:  # argparse: an unknown flag or a bad value
        raise ConfigError(f"layout {layout.text!r}: the flags do not parse (argparse exit "
                          f"{exc.code}; see the line above)") from None
    except ConfigError as exc:
        raise ConfigError(f"layout {layout.text!r}: {exc}") from None


@dataclass
class Curves:
    """Per-step loss and gradient norm of one run, and where its per-step checkpoints are."""

    loss: dict[int, float]
    grad_norm: dict[int, float]
    checkpoints: Path | None = None


def failure_line(output: str, returncode: int) -> str:
    """The first line of a failed run's output that names an error -- a rank's, not torchrun's
    summary (its pointer to the elastic error docs, its ``error_file`` fields)."""
    for line in output.splitlines():
        text = line.strip()
        if "rror" in text and "elastic/errors" not in text and not text.startswith("error_file"):
            return text
    return f"exit {returncode}"


def run(script: Path, flags: list[str], world_size: int, out: Path,
        timeout: float = 600, checkpoints: bool = True) -> Curves:
    """One ``script`` run (torchrun with several ranks; where no GPU can be used, ranks forked
    from this process: :mod:`~megatron_chimera.training.forked_run`) writing TensorBoard to
    ``out`` and (``checkpoints``) a checkpoint after every step to ``out/ckpt``."""
    out.mkdir(parents=True, exist_ok=True)
    args = [str(script), *flags, "--tensorboard-dir", str(out)]
    if checkpoints:
        args += ["--save", str(out / "ckpt"), "--save-interval", "1"]
    if world_size == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={world_size}", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if forked_run.forkable():  # no GPU: the same ranks forked from here, no interpreter starts
        code, output = forked_run.run_ranks(script, args[1:], world_size, env, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(cmd, timeout)
    else:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        code, output = proc.returncode, proc.stderr + proc.stdout
    if code != 0:
        raise RuntimeError(failure_line(output, code))
    return Curves(_scalars(out, "lm loss"), _scalars(out, "grad-norm"),
                  out / "ckpt" if checkpoints else None)


def _scalars(directory: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    if tag not in events.Tags()["scalars"]:
        return {}
    return {e.step: e.value for e in events.Scalars(tag)}


def _param_parts(deltas: list[ParamDelta], rtol: float, diverged: bool) -> list[str]:
    """The parameter to name: the one furthest beyond its bound (gradients max(rtol,
    GRAD_RTOL), values max(rtol, VALUE_RTOL)); when the loss or the norm diverged (``diverged``)
    but no parameter is beyond its bound, the one closest to it."""
    if not deltas:
        return []
    bound = {"grad": max(rtol, GRAD_RTOL), "value": max(rtol, VALUE_RTOL)}
    ranked = sorted(deltas, key=lambda d: -d.rel / bound[d.kind])
    beyond = [d for d in ranked if d.rel > bound[d.kind]]
    if beyond:
        more = f" (+{len(beyond) - 1} more)" if len(beyond) > 1 else ""
        return [f"first parameter: {beyond[0]}{more}"]
    return [f"largest parameter difference: {ranked[0]}"] if diverged else []


@dataclass
class Comparison:
    """A layout against one process: the largest relative |Δloss|, |Δgrad norm| and
    per-parameter difference over the steps, and the first divergence ("" when none)."""

    loss: float
    grad_norm: float
    param: float
    first: str


def compare(reference: Curves, other: Curves, rtol: float) -> Comparison:
    """Step by step: the loss, the global gradient norm and (when both runs saved per-step
    checkpoints) every parameter's gradient and value, each against ``rtol``."""
    worst_loss = worst_norm = worst_param = 0.0
    first = ""
    if sorted(other.loss) != sorted(reference.loss):
        return Comparison(float("inf"), float("inf"), float("inf"),
                          f"steps differ: {sorted(other.loss)}")
    for step in sorted(reference.loss):
        want, got = reference.loss[step], other.loss[step]
        d_loss = abs(got - want) / max(abs(want), 1e-12)
        want_n, got_n = reference.grad_norm.get(step), other.grad_norm.get(step)
        d_norm = 0.0 if want_n is None or got_n is None else abs(got_n - want_n) / max(
            abs(want_n), 1e-12)
        worst_loss, worst_norm = max(worst_loss, d_loss), max(worst_norm, d_norm)
        parts = ([f"lm loss {got:.7g} vs {want:.7g}"] if d_loss > rtol else []) + (
            [f"grad norm {got_n:.6g} vs {want_n:.6g}"] if d_norm > rtol else [])
        if reference.checkpoints is not None and other.checkpoints is not None and \
                math.isfinite(rtol):
            try:
                deltas = param_deltas(reference.checkpoints, other.checkpoints, step)
            except FileNotFoundError as exc:
                deltas, parts = [], [*parts, str(exc)]
            worst_param = max([worst_param, *(d.rel for d in deltas)])
            parts += _param_parts(deltas, rtol, bool(parts))
        if not first and parts:
            first = f"step {step}: {'; '.join(parts)}"
    return Comparison(worst_loss, worst_norm, worst_param, first)
