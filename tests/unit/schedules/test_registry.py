"""The schedule registry: one ScheduleSpec per name drives flags, options, building and search."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from megatron_chimera.schedules import SCHEDULE_NAMES, SCHEDULES, build_schedule, get_spec
from megatron_chimera.schedules.registry import (
    ChimeraOptions,
    ChimeraZBOptions,
    add_schedule_arguments,
    all_option_flags,
    parse_costs,
    spec_and_options_from,
)
from megatron_chimera.schedules.validate import validate


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_schedule_arguments(p)
    return p


def parse(argv: str):
    return spec_and_options_from(parser().parse_args(argv.split()))


def test_every_schedule_builds_with_its_defaults_and_validates():
    for name, spec in SCHEDULES.items():
        schedule = spec.build(4, 8)
        validate(schedule)
        assert schedule.name == name
        assert schedule.split_backward == (
            name in ("chimera-zb", "zb-h1", "zb-2p", "zbv", "v-half", "bitpipe-zb", "dualpipe",
                     "dualpipev"))


def test_flags_select_schedule_and_typed_options():
    spec, options = parse("--chimera-pipes 4 --chimera-concat direct")
    assert spec.name == "chimera" and options == ChimeraOptions(pipes=4, concat="direct")
    spec, options = parse("--pipeline-schedule chimera --chimera-split-backward "
                          "--chimera-max-inflight 3 --chimera-zb-costs 1,1.5,0.5")
    assert spec.name == "chimera-zb"
    assert options == ChimeraZBOptions(pipes=2, max_inflight=3, costs=(1.0, 1.5, 0.5))
    assert parse("")[0].name == "1f1b"
    spec, options = parse("--pipeline-schedule interleaved "
                          "--num-virtual-stages-per-pipeline-rank 3")
    assert options.virtual_pipeline_size == 3


@pytest.mark.parametrize("argv,message", [
    ("--pipeline-schedule 1f1b --chimera-concat direct",
     "--chimera-concat does not apply to --pipeline-schedule 1f1b (it applies to chimera)"),
    ("--pipeline-schedule chimera --chimera-max-inflight 2",
     "--chimera-max-inflight does not apply to --pipeline-schedule chimera"),
    ("--pipeline-schedule gpipe --num-virtual-stages-per-pipeline-rank 2",
     "--num-virtual-stages-per-pipeline-rank does not apply"),
    ("--pipeline-schedule 1f1b --chimera-split-backward", "--chimera-split-backward requires"),
])
def test_flags_that_do_not_apply_are_rejected(argv, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse(argv)


def test_to_flags_round_trips_through_the_parser_for_every_search_variant():
    for spec in SCHEDULES.values():
        for options in spec.variants(8, 32):
            again = parse(" ".join(spec.to_flags(options)))
            assert again == (spec, options), (spec.name, options)


def test_variants_deduplicate_and_respect_search_overrides():
    chimera = get_spec("chimera")
    at_n_equal_d = list(chimera.variants(4, 4))
    assert at_n_equal_d == [ChimeraOptions(2, None), ChimeraOptions(4, None)]
    assert len(list(chimera.variants(4, 8))) == 2 * 3  # pipes x concatenations
    assert [o.pipes for o in chimera.variants(4, 4, {"pipes": (2,)})] == [2]
    assert list(get_spec("chimera-zb").variants(32, 64)) == []  # slow generator beyond D = 16
    assert list(get_spec("1f1b").variants(4, 8)) == [get_spec("1f1b").options_type()]


def test_build_schedule_keywords_are_the_option_fields():
    assert build_schedule("chimera", 4, 8, pipes=4).num_pipes == 4
    with pytest.raises(ValueError, match="has no option"):
        build_schedule("1f1b", 4, 8, pipes=2)
    with pytest.raises(ValueError, match="unknown schedule"):
        get_spec("pipedream")


def test_every_option_flag_is_added_once_and_parses():
    flags = all_option_flags()
    assert len(flags) == len(set(flags))
    parsed = parser().parse_args([])
    for flag in flags:
        assert getattr(parsed, flag[2:].replace("-", "_")) is None
    assert parser()._option_string_actions["--pipeline-schedule"].choices == SCHEDULE_NAMES
    for spec in SCHEDULES.values():
        for f in dataclasses.fields(spec.options_type):
            assert f.metadata["flag"] in flags


def test_chimera_zb_costs_flag_changes_the_order():
    with pytest.raises(ValueError, match="--chimera-zb-costs"):
        parse_costs("1,2")
    default = build_schedule("chimera-zb", 8, 16)
    skewed = build_schedule("chimera-zb", 8, 16, costs=(1.0, 1.5, 0.5))
    assert skewed.meta["costs"] == [1.0, 1.5, 0.5] and default.meta["costs"] == [1.0, 1.0, 1.0]
    assert skewed.actions != default.actions
