#!/usr/bin/env python
"""Chimera playground: a terminal tour of schedules, bubbles, partitioning, memory and autotuning.

Interactive (Enter accepts the ``[default]``, Ctrl-D quits)::

    python tools/chimera_playground.py

Scripted: ``--non-interactive --section schedule|compare|partition|autotune|all`` with the sizes
as flags, e.g.::

    python tools/chimera_playground.py --non-interactive --section schedule \\
        --pipeline-model-parallel-size 4 --num-microbatches 8 --png chimera.png

Sections: (1) the text chart of one schedule with its simulated makespan, bubble ratio and
per-rank memory (weight copies, peak in-flight activations, bytes for the chosen model); (2) every
schedule compared at the same sizes; (3) the model's layers partitioned into stages with memory
estimates per stage and per rank; (4) the autotuner's best layouts and the command to run the best.
Costs are relative times of one micro-batch through one stage; ``--backward-cost`` is the whole
backward, of which ``--weight-cost`` is the weight-gradient part (0 = no B/W split).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from megatron_chimera.config import ConfigError
from megatron_chimera.errors import ToolArgumentParser, run_tool
from megatron_chimera.model.family import FAMILIES
from megatron_chimera.model.presets import (
    DTYPES,
    MODEL_NAMES,
    SIZE_FLAGS,
    add_model_arguments,
    make_model,
)
from megatron_chimera.schedules import SCHEDULE_NAMES
from megatron_chimera.schedules.chimera import CONCAT_NAMES
from megatron_chimera.schedules.cli import add_size_and_cost_arguments
from megatron_chimera.schedules.registry import (
    SPLIT_BACKWARD_SCHEDULES,
    add_schedule_arguments,
    schedule_name_from,
)
from megatron_chimera.tuning.playground import (
    PARTITION_CHOICES,
    SECTIONS,
    Settings,
    run_section,
)

T = TypeVar("T")


# ------------------------------------------------------------------------------------ prompts
def ask(prompt: str, default: T, parse: Callable[[str], T], read: Callable[[str], str]) -> T:
    """Prompt until ``parse`` accepts the answer; Enter keeps ``default``; EOF propagates."""
    shown = "default" if default is None else default
    while True:
        text = read(f"{prompt} [{shown}]: ").strip()
        if not text:
            return default
        try:
            return parse(text)
        except (ValueError, ConfigError) as exc:
            print(f"  error: {exc}")


def positive_int(text: str) -> int:
    """A positive integer."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError(f"expected a number >= 0, got {text!r}")
    return value


def choice(options: tuple[str, ...], allow_default: bool = False) -> Callable[[str], Any]:
    """Parser accepting one of ``options`` (or 'default' for None)."""
    def parse(text: str) -> str | None:
        if allow_default and text == "default":
            return None
        if text not in options:
            raise ValueError(f"choose one of {', '.join(options)}")
        return text
    return parse


def ask_schedule(s: Settings, read: Callable[[str], str], costs: bool) -> Settings:
    """Schedule name, D, N, its options and (``costs``) the relative costs."""
    name = ask("schedule (" + ", ".join(SCHEDULE_NAMES) + ")", s.schedule,
               choice(SCHEDULE_NAMES), read)
    s = dataclasses.replace(s, schedule=name)
    s = ask_sizes(s, read, pipes=name.startswith("chimera"))
    concat, virtual = None, None
    if name == "chimera" and s.N > s.D:
        concat = ask("concatenation for N > D (" + ", ".join(CONCAT_NAMES) + ")", s.concat,
                     choice(CONCAT_NAMES, allow_default=True), read)
    if name == "interleaved":
        virtual = ask("model chunks per rank v", s.virtual or 2, positive_int, read)
    s = dataclasses.replace(s, concat=concat, virtual=virtual)
    return ask_costs(s, read) if costs else s


def ask_sizes(s: Settings, read: Callable[[str], str], pipes: bool) -> Settings:
    """D, N and (``pipes``) Chimera's pipe count."""
    D = ask("pipeline stages D", s.D, positive_int, read)
    N = ask("micro-batches per iteration N", s.N, positive_int, read)
    p = ask("Chimera pipes 2f", s.pipes or 2, positive_int, read) if pipes else None
    return dataclasses.replace(s, D=D, N=N, pipes=p)


def ask_costs(s: Settings, read: Callable[[str], str]) -> Settings:
    """Forward, whole backward and weight-gradient costs."""
    f = ask("forward cost", s.forward_cost, non_negative_float, read)
    b = ask("backward cost (input + weight gradient)", s.backward_cost, non_negative_float, read)
    w_default = s.weight_cost or (b / 2 if s.schedule in SPLIT_BACKWARD_SCHEDULES else 0.0)
    w = ask("weight-gradient part of the backward (0 = no split; chimera-zb, zb-h1 need > 0)",
            w_default, non_negative_float, read)
    return dataclasses.replace(s, forward_cost=f, backward_cost=b, weight_cost=w)


def ask_model(s: Settings, read: Callable[[str], str]) -> Settings:
    """A model preset, or custom sizes."""
    name = ask("model (" + ", ".join(MODEL_NAMES) + ")", s.model, choice(MODEL_NAMES), read)
    if name != "custom":
        family, config = make_model(name, params_dtype=s.config.params_dtype)
        return dataclasses.replace(s, model=name, family=family, config=config)
    kind = ask("model type (" + ", ".join(FAMILIES) + ")", s.family.name,
               choice(tuple(FAMILIES)), read)
    sizes = {flag: ask(flag.replace("_", " "), getattr(s.config, flag), positive_int, read)
             for flag in SIZE_FLAGS}
    family, config = make_model("custom", kind, s.config.params_dtype, **sizes)
    return dataclasses.replace(s, model=name, family=family, config=config)


