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
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_schedules import compare, format_table  # noqa: E402
from plot_schedule import cost_model, make_schedule  # noqa: E402

from megatron_chimera.config import ConfigError, ModelConfig  # noqa: E402
from megatron_chimera.model.memory import estimate_stage_memory, rank_memory  # noqa: E402
from megatron_chimera.model.partition import (  # noqa: E402
    PAPER_CONFIGS,
    count_parameters,
    partition_layers,
)
from megatron_chimera.schedules import SCHEDULE_NAMES, Schedule  # noqa: E402
from megatron_chimera.schedules.chimera import CONCAT_NAMES  # noqa: E402
from megatron_chimera.schedules.plot import plot_schedule, text_chart  # noqa: E402
from megatron_chimera.schedules.simulate import SimResult, simulate  # noqa: E402
from megatron_chimera.schedules.validate import validate  # noqa: E402

SECTIONS = ("schedule", "compare", "partition", "autotune")
SPLIT_SCHEDULES = ("chimera-zb", "zb-h1")
PARTITION_CHOICES = ("uniform", "parameters")
DTYPES = ("fp32", "fp16", "bf16")
GIB = 2**30
# name -> (model type as partition.py names it, configuration); "custom" takes sizes from flags
MODEL_PRESETS: dict[str, tuple[str, ModelConfig]] = {
    "gpt2-small": ("gpt", ModelConfig(num_layers=12, hidden_size=768, num_attention_heads=12,
                                      seq_length=1024, vocab_size=50257)),
    "gpt2-medium": ("gpt", ModelConfig(num_layers=24, hidden_size=1024, num_attention_heads=16,
                                       seq_length=1024, vocab_size=50257)),
    "bert-48": ("bert", PAPER_CONFIGS["bert-48"]),
    "gpt2-64": ("gpt", PAPER_CONFIGS["gpt2-64"]),
}
MODEL_NAMES = (*MODEL_PRESETS, "custom")
SIZE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")
T = TypeVar("T")


def add_model_arguments(parser: argparse._ActionsContainer, default: str) -> None:
    """--model (a preset or ``custom``), --model-type and the sizes of a custom model."""
    parser.add_argument("--model", choices=MODEL_NAMES, default=default)
    parser.add_argument("--model-type", choices=("gpt", "bert"), default=None,
                        help="with --model custom (default gpt)")
    for flag in SIZE_FLAGS:
        parser.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None,
                            help="with --model custom")


def make_model(name: str, model_type: str | None = None, params_dtype: str = "fp32",
               **sizes: int | None) -> tuple[str, ModelConfig]:
    """``(model type 'gpt'|'bert', ModelConfig)`` of a preset, or of ``custom`` sizes."""
    if name not in MODEL_NAMES:
        raise ConfigError(f"--model: unknown model {name!r}; choose from {MODEL_NAMES}")
    given = {k: v for k, v in sizes.items() if v is not None}
    if name != "custom":
        if given or model_type is not None:
            raise ConfigError(f"--{next(iter(given), 'model_type').replace('_', '-')} applies "
                              f"only to --model custom (the preset {name} fixes the sizes)")
        kind, config = MODEL_PRESETS[name]
        return kind, dataclasses.replace(config, params_dtype=params_dtype)
    for flag in SIZE_FLAGS[:4]:
        if flag not in given:
            raise ConfigError(f"--model custom needs --{flag.replace('_', '-')}")
    for flag, value in given.items():
        if value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    if given["hidden_size"] % given["num_attention_heads"]:
        raise ConfigError(f"--hidden-size {given['hidden_size']} is not divisible by "
                          f"--num-attention-heads {given['num_attention_heads']}")
    kind = model_type or "gpt"
    if kind not in ("gpt", "bert"):
        raise ConfigError(f"--model-type must be 'gpt' or 'bert', got {kind!r}")
    extra = {"num_tokentypes": 2} if kind == "bert" else {}
    return kind, ModelConfig(params_dtype=params_dtype, **given, **extra)


