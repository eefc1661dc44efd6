"""One registry of pipeline schedules: name, generator, typed options, flags and search variants.

Every schedule is one :class:`ScheduleSpec`. Its options are a frozen dataclass whose fields
declare their command-line flag (``option(...)``), so the same table drives

* ``--pipeline-schedule`` and the option flags of ``pretrain_*.py`` and of the tools
  (:func:`add_schedule_arguments`),
* reading options from parsed flags or from a configuration (:meth:`ScheduleSpec.options_from`),
* writing them back as flags, e.g. for the autotuner's ``torchrun`` command
  (:meth:`ScheduleSpec.to_flags`),
* the variants the autotuner enumerates (:meth:`ScheduleSpec.variants`),
* building the schedule (:meth:`ScheduleSpec.build`).

Adding a schedule or an option touches this module (and the generator) only. Errors are
``ValueError`` naming the flag; the driver turns them into its ``ConfigError``.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import Field, dataclass, field, fields, replace
from typing import Any

from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.chimera import CONCAT_CHOICES, CONCAT_NAMES, chimera
from megatron_chimera.schedules.costs import StageCosts, costs_text, parse_costs
from megatron_chimera.schedules.dualpipe import combined_1f1b, dualpipe, dualpipev
from megatron_chimera.schedules.gpipe import gpipe
from megatron_chimera.schedules.interleaved import interleaved
from megatron_chimera.schedules.one_f_one_b import one_f_one_b
from megatron_chimera.schedules.pairing import FLAG as OVERLAP_FLAG
from megatron_chimera.schedules.pairing import with_overlap
from megatron_chimera.schedules.vshape import bitpipe, bitpipe_zb, v_half, zbv
from megatron_chimera.schedules.zb_2p import zb_2p
from megatron_chimera.schedules.zero_bubble import CAP_FLAG, chimera_zb, zb_h1


def option(default: Any, flag: str, help: str, *, parse: Callable[[str], Any] | None = None,
           choices: Sequence[Any] | None = None, search: Sequence[Any] = (),
           generator: bool = True, switch: bool = False) -> Any:
    """A schedule option: a dataclass field that knows its flag, parser, choices and the values
    the autotuner tries (``search``; empty: only the default). ``generator=False``: a policy of
    the driver (not passed to the generator, not part of a variant's label). ``switch``: a flag
    without a value (Megatron's ``store_true`` flags): given, the field is True."""
    return field(default=default, metadata={"flag": flag, "help": help, "parse": parse,
                                            "choices": choices, "search": tuple(search),
                                            "generator": generator, "switch": switch})


def _overlap_option() -> Any:
    return option(
        None, OVERLAP_FLAG, "MoE expert parallelism: pair the forward of one micro-batch with "
        "the backward (or, in Chimera's warm-up and cool-down, the forward or backward) of an "
        "independent one on the same rank, so that each half's all-to-all hides behind the "
        "other's compute (Chimera-EP; 1F1B and interleaved pair as Megatron's combined 1F1B). "
        "The pairs are chosen for the --chimera-zb-costs given (with a2a=) or for F:B:W 1:1:1 "
        "with all-to-all = forward", generator=False, switch=True)


def flag_dest(flag: str) -> str:
    """argparse's attribute name of ``flag`` (``--chimera-pipes`` -> ``chimera_pipes``)."""
    return flag[2:].replace("-", "_")


@dataclass(frozen=True)
class NoOptions:
    """Options of a schedule that has none (GPipe, 1F1B)."""


@dataclass(frozen=True)
class OverlapOptions:
    """1F1B, ZB-H1, BitPipe: only the MoE all-to-all overlap."""

    overlap_moe_expert_parallel_comm: bool | None = _overlap_option()


@dataclass(frozen=True)
class ChimeraOptions:
    """Chimera: how many pipes, and how N > D micro-batches are concatenated."""

    pipes: int = option(2, "--chimera-pipes", "Chimera: 2f pipes, f dividing D/2 (default 2)",
                        parse=int, search=(2, 4))
    concat: str | None = option(
        None, "--chimera-concat", "Chimera: how N > D is built from basic units "
        "(default slot-merge; backward-halving is refused: it is forward-doubling at half the "
        "--micro-batch-size)", choices=CONCAT_CHOICES, search=CONCAT_NAMES)
    overlap_moe_expert_parallel_comm: bool | None = _overlap_option()


FALLBACKS = ("unsplit", "refuse")
Costs = tuple[float, float, float] | StageCosts | None


def _costs_option() -> Any:
    return option(
        None, "--chimera-zb-costs", "split backward (chimera-zb, zb-h1, zbv, v-half, "
        "bitpipe-zb): the F,B,W times the "
        "order is built for: F,B,W (every stage), F,B,W;F,B,W;... (per stage) or @file.json "
        "with per-stage lists (default: 1,1,1, then measured, see --profile-iterations)",
        parse=parse_costs)


def _fallback_option() -> Any:
    return option(
        None, "--chimera-zb-fallback", "split backward: when the order is predicted slower than "
        "the best unsplit schedule (1F1B, Chimera slot-merge) under the costs, 'unsplit' "
        "(default) runs that one instead; 'refuse' stops with the figures (Chimera-ZB forced)",
        choices=FALLBACKS, generator=False)


def _cap_option() -> Any:
    return option(
        None, CAP_FLAG, "split backward: cap on live activations per rank, in units of one "
        "micro-batch's activations on L/D layers (a half-size V chunk counts 0.5; default: the "
        "schedule's own, D, or D/2+1 for v-half)", parse=float)


@dataclass(frozen=True)
class ChimeraZBOptions:
    """Chimera-ZB: pipes, the cap on live activations, the costs the order is built for and what
    to do when it would lose to an unsplit schedule."""

    pipes: int = option(2, "--chimera-pipes", "Chimera: 2f pipes, f dividing D/2 (default 2)",
                        parse=int, search=(2, 4))
    max_inflight: int | None = option(
        None, "--chimera-max-inflight", "Chimera-ZB: cap on live activations per rank "
        "(default D)", parse=int)
    costs: Costs = _costs_option()
    fallback: str | None = _fallback_option()
    activation_cap: float | None = _cap_option()
    overlap_moe_expert_parallel_comm: bool | None = _overlap_option()


@dataclass(frozen=True)
class ZBH1Options:
    """ZB-H1: the costs its order is built for (none: the closed form), the fallback policy and
    the activation cap."""

    costs: Costs = _costs_option()
    fallback: str | None = _fallback_option()
    activation_cap: float | None = _cap_option()
    overlap_moe_expert_parallel_comm: bool | None = _overlap_option()


@dataclass(frozen=True)
class VShapeOptions:
    """ZBV, V-Half, BitPipe-ZB: the activation cap, the costs the order is built for and the
    fallback policy."""

    activation_cap: float | None = _cap_option()
    costs: Costs = _costs_option()
    fallback: str | None = _fallback_option()
    overlap_moe_expert_parallel_comm: bool | None = _overlap_option()


@dataclass(frozen=True)
class InterleavedOptions:
    """Interleaved 1F1B: model chunks (virtual stages) per pipeline rank."""

    virtual_pipeline_size: int = option(
        2, "--num-virtual-stages-per-pipeline-rank", "interleaved: model chunks per pipeline "
        "rank (default 2)", parse=int, search=(2, 4))
    overlap_moe_expert_parallel_comm: bool | None = _overlap_option()


@dataclass(frozen=True)
class CombinedOptions:
    """Megatron's combined 1F1B: model chunks (virtual stages) per pipeline rank."""

    virtual_pipeline_size: int = option(
        2, "--num-virtual-stages-per-pipeline-rank", "interleaved: model chunks per pipeline "
        "rank (default 2)", parse=int, search=(2, 4))


def _all_options(options: Any) -> dict[str, Any]:
    return {f.name: getattr(options, f.name) for f in fields(options)}


def _as_given(options: Any, num_ranks: int, num_microbatches: int) -> Any:
    return options


def _same_for_n_equal_d(options: Any, num_ranks: int, num_microbatches: int) -> Any:
    """Chimera's concatenation only matters for N > D: one variant (no concat) when N <= D."""
    if num_microbatches <= num_ranks:
        return replace(options, concat=None)
    return options


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule of the registry (see the module docstring)."""

    name: str
    generator: Callable[..., Schedule]
    options_type: type = NoOptions
    summary: str = ""
    # canonical form of a search variant at (D, N), or None when it duplicates another
    canonical: Callable[[Any, int, int], Any] = _as_given
    max_search_ranks: int | None = None  # the autotuner skips larger D (slow generator)
    # its schedules split the backward into B (input gradient) and W (weight gradient)
    split_backward: bool = False
    chunks: int = 1  # model chunks per rank per pipe (V-shaped: 2), D x chunks stages
    fixed_pipes: int = 1  # pipes when no option says (BitPipe: 2)
    # --overlap-moe-expert-parallel-comm pairs as Megatron's combined 1F1B (1F1B, interleaved)
    megatron_pairing: bool = False

    def stages_per_rank(self, options: Any = None) -> int:
        """Model stages per pipeline rank and pipe: the schedule has D x this many stages
        (interleaved: its virtual pipeline size; V-shaped: 2; else 1)."""
        return getattr(options, "virtual_pipeline_size", None) or self.chunks

    def pipes(self, options: Any = None) -> int:
        """Pipes of the schedule (``--chimera-pipes`` where it has the option)."""
        return getattr(options, "pipes", None) or self.fixed_pipes

    def option_fields(self) -> tuple[Field, ...]:
        """The options dataclass's fields (each with its flag metadata)."""
        return fields(self.options_type)

    def build(self, num_ranks: int, num_microbatches: int, options: Any = None,
              moe_layers_per_stage: int = 0) -> Schedule:
        """The schedule for D ranks and N micro-batches (ValueError naming the flag if it cannot
        run at these sizes); with ``--overlap-moe-expert-parallel-comm`` its pairs are chosen
        with each pair costed over ``moe_layers_per_stage`` MoE layers per stage when > 0
        (:func:`~.pairing.with_overlap`)."""
        options = self.options_type() if options is None else options
        if not isinstance(options, self.options_type):
            raise TypeError(f"{self.name} takes {self.options_type.__name__}, got {options!r}")
        kwargs = {f.name: getattr(options, f.name) for f in self.option_fields()
                  if f.metadata["generator"] and getattr(options, f.name) is not None}
        schedule = self.generator(num_ranks, num_microbatches, **kwargs)
        if getattr(options, "overlap_moe_expert_parallel_comm", None):
            costs = getattr(options, "costs", None)
            if costs is not None and not isinstance(costs, StageCosts):
                costs = StageCosts.of(costs, 1)
            # a cap the user gave holds for the paired order too
            cap = getattr(options, "activation_cap", None) or getattr(options, "max_inflight",
                                                                       None)
            schedule = with_overlap(schedule, costs, megatron=self.megatron_pairing,
                                    activation_limit=cap,
                                    moe_layers_per_stage=moe_layers_per_stage)
        return schedule

    def options_from(self, source: Any, strict: bool = True) -> Any:
        """Options read from ``source``'s flag attributes (an argparse namespace or any object
        with them; missing or None: the default). ``strict`` rejects registry flags that were
        given but do not apply to this schedule."""
        mine = {f.metadata["flag"] for f in self.option_fields()}
        if strict:
            for flag in all_option_flags():
                if flag not in mine and getattr(source, flag_dest(flag), None) is not None:
                    raise ValueError(f"{flag} does not apply to --pipeline-schedule {self.name}"
                                     f"{_where_it_applies(flag)}")
        values = {}
        for f in self.option_fields():
            value = getattr(source, flag_dest(f.metadata["flag"]), None)
            if value is not None:
                values[f.name] = value
        return self.options_type(**values)

    def to_flags(self, options: Any = None) -> list[str]:
        """``--pipeline-schedule NAME`` and every option that is set (defaults spelt out, so
        the command does not depend on them)."""
        options = self.options_type() if options is None else options
        flags = ["--pipeline-schedule", self.name]
        for f in self.option_fields():
            value = getattr(options, f.name)
            if f.metadata["switch"]:
                flags += [f.metadata["flag"]] if value else []
            elif value is not None:
                text = costs_text(value) if f.name == "costs" else str(value)
                flags += [f.metadata["flag"], text]
        return flags

    def variants(self, num_ranks: int, num_microbatches: int,
                 search: Mapping[str, Sequence[Any]] | None = None) -> Iterator[Any]:
        """Option sets the autotuner tries at (D, N): every combination of each field's search
        values (or ``search[field name]``), deduplicated by :attr:`canonical`. Sizes are not
        checked here: building an invalid variant raises ValueError."""
        if self.max_search_ranks is not None and num_ranks > self.max_search_ranks:
            return
        search = search or {}
        names = [f.name for f in self.option_fields()]
        choices = [tuple(search.get(f.name, ())) or f.metadata["search"] or (f.default,)
                   for f in self.option_fields()]
        seen = set()
        for values in itertools.product(*choices):
            options = self.canonical(self.options_type(**dict(zip(names, values))),
                                     num_ranks, num_microbatches)
            if options is not None and options not in seen:
                seen.add(options)
                yield options

    def label(self, options: Any = None) -> str:
        """``name`` plus the options that differ from their defaults (``chimera/direct``)."""
        options = self.options_type() if options is None else options
        parts = [self.name]
        for f in self.option_fields():
            value = getattr(options, f.name)
            if f.name in ("pipes", "costs") or not f.metadata["generator"]:
                continue
            if value is not None and value != f.default:
                if f.name == "virtual_pipeline_size":
                    parts.append(f"v{value}")
                else:
                    parts.append(f"cap{value:g}" if f.name == "activation_cap" else str(value))
        return "/".join(parts)


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec for spec in (
        ScheduleSpec("gpipe", gpipe, summary="all forwards, then all backwards"),
        ScheduleSpec("1f1b", one_f_one_b, OverlapOptions, summary="1F1B (PipeDream-Flush / DAPPLE)",
                     megatron_pairing=True),
        ScheduleSpec("interleaved", interleaved, InterleavedOptions,
                     summary="Megatron's interleaved 1F1B (virtual pipeline)",
                     megatron_pairing=True),
        ScheduleSpec("chimera", chimera, ChimeraOptions,
                     summary="Chimera: 2f bidirectional pipes", canonical=_same_for_n_equal_d),
        ScheduleSpec("chimera-zb", chimera_zb, ChimeraZBOptions,
                     summary="Chimera with split backward, W fills the bubbles",
                     max_search_ranks=16, split_backward=True),
        ScheduleSpec("zb-h1", zb_h1, ZBH1Options,
                     summary="ZB-H1: 1F1B with delayed weight gradients", split_backward=True,
                     megatron_pairing=True),
        ScheduleSpec("zb-2p", zb_2p, summary="ZB-2p: split backward, up to 2D live activations",
                     split_backward=True),
        ScheduleSpec("zbv", zbv, VShapeOptions,
                     summary="zero-bubble V: one V-shaped pipe, split backward, one weight copy",
                     max_search_ranks=16, split_backward=True, chunks=2),
        ScheduleSpec("v-half", v_half, VShapeOptions,
                     summary="V-Half: one V-shaped pipe at about half 1F1B's activations",
                     max_search_ranks=16, split_backward=True, chunks=2),
        ScheduleSpec("bitpipe", bitpipe, OverlapOptions,
                     summary="BitPipe: two opposite V-shaped pipes (4 half chunks per rank)",
                     max_search_ranks=16, chunks=2, fixed_pipes=2),
        ScheduleSpec("bitpipe-zb", bitpipe_zb, VShapeOptions,
                     summary="BitPipe with a cost-aware B/W split (as Chimera-ZB)",
                     max_search_ranks=16, split_backward=True, chunks=2, fixed_pipes=2),
        ScheduleSpec("dualpipe", dualpipe,
                     summary="DeepSeek's DualPipe: Chimera's two pipes, split backward, "
                             "F&B pairs hiding the MoE all-to-all", split_backward=True,
                     fixed_pipes=2),
        ScheduleSpec("dualpipev", dualpipev,
                     summary="DeepSeek's DualPipeV: one V pipe (DualPipe cut in half), split "
                             "backward, F&B pairs", split_backward=True, chunks=2),
        ScheduleSpec("combined-1f1b", combined_1f1b, CombinedOptions,
                     summary="Megatron's combined 1F1B: interleaved, one extra warm-up "
                             "forward, F&B pairs"),
    )
}
SCHEDULE_NAMES = tuple(SCHEDULES)
# the published F&B-overlap schedules (always paired), built to compare with Chimera-EP
PAIRED_SCHEDULES = ("dualpipe", "dualpipev", "combined-1f1b")
# the split-backward schedules whose order is built for the costs (profiled and rebuilt during
# training); DualPipe's and DualPipeV's orders are fixed
SPLIT_BACKWARD_SCHEDULES = tuple(
    name for name, spec in SCHEDULES.items()
    if spec.split_backward and any(f.name == "costs" for f in spec.option_fields()))


def get_spec(name: str) -> ScheduleSpec:
    """The spec of ``--pipeline-schedule name`` (ValueError naming the choices otherwise)."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(
            f"--pipeline-schedule: unknown schedule {name!r}; choose from {SCHEDULE_NAMES}"
        ) from None


def build_schedule(name: str, num_ranks: int, num_microbatches: int, **options: Any) -> Schedule:
    """Build schedule ``name`` with options given as keywords (the option field names)."""
    spec = get_spec(name)
    known = {f.name for f in spec.option_fields()}
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"--pipeline-schedule {name} has no option {sorted(unknown)}; "
                         f"its options are {sorted(known)}")
    return spec.build(num_ranks, num_microbatches, spec.options_type(**options))


def parse_schedule_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``name:key=value:key=value`` (the tools' ``--schedules`` entries) -> (name, options);
    integer values become ints. ValueError for a pair that is not ``key=value``."""
    name, *pairs = spec.split(":")
    options: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--schedules: option {pair!r} of {spec!r} is not key=value")
        key, value = pair.split("=", 1)
        options[key] = int(value) if value.lstrip("-").isdigit() else value
    return name, options


def all_option_flags() -> list[str]:
    """Every option flag of every schedule, once each, in registry order."""
    flags: list[str] = []
    for spec in SCHEDULES.values():
        for f in spec.option_fields():
            if f.metadata["flag"] not in flags:
                flags.append(f.metadata["flag"])
    return flags


def _where_it_applies(flag: str) -> str:
    names = [s.name for s in SCHEDULES.values()
             if flag in {f.metadata["flag"] for f in s.option_fields()}]
    return f" (it applies to {', '.join(names)})" if names else ""


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` whose ValueError message reaches the user (argparse replaces a plain
    ValueError by "invalid <name> value")."""
    if parse in (str, int, float):
        return parse

    def parse_flag(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse_flag.__name__ = getattr(parse, "__name__", "value")
    return parse_flag


def add_schedule_arguments(parser: argparse.ArgumentParser | Any,
                           default_schedule: str | None = None) -> None:
    """``--pipeline-schedule``, ``--chimera-split-backward`` and every option flag (default None,
    so that a flag given for the wrong schedule can be told from an absent one)."""
    parser.add_argument("--pipeline-schedule", choices=SCHEDULE_NAMES, default=default_schedule,
                        help="the pipeline schedule (default: chimera when --chimera-pipes or "
                             "--chimera-split-backward is given, else 1f1b)"
                        if default_schedule is None else
                             f"the pipeline schedule (default {default_schedule})")
    parser.add_argument("--chimera-split-backward", action="store_true",
                        help="Chimera-ZB: split the backward into B and W, W fills the bubbles "
                             "(same as --pipeline-schedule chimera-zb)")
    seen = set()
    for spec in SCHEDULES.values():
        for f in spec.option_fields():
            flag = f.metadata["flag"]
            if flag in seen:
                continue
            seen.add(flag)
            if f.metadata["switch"]:
                parser.add_argument(flag, action="store_const", const=True, default=None,
                                    help=f.metadata["help"])
                continue
            parser.add_argument(flag, type=_argparse_type(f.metadata["parse"] or str),
                                choices=f.metadata["choices"], default=None,
                                help=f.metadata["help"])


def schedule_name_from(source: Any) -> str:
    """The schedule the flags select: ``--pipeline-schedule`` (default chimera when
    ``--chimera-pipes`` or ``--chimera-split-backward`` is given, else 1f1b);
    ``--chimera-split-backward`` turns chimera into chimera-zb."""
    name = getattr(source, "pipeline_schedule", None)
    split = getattr(source, "chimera_split_backward", False)
    if name is None:
        chimera_flags = split or getattr(source, "chimera_pipes", None) is not None
        name = "chimera" if chimera_flags else "1f1b"
    if split:
        if name not in ("chimera", "chimera-zb"):
            raise ValueError(f"--chimera-split-backward requires --pipeline-schedule chimera or "
                             f"chimera-zb, got {name}")
        name = "chimera-zb"
    return name


def spec_and_options_from(source: Any, strict: bool = True) -> tuple[ScheduleSpec, Any]:
    """The spec and options that parsed flags (see :func:`add_schedule_arguments`) select."""
    spec = get_spec(schedule_name_from(source))
    return spec, spec.options_from(source, strict=strict)


def options_dict(options: Any) -> dict[str, Any]:
    """Every option field's value, by field name."""
    return _all_options(options)


__all__ = [
    "ScheduleSpec", "SCHEDULES", "SCHEDULE_NAMES", "PAIRED_SCHEDULES", "NoOptions",
    "OverlapOptions", "CombinedOptions", "ChimeraOptions",
    "ChimeraZBOptions", "ZBH1Options", "InterleavedOptions", "VShapeOptions", "FALLBACKS",
    "parse_costs",
    "get_spec", "build_schedule", "all_option_flags",
    "add_schedule_arguments", "schedule_name_from", "spec_and_options_from", "options_dict",
    "flag_dest", "option",
]
