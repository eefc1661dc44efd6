"""Megatron's command-line flags: the argparse parser, one loop over the configuration fields.

Every flag that sets a configuration field is declared on that field
(:func:`megatron_chimera.config.flag`); the schedule flags come from the schedule registry. The
few flags that set no field of their own (an older spelling, a value converted while parsing, an
accepted no-op) are the :data:`HAND_FLAGS` below. :mod:`.arguments` turns the parsed namespace into
the validated configuration dataclasses. The parser raises
:class:`~megatron_chimera.config.ConfigError` instead of printing usage and exiting, so a bad flag
fails every rank the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from megatron_chimera.config import FLAG_SECTIONS, ConfigError, Flag, ModelConfig, flag_fields
from megatron_chimera.config.flag import Check, non_negative, positive
from megatron_chimera.errors import DEBUG_FLAG
from megatron_chimera.schedules.registry import add_schedule_arguments
from megatron_chimera.training.flag_catalog import refused_flag_message

__all__ = ["build_parser", "add_architecture_arguments", "field_flags", "HAND_FLAGS",
           "GROUP_TITLES", "HandFlag"]

# The groups of ``--help`` and docs/FLAGS.md, in order.
GROUP_TITLES = ("network size", "mixture of experts", "distributed", "training", "optimizer",
                "mixed precision", "data and tokenizer", "checkpointing", "logging")


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(refused_flag_message(message) or self._with_suggestion(message))

    def _with_suggestion(self, message: str) -> str:
        """argparse's ``message``, plus "did you mean --x?" for each unrecognized flag that is
        close to a flag of this parser (the live table: every declared flag counts)."""
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return message
        known = [name for name in self._option_string_actions if name.startswith("--")]
        hints = []
        for token in message[len(prefix):].split():
            flag = token.split("=", 1)[0]
            if flag.startswith("--"):
                close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
                hints += [f"{flag}: did you mean {close[0]}?"] if close else []
        return message + (f" ({'; '.join(hints)})" if hints else "")


@dataclass(frozen=True)
class HandFlag:
    """A flag that is not a configuration field of its own: ``declare`` adds it (or several) to
    an argparse group; ``after`` names the flag it follows in ``--help``; ``checks`` the range
    checks of its values (by argparse destination)."""

    group: str
    after: str | None
    names: tuple[str, ...]
    declare: Callable[[Any], None]
    checks: tuple[tuple[str, Check], ...] = ()
    decoder: bool = False  # one of the decoder-architecture flags the tools share


def _hand(group: str, after: str | None, name: str, checks: tuple[tuple[str, Check], ...] = (),
          decoder: bool = False, **kwargs: Any) -> HandFlag:
    """A :class:`HandFlag` declaring the single flag ``name`` with argparse's ``kwargs``."""
    return HandFlag(group, after, (name,), lambda g: g.add_argument(name, **kwargs), checks,
                    decoder)


_SCHEDULE_OPTIONS_POSITIVE = (("chimera_pipes", positive), ("chimera_max_inflight", positive),
                              ("num_virtual_stages_per_pipeline_rank", positive))

HAND_FLAGS: tuple[HandFlag, ...] = (
    _hand("network size", "--gelu", "--no-apex", action="store_true",
          help="use torch-native kernels even when NVIDIA Apex is importable"),
    _hand("network size", "--normalization", "--norm-epsilon", type=float,
          decoder=True, help="epsilon of the layer norms (LayerNorm or RMSNorm; default 1e-5)"),
    _hand("network size", "--kv-channels", "--group-query-attention", action="store_true",
          decoder=True, help="GPT: grouped-query attention (--num-query-groups key/value heads, "
                             "divided over the tensor-parallel ranks)"),
    _hand("distributed", "--no-async-tensor-model-parallel-allreduce",
          "--no-scatter-gather-tensors-in-pipeline", action="store_true",
          help="accepted: pipeline messages are never split over the tensor-parallel ranks "
               "(--sequence-parallel sends 1/T of the bytes)"),
    HandFlag("distributed", "--pipeline-model-parallel-size", ("--pipeline-schedule",),
             add_schedule_arguments, _SCHEDULE_OPTIONS_POSITIVE),
    _hand("distributed", "--pipeline-schedule", "--num-layers-per-virtual-pipeline-stage",
          (("num_layers_per_virtual_pipeline_stage", positive),), type=int,
          help="interleaved: layers per model chunk (alternative to "
               "--num-virtual-stages-per-pipeline-rank)"),
    _hand("distributed", "--distributed-timeout-minutes", "--accumulate-allreduce-grads-in-fp32",
          action="store_true",
          help="accumulate and reduce gradients in fp32 buffers (always on with --bf16)"),
    _hand("distributed", "--overlap-grad-reduce", "--ddp-bucket-size",
          (("ddp_bucket_size", positive),), type=int,
          help="elements per gradient bucket (default: max(40M, 1M x stage-replica group size) "
               "with --overlap-grad-reduce, else one bucket per stage)"),
    _hand("training", "--seed", "--check-for-nan-in-loss-and-grad", action="store_true",
          default=True, help="stop with the iteration and rank when a loss or gradient is "
                             "NaN/Inf (default on; --no-... turns it off)"),
    _hand("optimizer", "--lr-decay-style", "--lr-decay-iters", (("lr_decay_iters", positive),),
          type=int, help="decay period in iterations (default --train-iters)"),
    _hand("optimizer", "--lr-decay-samples", "--lr-warmup-iters",
          (("lr_warmup_iters", non_negative),), type=int,
          help="linear warmup in iterations"),
    _hand("data and tokenizer", "--mock-data", "--data-impl", choices=("mmap", "infer"),
          default="mmap",
          help="indexed dataset implementation: mmap (Megatron's MMIDIDX, the only one)"),
    _hand("checkpointing", "--finetune", "--use-checkpoint-args", action="store_true",
          help="take the model flags (shape, model settings, --seq-length, --tokenizer-type, "
               "--vocab-size) from --load's checkpoint; flags given on the command line win "
               "(the parallel layout is never taken: any layout loads)"),
    _hand("logging", "--log-memory-to-tensorboard", "--log-validation-ppl-to-tensorboard",
          action="store_true", help="validation perplexity in TensorBoard (always written)"),
    _hand("logging", "--log-memory-to-tensorboard", "--log-batch-size-to-tensorboard",
          action="store_true", help="global batch size in TensorBoard (always written)"),
    _hand("logging", "--wandb-save-dir", DEBUG_FLAG, action="store_true",
          help="print the traceback of every error (also: MEGATRON_CHIMERA_TRACEBACKS=1)"),
)