def ask_section(name: str, s: Settings, read: Callable[[str], str]) -> Settings:
    """The questions of one section."""
    if name == "schedule":
        return ask_schedule(s, read, costs=True)
    if name == "compare":
        return ask_costs(ask_sizes(s, read, pipes=True), read)
    s = ask_model(s, read)
    if name == "autotune":
        return dataclasses.replace(
            s, num_gpus=ask("number of GPUs", s.num_gpus, positive_int, read),
            global_batch_size=ask("global batch size", s.global_batch_size, positive_int, read),
            hardware=ask("hardware (p100, a100, h100 or a JSON file)", s.hardware, str, read))
    mbs = ask("micro-batch size", s.micro_batch_size, positive_int, read)
    method = ask("partition method (uniform, parameters)", s.partition_method,
                 choice(PARTITION_CHOICES), read)
    s = dataclasses.replace(s, micro_batch_size=mbs, partition_method=method)
    return ask_schedule(s, read, costs=False)


MENU = """
  1  schedule chart (text chart, bubble ratio, memory per rank)
  2  compare schedules
  3  model partition + memory per stage and rank
  4  autotuner suggestion
  q  quit"""


def interactive(settings: Settings, read: Callable[[str], str] = input) -> int:
    """The menu loop; a section whose answers do not fit together asks again."""
    print("Chimera playground: bidirectional pipelines (Li & Hoefler, SC'21). "
          "Enter keeps the [default]; Ctrl-D quits.")
    try:
        while True:
            print(MENU)
            pick = ask("choice", "1", choice(("1", "2", "3", "4", "q")), read)
            if pick == "q":
                return 0
            section = SECTIONS[int(pick) - 1]
            while True:
                settings = ask_section(section, settings, read)
                try:
                    print(run_section(section, settings))
                    break
                except (ValueError, ConfigError) as exc:  # ScheduleError is a ValueError
                    print(f"  error: {exc}\n  (try again)")
    except (EOFError, KeyboardInterrupt):  # Ctrl-D / end of piped input, or Ctrl-C: quit
        print()
        return 0


# ------------------------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    """Flags of the scripted mode; in the interactive mode they set the defaults."""
    p = ToolArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--non-interactive", action="store_true", help="print sections and exit")
    p.add_argument("--section", choices=(*SECTIONS, "all"), default=None,
                   help="section to print with --non-interactive (default: all)")
    g = p.add_argument_group("schedule")
    add_schedule_arguments(g, default_schedule="chimera")
    add_size_and_cost_arguments(g, default_ranks=4, default_microbatches=8)
    g.add_argument("--png", default=None, help="write the schedule's Gantt chart here")
    g = p.add_argument_group("model")
    add_model_arguments(g, default="gpt2-small")
    g.add_argument("--params-dtype", choices=DTYPES, default="fp32")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--partition-method", choices=PARTITION_CHOICES, default="uniform")
    g = p.add_argument_group("autotuner")
    g.add_argument("--num-gpus", type=int, default=8)
    g.add_argument("--global-batch-size", type=int, default=64)
    g.add_argument("--hardware", default="p100", help="p100, a100, h100 or a JSON profile")
    g.add_argument("--top", type=int, default=5, help="rows of the autotuner's table")
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from the parsed flags (ConfigError names a bad flag)."""
    for flag in ("pipeline_model_parallel_size", "num_microbatches", "micro_batch_size",
                 "num_gpus", "global_batch_size", "top"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive")
    family, config = make_model(args.model, args.model_type, args.params_dtype,
                                **{f: getattr(args, f) for f in SIZE_FLAGS})
    return Settings(
        schedule=schedule_name_from(args), D=args.pipeline_model_parallel_size,
        N=args.num_microbatches, pipes=args.chimera_pipes, concat=args.chimera_concat,
        virtual=args.num_virtual_stages_per_pipeline_rank, max_inflight=args.chimera_max_inflight,
        zb_costs=args.chimera_zb_costs, forward_cost=args.forward_cost,
        backward_cost=args.backward_cost, weight_cost=args.weight_cost, model=args.model,
        family=family, config=config, micro_batch_size=args.micro_batch_size,
        partition_method=args.partition_method, num_gpus=args.num_gpus,
        global_batch_size=args.global_batch_size, hardware=args.hardware, top=args.top,
        png=args.png)


def main(argv: list[str] | None = None) -> int:
    """Scripted sections, or the interactive tour."""
    args = build_parser().parse_args(argv)
    try:
        if args.section is not None and not args.non_interactive:
            raise ConfigError("--section needs --non-interactive")
        sections = SECTIONS if args.section in (None, "all") else (args.section,)
        if args.png and "schedule" not in sections:
            raise ConfigError("--png applies to --section schedule (or all)")
        settings = settings_from_args(args)
        if not args.non_interactive:
            return interactive(settings)
        for name in sections:
            print(f"== {name} ==")
            print(run_section(name, settings, strict=True), end="\n\n", flush=True)
    except (ValueError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    run_tool(main)
