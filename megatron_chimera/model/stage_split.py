"""Uneven pipeline stages from Megatron-LM's flags: the layout string and the first/last/account
rules, resolved into the ``(start, end)`` layer ranges of every stage.

``--pipeline-model-parallel-layout`` is Megatron's string: ``E`` the embedding, ``t`` one
transformer layer, ``L`` the loss (final norm and head), ``|`` a stage boundary, ``x*k`` and
``(...)*k`` repetition, commas cosmetic; the stages in model order (with virtual stages, as
Megatron: all ranks' first chunks, then their second chunks). For Chimera and BitPipe the layout
describes one pipe's stages: the mirror pipe holds the same stages. Here ``E`` must open the first
stage, ``L`` close the last, and every stage hold at least one ``t`` for training (no empty or
standalone embedding stage; Megatron's ``m``, a multi-token-prediction layer, does not exist
here). The performance model also prices stages without a ``t`` (``allow_empty``), as Megatron's
layout allows, e.g. the embedding-only and loss-only chunks of a padded interleaved run.

``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` fix the layers
of the first / last stage and split the others evenly over the middle stages (Megatron's rule:
they must divide evenly). ``--account-for-embedding-in-pipeline-split`` /
``--account-for-loss-in-pipeline-split`` count the embedding / the loss as one layer each: the
``num_layers + extras`` then divide evenly by the stages, and the first / last stage holds one
transformer layer less.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from megatron_chimera.config import ConfigError, LayerSplit, ModelConfig
from megatron_chimera.model.family import ModelFamily
from megatron_chimera.model.partition import partition_layers

LAYOUT_FLAG = "--pipeline-model-parallel-layout"
_REPEAT_GROUP = re.compile(r"\(([^()]*)\)\*(\d+)")
_REPEAT_SYMBOL = re.compile(r"([EtLm|])\*(\d+)")


def is_layout(text: str) -> bool:
    """Whether ``text`` is a layout string (it names the embedding) rather than a
    ``--partition-method`` name."""
    return "E" in text


def expand_layout(text: str) -> list[str]:
    """The stages of a layout string, each as its symbols (``"Et*2|tL"`` -> ``["Ett", "tL"]``);
    ConfigError naming the flag on a symbol or bracket it cannot read."""
    body = text.replace(",", "").replace(" ", "")
    while True:  # innermost groups first, so nesting works
        expanded = _REPEAT_GROUP.sub(lambda m: m.group(1) * int(m.group(2)), body)
        if expanded == body:
            break
        body = expanded
    body = _REPEAT_SYMBOL.sub(lambda m: m.group(1) * int(m.group(2)), body)
    unknown = sorted(set(body) - set("EtLm|"))
    if unknown:
        raise ConfigError(f"{LAYOUT_FLAG} {text!r}: cannot read {''.join(unknown)!r} (symbols: "
                          f"E embedding, t layer, L loss, | stage boundary, x*k and (...)*k "
                          f"repetition)")
    return body.split("|")


def empty_stages(text: str) -> list[int]:
    """The stages of layout ``text`` that hold no transformer layer ``t``."""
    return [s for s, stage in enumerate(expand_layout(text)) if "t" not in stage]


def layout_partition(text: str, num_layers: int, num_stages: int,
                     allow_empty: bool = False) -> list[tuple[int, int]]:
    """Layer ranges of the stages of layout ``text``; ConfigError naming the flag when its
    stages are not the schedule's, its layers do not sum to ``--num-layers``, the embedding
    or loss is misplaced, or (unless ``allow_empty``: the performance model's pricing) a stage
    holds no transformer layer."""
    stages = expand_layout(text)
    where = f"{LAYOUT_FLAG} {text!r}"
    if "m" in "".join(stages):
        raise ConfigError(f"{where}: 'm' (multi-token prediction) is not supported")
    if len(stages) != num_stages:
        raise ConfigError(f"{where} has {len(stages)} stages, the schedule has {num_stages} "
                          f"(for Chimera: one pipe's stages; with virtual stages: all of them)")
    total = sum(stage.count("t") for stage in stages)
    if total != num_layers:
        raise ConfigError(f"{where} holds {total} transformer layers, --num-layers is "
                          f"{num_layers}")
    joined = "|".join(stages)
    if joined.count("E") != 1 or not stages[0].startswith("E"):
        raise ConfigError(f"{where}: the embedding E must open the first stage, once")
    if joined.count("L") != 1 or not stages[-1].endswith("L"):
        raise ConfigError(f"{where}: the loss L must close the last stage, once")
    empty = [s for s, stage in enumerate(stages) if "t" not in stage]
    if empty and not allow_empty:
        raise ConfigError(f"{where}: stage {empty[0]} holds no transformer layer (every stage "
                          f"needs at least one t here)")
    return ranges_of([stage.count("t") for stage in stages])


def ranges_of(counts: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous ``(start, end)`` ranges of the given layer counts."""
    bounds = [0]
    for count in counts:
        bounds.append(bounds[-1] + count)
    return [(bounds[s], bounds[s + 1]) for s in range(len(counts))]


def format_layout(partition: Sequence[tuple[int, int]]) -> str:
    """The layout string of a partition (``[(0,3),(3,5),(5,7),(7,8)]`` ->
    ``"Et*3|t*2|t*2|tL"``): what ``--pipeline-model-parallel-layout`` takes."""
    def layers(n: int) -> str:
        return "t" if n == 1 else f"t*{n}"
    parts = [layers(end - start) for start, end in partition]
    parts[0] = "E" + parts[0]
    parts[-1] = parts[-1] + "L"
    return "|".join(parts)


def _even(layers: int, stages: int, what: str) -> list[int]:
    if stages == 0:
        if layers:
            raise ConfigError(f"{what}: {layers} layers left but no middle stage")
        return []
    if layers <= 0 or layers % stages:
        raise ConfigError(f"{what}: the remaining {layers} layers do not divide evenly over "
                          f"the {stages} other stages")
    return [layers // stages] * stages


def _first_last_counts(split: LayerSplit, num_layers: int, num_stages: int) -> list[int]:
    first, last = split.decoder_first_pipeline_num_layers, split.decoder_last_pipeline_num_layers
    names = [f"--decoder-{w}-pipeline-num-layers {v}"
             for w, v in (("first", first), ("last", last)) if v is not None]
    what = " and ".join(names)
    fixed = [v for v in (first, last) if v is not None]
    if any(v < 1 for v in fixed):
        raise ConfigError(f"{what}: every stage needs at least one layer")
    if num_stages == 1:
        raise ConfigError(f"{what} needs more than one pipeline stage")
    middle = _even(num_layers - sum(fixed), num_stages - len(fixed), what)
    return ([first] if first is not None else []) + middle + ([last] if last is not None else [])


def _accounted_counts(split: LayerSplit, num_layers: int, num_stages: int) -> list[int]:
    extras = [split.account_for_embedding_in_pipeline_split,
              split.account_for_loss_in_pipeline_split]
    names = [flag for flag, on in zip(("--account-for-embedding-in-pipeline-split",
                                       "--account-for-loss-in-pipeline-split"), extras) if on]
    total = num_layers + sum(extras)
    if total % num_stages:
        raise ConfigError(f"{' and '.join(names)}: --num-layers {num_layers} + {sum(extras)} "
                          f"is not divisible by the {num_stages} pipeline stages")
    counts = [total // num_stages] * num_stages
    counts[0] -= extras[0]
    counts[-1] -= extras[1]
    if min(counts) < 1:
        raise ConfigError(f"{' and '.join(names)}: a stage would hold no transformer layer")
    return counts


def split_partition(split: LayerSplit, num_layers: int, num_stages: int,
                    pipeline_size: int) -> list[tuple[int, int]] | None:
    """Layer ranges the uneven-split flags ask for; None when none is given (``--partition-method``
    decides). First / last layer counts need one stage per rank (``num_stages ==
    pipeline_size``); with virtual stages give the layout."""
    if split.pipeline_model_parallel_layout is not None:
        return layout_partition(split.pipeline_model_parallel_layout, num_layers, num_stages)
    if (split.decoder_first_pipeline_num_layers is not None
            or split.decoder_last_pipeline_num_layers is not None):
        if num_stages != pipeline_size:
            raise ConfigError(f"--decoder-first/last-pipeline-num-layers with {num_stages} "
                              f"virtual stages on {pipeline_size} ranks: use {LAYOUT_FLAG}")
        return ranges_of(_first_last_counts(split, num_layers, num_stages))
    if split.account_for_embedding_in_pipeline_split or split.account_for_loss_in_pipeline_split:
        return ranges_of(_accounted_counts(split, num_layers, num_stages))
    return None


def stage_partition(split: LayerSplit, method: str, config: ModelConfig, family: ModelFamily,
                    num_stages: int, pipeline_size: int) -> list[tuple[int, int]]:
    """The run's layer ranges: the uneven-split flags when given, else ``--partition-method``
    (``uniform`` or ``parameters``; ``time`` is measured by the driver)."""
    ranges = split_partition(split, config.num_layers, num_stages, pipeline_size)
    if ranges is not None:
        return ranges
    return partition_layers(config.num_layers, num_stages, method, config=config, family=family)