@dataclass(frozen=True)
class _Entry:
    """One declaration in ``--help`` order: a field's flag or a hand-written flag."""

    group: str
    after: str | None
    names: tuple[str, ...]
    section: type | None
    declare: Callable[[Any], None]


def field_flags() -> Iterator[tuple[type, dataclasses.Field, Flag]]:
    """(section, field, flag) of every configuration field that has a flag, sections in
    :data:`~megatron_chimera.config.FLAG_SECTIONS` order."""
    for section in FLAG_SECTIONS:
        for f, spec in flag_fields(section):
            yield section, f, spec


def _entries() -> list[_Entry]:
    """Every declaration: the fields' flags, then the hand-written ones."""
    entries = [_Entry(spec.group, spec.after, (spec.name,), section,
                      lambda g, spec=spec, f=f: spec.add_to(g, f.name, f.default))
               for section, f, spec in field_flags()]
    return entries + [_Entry(h.group, h.after, h.names, None, h.declare) for h in HAND_FLAGS]


def _help_order(entries: list[_Entry]) -> list[_Entry]:
    """The entries of one group in ``--help`` order: each follows its ``after`` flag (entries
    anchored to one flag in declaration order), else the previous flag of its section; an entry
    that follows another comes before that one's section successor."""
    by_name = {name: e for e in entries for name in e.names}
    anchored: dict[int, list[_Entry]] = {id(e): [] for e in entries}
    successor: dict[int, _Entry] = {}
    previous: dict[type, _Entry] = {}
    roots = []
    for entry in entries:
        if entry.after is not None:
            if entry.after not in by_name:
                raise AssertionError(f"{entry.names[0]} follows {entry.after}, which is not a "
                                     f"flag of the group {entry.group!r}")
            anchored[id(by_name[entry.after])].append(entry)
        elif entry.section in previous:
            successor[id(previous[entry.section])] = entry
        else:
            roots.append(entry)
        if entry.section is not None:
            previous[entry.section] = entry
    ordered: list[_Entry] = []

    def emit(entry: _Entry) -> None:
        ordered.append(entry)
        for child in anchored[id(entry)]:
            emit(child)
        if id(entry) in successor:
            emit(successor[id(entry)])

    for root in roots:
        emit(root)
    return ordered


def build_parser(
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
) -> argparse.ArgumentParser:
    """The full Megatron-style parser; ``extra_args_provider`` may add script-specific flags."""
    parser = _ArgumentParser(description="megatron_chimera arguments", allow_abbrev=False)
    entries = _entries()
    for title in GROUP_TITLES:
        group = parser.add_argument_group(title)
        for entry in _help_order([e for e in entries if e.group == title]):
            entry.declare(group)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    return parser


def add_architecture_arguments(g: argparse._ActionsContainer) -> None:
    """Today's decoders (Megatron's flags and defaults): normalisation, SwiGLU, head sizes,
    grouped-query attention, biases, position embeddings -- for tools that build a model."""
    entries = [_Entry("decoder", None, (spec.name,), ModelConfig,
                      lambda g, spec=spec, f=f: spec.add_to(g, f.name, f.default))
               for f, spec in flag_fields(ModelConfig) if spec.decoder]
    entries += [_Entry("decoder", h.after, h.names, None, h.declare)
                for h in HAND_FLAGS if h.decoder]
    for entry in _help_order(entries):
        entry.declare(g)
