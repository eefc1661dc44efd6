"""Layout equivalence: the user's flags on a small proxy, one process against each layout.

The proxy keeps every flag that can break equality between layouts (layer kinds, MoE routing
and capacity, GQA, RoPE, tied embeddings, vocab padding, document and loss masks, recomputation,
the distributed optimizer, the global and micro-batch sizes, hence gradient accumulation, the
precision) and shrinks only width, depth and sequence length. Every run is ``pretrain_gpt2.py``
itself; losses and gradient norms are read back from its TensorBoard events.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_chimera.errors import ConfigError

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
             "--num-workers", "--distributed-timeout-minutes")
PROXY_SIZES = {"--hidden-size": "64", "--ffn-hidden-size": "128", "--moe-ffn-hidden-size": "64",
               "--num-attention-heads": "4", "--kv-channels": "16", "--seq-length": "64",
               "--max-position-embeddings": "64"}
# fp32 layouts agree up to summation order; bf16/fp16 keep ~3 significant digits.
RTOL = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-2}
SCHEDULES = ("gpipe", "1f1b", "interleaved", "chimera", "chimera-zb", "zb-h1", "zbv", "v-half",
             "bitpipe", "bitpipe-zb", "dualpipe", "dualpipev", "combined-1f1b")


@dataclass(frozen=True)
class Layout:
    """One target layout: ``T2,CP2,EP2,D4,DP2,chimera:W2`` (any order; omitted sizes are 1)."""

    text: str
    tp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1
    dp: int = 1
    schedule: str | None = None
    pipes: int | None = None

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
        for key, field in (("cp", "cp"), ("ep", "ep"), ("dp", "dp"), ("t", "tp"), ("d", "pp")):
            if name.startswith(key) and name[len(key):].isdigit() and int(name[len(key):]) > 0:
                sizes[field] = int(name[len(key):])
                break
        else:
            raise ConfigError(f"layout {text!r}: unknown part {part!r} (expected T<n>, CP<n>, "
                              f"EP<n>, D<n> (pipeline), DP<n>, or a schedule: "
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


def proxy_flags(user: list[str], layouts: list[Layout], steps: int) -> list[str]:
    """The user's flags with the layout and run flags dropped, width, depth and sequence shrunk
    (kept when absent), dropout off and mock data unless a data path is given."""
    argv = _drop(user, LAYOUT_FLAGS + RUN_FLAGS + tuple(PROXY_SIZES) + ("--num-layers",
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
    return [*argv, "--train-iters", str(steps), "--log-interval", "1", "--eval-iters", "0",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
            "--distributed-timeout-minutes", "2"]


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
    """Per-step loss and gradient norm of one run."""

    loss: dict[int, float]
    grad_norm: dict[int, float]


def run(script: Path, flags: list[str], world_size: int, out: Path,
        timeout: float = 600) -> Curves:
    """One ``script`` run (torchrun with several ranks) writing TensorBoard to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    args = [str(script), *flags, "--tensorboard-dir", str(out)]
    if world_size == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={world_size}", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if "rror" in ln]
        raise RuntimeError(lines[-1] if lines else f"exit {proc.returncode}")
    return Curves(_scalars(out, "lm loss"), _scalars(out, "grad-norm"))


def _scalars(directory: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    if tag not in events.Tags()["scalars"]:
        return {}
    return {e.step: e.value for e in events.Scalars(tag)}


def compare(reference: Curves, other: Curves, rtol: float) -> tuple[float, float, str]:
    """(max relative |Δloss|, max relative |Δgrad norm|, first divergence or "")."""
    worst_loss = worst_norm = 0.0
    first = ""
    if sorted(other.loss) != sorted(reference.loss):
        return float("inf"), float("inf"), f"steps differ: {sorted(other.loss)}"
    for step in sorted(reference.loss):
        want, got = reference.loss[step], other.loss[step]
        d_loss = abs(got - want) / max(abs(want), 1e-12)
        want_n, got_n = reference.grad_norm.get(step), other.grad_norm.get(step)
        d_norm = 0.0 if want_n is None or got_n is None else abs(got_n - want_n) / max(
            abs(want_n), 1e-12)
        worst_loss, worst_norm = max(worst_loss, d_loss), max(worst_norm, d_norm)
        parts = ([f"lm loss {got:.7g} vs {want:.7g}"] if d_loss > rtol else []) + (
            [f"grad norm {got_n:.6g} vs {want_n:.6g}"] if d_norm > rtol else [])
        if not first and parts:
            first = f"step {step}: {'; '.join(parts)}"
    return worst_loss, worst_norm, first