def describe_model(name: str, kind: str, config: ModelConfig) -> str:
    """One line: name, type, sizes, precision and parameter count."""
    params = count_parameters(config, kind)
    return (f"{name} ({'GPT-2' if kind == 'gpt' else 'BERT'}: {config.num_layers} layers, hidden "
            f"{config.hidden_size}, {config.num_attention_heads} heads, seq {config.seq_length}, "
            f"vocab {config.padded_vocab_size}, {config.params_dtype}), {params / 1e6:.1f} M "
            f"parameters")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything the sections read; the flags set it and the interactive prompts replace it."""

    schedule: str = "chimera"
    D: int = 4
    N: int = 8
    pipes: int | None = None  # --chimera-pipes (None: the generator's default, 2)
    concat: str | None = None  # --chimera-concat
    virtual: int | None = None  # --virtual-pipeline-size
    forward_cost: float = 1.0
    backward_cost: float = 2.0
    weight_cost: float = 0.0
    model: str = "gpt2-small"
    model_type: str = "gpt"
    config: ModelConfig = MODEL_PRESETS["gpt2-small"][1]
    micro_batch_size: int = 1
    partition_method: str = "uniform"
    num_gpus: int = 8
    global_batch_size: int = 64
    hardware: str = "p100"
    top: int = 5
    png: str | None = None

    def flags(self) -> argparse.Namespace:
        """The flag namespace tools/plot_schedule.py and tools/compare_schedules.py take."""
        return argparse.Namespace(
            pipeline_model_parallel_size=self.D, num_microbatches=self.N,
            chimera_pipes=self.pipes, chimera_concat=self.concat,
            virtual_pipeline_size=self.virtual, forward_cost=self.forward_cost,
            backward_cost=self.backward_cost, weight_cost=self.weight_cost, schedules=None)


# ------------------------------------------------------------------------------------ sections
def build(settings: Settings, strict: bool = False) -> tuple[Schedule, SimResult]:
    """Build, validate and simulate the chosen schedule (``strict``: reject inapplicable flags)."""
    schedule = make_schedule(settings.schedule, settings.flags(), strict=strict)
    validate(schedule)
    return schedule, simulate(schedule, cost_model(settings.flags(), schedule))


def rank_table(schedule: Schedule, result: SimResult, settings: Settings) -> str:
    """Per rank: stages held, weight copies, peak in-flight micro-batches and estimated bytes."""
    lines = [f"{'rank':>4}  {'stages held':<14}{'weights':>9}{'in flight':>11}"
             f"{'weights GiB':>13}{'activ. GiB':>12}{'total GiB':>11}"]
    stage_memory = None
    if settings.config.num_layers >= schedule.num_stages:
        partition = partition_layers(settings.config.num_layers, schedule.num_stages,
                                     settings.partition_method, config=settings.config,
                                     model_type=settings.model_type)
        stage_memory = estimate_stage_memory(settings.config, settings.model_type, partition,
                                             settings.micro_batch_size)
    for rank in range(schedule.num_ranks):
        stages = ",".join(map(str, schedule.stages_of_rank(rank)))
        row = (f"{rank:>4}  {stages:<14}{result.weight_copies[rank]:>7} M"
               f"\u03b8{result.peak_inflight[rank]:>9} Ma")
        if stage_memory is not None:
            mem = rank_memory(schedule, rank, stage_memory, result.peak_inflight[rank])
            row += (f"{mem.weight_bytes / GIB:>13.2f}{mem.activation_bytes / GIB:>12.2f}"
                    f"{mem.total_bytes / GIB:>11.2f}")
        lines.append(row)
    note = (f"M\u03b8 = one stage's weights, Ma = one stage's activations of one micro-batch; "
            f"bytes: {settings.model}, micro-batch {settings.micro_batch_size}, Adam")
    if stage_memory is None:
        note += f" (not shown: fewer layers than the {schedule.num_stages} stages)"
    return "\n".join([*lines, note])


def section_schedule(settings: Settings, strict: bool = False) -> str:
    """Text chart, makespan, bubble ratio and per-rank memory of one schedule (PNG if asked)."""
    schedule, result = build(settings, strict)
    out = [text_chart(schedule, result), "",
           f"simulated makespan {result.makespan:g}, bubble ratio {result.bubble_ratio:.4f} "
           f"(forward {settings.forward_cost:g}, backward {settings.backward_cost:g}, "
           f"weight {settings.weight_cost:g} per micro-batch and stage)", "",
           rank_table(schedule, result, settings)]
    if settings.png:
        plot_schedule(schedule, result, settings.png)
        out.append(f"wrote {settings.png}")
    return "\n".join(out)


def section_compare(settings: Settings) -> str:
    """Every schedule (and Chimera concatenation) at the same sizes and costs."""
    rows = compare(settings.flags())
    ok = [r for r in rows if "error" not in r]
    head = (f"D={settings.D} N={settings.N} forward={settings.forward_cost:g} "
            f"backward={settings.backward_cost:g} weight={settings.weight_cost:g}")
    out = [head, format_table(rows)]
    if ok:
        best = min(ok, key=lambda r: r["makespan"])
        out.append(f"shortest: {best['schedule']} {best['variant']} (makespan "
                   f"{best['makespan']:g}, bubble ratio {best['bubble_ratio']:.4f})")
    return "\n".join(out)


def section_partition(settings: Settings) -> str:
    """Layers per stage with parameter and memory estimates, then memory per rank."""
    config, kind = settings.config, settings.model_type
    schedule, result = build(settings)
    stages = schedule.num_stages
    partition = partition_layers(config.num_layers, stages, settings.partition_method,
                                 config=config, model_type=kind)
    memory = estimate_stage_memory(config, kind, partition, settings.micro_batch_size)
    out = [describe_model(settings.model, kind, config),
           f"partition '{settings.partition_method}' into {stages} stages, micro-batch size "
           f"{settings.micro_batch_size}, Adam",
           f"{'stage':>5}  {'layers':<10}{'parameters':>14}{'weights+grads+optim GiB':>25}"
           f"{'activations/micro-batch MiB':>29}"]
    for (start, end), m in zip(partition, memory):
        out.append(f"{m.stage:>5}  {f'{start}-{end - 1}':<10}{m.parameters:>14,}"
                   f"{m.weight_bytes / GIB:>25.3f}{m.activation_bytes / 2**20:>29.1f}")
    out += ["", f"per rank under {schedule.describe()}:", rank_table(schedule, result, settings)]
    return "\n".join(out)


def section_autotune(settings: Settings) -> str:
    """The autotuner's ranked layouts for the model on ``num_gpus`` devices and its command."""
    try:
        from megatron_chimera.tuning.autotune import SearchSpace, autotune
        from megatron_chimera.tuning.autotune import format_table as tune_table
        from megatron_chimera.tuning.command import torchrun_command
        from megatron_chimera.tuning.costs import ModelSpec
        from megatron_chimera.tuning.hardware import GB, load_hardware
        from megatron_chimera.tuning.perf_model import PerformanceModel
    except ImportError as exc:
        return f"autotuner unavailable: {exc}"
    spec = ModelSpec(settings.config, "gpt2" if settings.model_type == "gpt" else "bert")
    hardware = load_hardware(settings.hardware)
    limit = int(hardware.memory_gb * GB * 0.9)
    space = SearchSpace(settings.num_gpus, settings.global_batch_size, settings.config.num_layers)
    print(f"autotuner: searching the layouts of {settings.num_gpus} GPUs, global batch "
          f"{settings.global_batch_size} (large searches take minutes) ...", flush=True)
    result = autotune(PerformanceModel(spec, hardware), space, limit)
    best = result.best
    return "\n".join([
        f"{describe_model(settings.model, settings.model_type, settings.config)}",
        f"{settings.num_gpus} x {hardware.name} ({hardware.memory_gb:g} GB, 90% usable), global "
        f"batch {settings.global_batch_size}: {len(result.ranked)} layouts fit, "
        f"{len(result.over_memory)} over memory",
        tune_table(result.ranked[: settings.top], limit), "",
        f"autotuner's suggestion: {best.layout.describe()}: {best.iteration_s:.4f} s/iteration, "
        f"{best.samples_per_s:.1f} samples/s", "",
        torchrun_command(spec, best.layout, hardware.gpus_per_node)])


