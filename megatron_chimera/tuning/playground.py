"""The playground's reports: one schedule's chart and per-rank memory, every schedule compared,
a model's partition with memory per stage and rank, and the autotuner's suggestion.

``tools/chimera_playground.py`` asks for :class:`Settings` (flags or prompts) and prints
:func:`run_section`; the demos in ``examples/`` print the same sections. Everything here works on
the schedule IR and the model's analytic counts (no process groups, no GPU).
"""

from __future__ import annotations

import argparse
import dataclasses

from megatron_chimera.config import ModelConfig
from megatron_chimera.model.family import GPT2, ModelFamily
from megatron_chimera.model.memory import estimate_stage_memory
from megatron_chimera.model.partition import partition_layers
from megatron_chimera.model.presets import MODEL_PRESETS, describe_model
from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.cli import cost_model, schedule_from_args
from megatron_chimera.schedules.compare import compare, format_table
from megatron_chimera.schedules.plot import plot_schedule, text_chart
from megatron_chimera.schedules.simulate import SimResult, simulate
from megatron_chimera.schedules.validate import validate
from megatron_chimera.tuning.analytic_costs import ModelSpec, pieces_of
from megatron_chimera.tuning.rank_memory import rank_memory

SECTIONS = ("schedule", "compare", "partition", "autotune")
PARTITION_CHOICES = ("uniform", "parameters")
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything the sections read; the flags set it and the interactive prompts replace it."""

    schedule: str = "chimera"
    D: int = 4
    N: int = 8
    pipes: int | None = None  # --chimera-pipes (None: the generator's default, 2)
    concat: str | None = None  # --chimera-concat
    virtual: int | None = None  # --num-virtual-stages-per-pipeline-rank
    max_inflight: int | None = None  # --chimera-max-inflight
    zb_costs: tuple[float, float, float] | None = None  # --chimera-zb-costs
    forward_cost: float = 1.0
    backward_cost: float = 2.0
    weight_cost: float = 0.0
    model: str = "gpt2-small"
    family: ModelFamily = GPT2
    config: ModelConfig = MODEL_PRESETS["gpt2-small"][1]
    micro_batch_size: int = 1
    partition_method: str = "uniform"
    num_gpus: int = 8
    global_batch_size: int = 64
    hardware: str = "p100"
    top: int = 5
    png: str | None = None

    def flags(self) -> argparse.Namespace:
        """The flag namespace of tools/plot_schedule.py and tools/compare_schedules.py."""
        return argparse.Namespace(
            pipeline_model_parallel_size=self.D, num_microbatches=self.N,
            chimera_pipes=self.pipes, chimera_concat=self.concat,
            num_virtual_stages_per_pipeline_rank=self.virtual,
            chimera_max_inflight=self.max_inflight, chimera_zb_costs=self.zb_costs,
            forward_cost=self.forward_cost,
            backward_cost=self.backward_cost, weight_cost=self.weight_cost)


# ------------------------------------------------------------------------------------ sections
def build(settings: Settings, strict: bool = False) -> tuple[Schedule, SimResult]:
    """Build, validate and simulate the chosen schedule (``strict``: reject inapplicable flags)."""
    schedule = schedule_from_args(settings.schedule, settings.flags(), strict=strict)
    validate(schedule)
    return schedule, simulate(schedule, cost_model(settings.flags(), schedule))


def rank_table(schedule: Schedule, result: SimResult, settings: Settings) -> str:
    """Per rank: stages held, weight copies, peak in-flight micro-batches and estimated bytes."""
    lines = [f"{'rank':>4}  {'stages held':<14}{'weights':>9}{'in flight':>11}"
             f"{'weights GiB':>13}{'activ. GiB':>12}{'total GiB':>11}"]
    memory = None
    if settings.config.num_layers >= schedule.num_stages:
        partition = partition_layers(settings.config.num_layers, schedule.num_stages,
                                     settings.partition_method, config=settings.config,
                                     family=settings.family)
        memory = rank_memory(ModelSpec(settings.config, settings.family), schedule,
                             pieces_of(partition), settings.micro_batch_size, recompute=False)
    for rank in range(schedule.num_ranks):
        stages = ",".join(map(str, schedule.stages_of_rank(rank)))
        row = (f"{rank:>4}  {stages:<14}{result.weight_copies[rank]:>7} M"
               f"\u03b8{result.peak_inflight[rank]:>9} Ma")
        if memory is not None:
            mem = memory[rank]
            row += (f"{mem.weight_bytes / GIB:>13.2f}{mem.activation_bytes / GIB:>12.2f}"
                    f"{mem.total_bytes / GIB:>11.2f}")
        lines.append(row)
    note = (f"M\u03b8 = one stage's weights, Ma = one stage's activations of one micro-batch; "
            f"bytes: {settings.model}, micro-batch {settings.micro_batch_size}, Adam")
    if memory is None:
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
    config, family = settings.config, settings.family
    schedule, result = build(settings)
    stages = schedule.num_stages
    partition = partition_layers(config.num_layers, stages, settings.partition_method,
                                 config=config, family=family)
    memory = estimate_stage_memory(config, family, partition, settings.micro_batch_size)
    out = [describe_model(settings.model, family, config),
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
        from megatron_chimera.tuning.hardware import GB, load_hardware
        from megatron_chimera.tuning.perf_model import PerformanceModel
    except ImportError as exc:
        return f"autotuner unavailable: {exc}"
    spec = ModelSpec(settings.config, settings.family)
    hardware = load_hardware(settings.hardware)
    limit = int(hardware.memory_gb * GB * 0.9)
    space = SearchSpace(settings.num_gpus, settings.global_batch_size, settings.config.num_layers)
    print(f"autotuner: searching the layouts of {settings.num_gpus} GPUs, global batch "
          f"{settings.global_batch_size} (large searches take minutes) ...", flush=True)
    result = autotune(PerformanceModel(spec, hardware), space, limit)
    best = result.best
    return "\n".join([
        f"{describe_model(settings.model, settings.family, settings.config)}",
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