def run_section(name: str, settings: Settings, strict: bool = False) -> str:
    """The output of section ``name``."""
    if name == "schedule":
        return section_schedule(settings, strict)
    return {"compare": section_compare, "partition": section_partition,
            "autotune": section_autotune}[name](settings)


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
    w_default = s.weight_cost or (b / 2 if s.schedule in SPLIT_SCHEDULES else 0.0)
    w = ask("weight-gradient part of the backward (0 = no split; chimera-zb, zb-h1 need > 0)",
            w_default, non_negative_float, read)
    return dataclasses.replace(s, forward_cost=f, backward_cost=b, weight_cost=w)


def ask_model(s: Settings, read: Callable[[str], str]) -> Settings:
    """A model preset, or custom sizes."""
    name = ask("model (" + ", ".join(MODEL_NAMES) + ")", s.model, choice(MODEL_NAMES), read)
    if name != "custom":
        kind, config = make_model(name, params_dtype=s.config.params_dtype)
        return dataclasses.replace(s, model=name, model_type=kind, config=config)
    kind = ask("model type (gpt, bert)", s.model_type, choice(("gpt", "bert")), read)
    sizes = {flag: ask(flag.replace("_", " "), getattr(s.config, flag), positive_int, read)
             for flag in SIZE_FLAGS}
    kind, config = make_model("custom", kind, s.config.params_dtype, **sizes)
    return dataclasses.replace(s, model=name, model_type=kind, config=config)


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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--non-interactive", action="store_true", help="print sections and exit")
    p.add_argument("--section", choices=(*SECTIONS, "all"), default=None,
                   help="section to print with --non-interactive (default: all)")
    g = p.add_argument_group("schedule")
    g.add_argument("--pipeline-schedule", choices=SCHEDULE_NAMES, default="chimera")
    g.add_argument("--pipeline-model-parallel-size", "-D", type=int, default=4)
    g.add_argument("--num-microbatches", "-N", type=int, default=8)
    g.add_argument("--chimera-pipes", type=int, default=None, help="2f pipes (default 2)")
    g.add_argument("--chimera-concat", choices=CONCAT_NAMES, default=None)
    g.add_argument("--virtual-pipeline-size", type=int, default=None)
    g.add_argument("--forward-cost", type=float, default=1.0)
    g.add_argument("--backward-cost", type=float, default=2.0, help="whole backward")
    g.add_argument("--weight-cost", type=float, default=0.0,
                   help="weight-gradient part of the backward (0 = no split)")
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
    kind, config = make_model(args.model, args.model_type, args.params_dtype,
                              **{f: getattr(args, f) for f in SIZE_FLAGS})
    return Settings(
        schedule=args.pipeline_schedule, D=args.pipeline_model_parallel_size,
        N=args.num_microbatches, pipes=args.chimera_pipes, concat=args.chimera_concat,
        virtual=args.virtual_pipeline_size, forward_cost=args.forward_cost,
        backward_cost=args.backward_cost, weight_cost=args.weight_cost, model=args.model,
        model_type=kind, config=config, micro_batch_size=args.micro_batch_size,
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
    sys.exit(main())
