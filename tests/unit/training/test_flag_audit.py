"""The flag audit: docs/FLAGS.md is generated and current, every parsed flag is read by library
code, every Megatron-LM flag is supported or refused with a reason, misplaced flags fail."""

from __future__ import annotations

import importlib
import importlib.util
import re

import pytest

from megatron_chimera.config import ConfigError
from megatron_chimera.schedules.registry import all_option_flags, flag_dest
from megatron_chimera.training import flag_catalog
from megatron_chimera.training.arguments import build_parser, parse_args
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT
TOOL = ROOT / "tools" / "gen_flags_doc.py"
BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --lr 1e-3 --train-iters 2 --mock-data --vocab-size 100").split()


def _tool():
    spec = importlib.util.spec_from_file_location("gen_flags_doc", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _actions():
    return _tool().flag_actions(build_parser())


def test_flags_doc_is_generated_and_current():
    tool = _tool()
    text = tool.render()
    assert (ROOT / "docs" / "FLAGS.md").read_text(encoding="utf-8") == text, (
        "docs/FLAGS.md is stale: run python tools/gen_flags_doc.py")
    assert tool.main(["--check"]) == 0
    for action in _actions():  # every accepted flag is listed
        assert f"`{action.option_strings[0]}" in text


def test_every_flag_has_a_description():
    missing = [a.option_strings[0] for a in _actions() if not a.help]
    assert not missing, f"give these flags a help text: {missing}"


# the schedule registry's flags: read by ScheduleSpec.options_from into parallel.schedule_options
SCHEDULE_REGISTRY_DESTS = {flag_dest(f) for f in all_option_flags()} | {
    "pipeline_schedule", "chimera_split_backward"}


def _library_sources() -> str:
    """Every library source that may read a configuration field (the parser excluded)."""
    paths = [*sorted((ROOT / "megatron_chimera").rglob("*.py")), ROOT / "pretrain_gpt2.py",
             ROOT / "pretrain_bert.py"]
    skip = {"arguments.py", "flag_catalog.py"}
    return "\n".join(p.read_text(encoding="utf-8") for p in paths if p.name not in skip)


def test_every_parsed_flag_is_read_somewhere():
    """Each flag lands in a config field that library code reads (``.field``), or arguments.py
    consumes it while parsing (``args.dest``), or it is an always-on Megatron flag."""
    tool = _tool()
    sources = _library_sources()
    arguments = (ROOT / "megatron_chimera" / "training" / "arguments.py").read_text(
        encoding="utf-8")
    unread = []
    for action in _actions():
        dest = action.dest
        if dest in flag_catalog.ALWAYS_ON:
            continue
        if dest in SCHEDULE_REGISTRY_DESTS:  # read by the registry into parallel.schedule_options
            if not re.search(r"\.schedule_options\b", sources):
                unread.append(f"{action.option_strings[0]} (schedule options never read)")
            continue
        if dest in flag_catalog.READ_OUTSIDE_CONFIG:
            module = flag_catalog.READ_OUTSIDE_CONFIG[dest][0]
            source = (ROOT / "megatron_chimera" / f"{module}.py").read_text(encoding="utf-8")
            if action.option_strings[0] not in source:
                unread.append(f"{action.option_strings[0]} (not read by {module})")
            continue
        if dest in flag_catalog.CONSUMED_WHILE_PARSING:
            if not re.search(rf"\bargs\.{dest}\b", arguments):
                unread.append(f"{action.option_strings[0]} (not read while parsing)")
            continue
        if not tool.config_fields(dest):
            unread.append(f"{action.option_strings[0]} (no config field {dest})")
        elif not re.search(rf"\.{dest}\b", sources):
            unread.append(f"{action.option_strings[0]} (config field {dest} never read)")
    assert not unread, unread


def test_the_read_check_can_fail():
    """A field nobody reads is caught by the same search."""
    assert not re.search(r"\.log_bubble_ratio_never_read\b", _library_sources())
    assert re.search(r"\.reset_attention_mask\b", _library_sources())


def test_catalog_tables_are_consistent():
    dests = {a.dest for a in _actions()}
    flags = {f for a in _actions() for f in a.option_strings}
    assert set(flag_catalog.ALWAYS_ON) <= dests
    assert set(flag_catalog.CONSUMED_WHILE_PARSING) <= dests
    assert set(flag_catalog.READ_OUTSIDE_CONFIG) <= dests
    from megatron_chimera.model.family import FAMILIES
    from megatron_chimera.training.argument_parser import field_flags

    families = {spec.family for _, _, spec in field_flags() if spec.family}
    assert families <= set(FAMILIES)  # a family check compares config fields to their defaults
    megatron = set(flag_catalog.MEGATRON_FLAGS)
    assert len(megatron) == len(flag_catalog.MEGATRON_FLAGS)  # no duplicates
    for flag in megatron - flags:
        assert flag in flag_catalog.REFUSED, f"Megatron's {flag}: supported or give a reason"
    for flag in flag_catalog.REFUSED:
        assert flag in megatron and flag not in flags, f"stale refusal {flag}"


@pytest.mark.parametrize("flag", sorted(flag_catalog.REFUSED))
def test_refused_flags_name_themselves_and_the_reason(flag):
    with pytest.raises(ConfigError) as info:
        parse_args([*BASE, flag, "1"] if flag.startswith("--fp8-m") else [*BASE, flag],
                   world_size=1)
    assert str(info.value) == f"{flag} is not supported: {flag_catalog.REFUSED[flag]}"


def test_unknown_flags_keep_argparse_message():
    with pytest.raises(ConfigError, match="unrecognized arguments: --not-a-flag"):
        parse_args([*BASE, "--not-a-flag"], world_size=1)


@pytest.mark.parametrize("script, flags, message", [
    ("pretrain_bert", ["--reset-attention-mask"],
     "error: --reset-attention-mask applies to GPT-2 (pretrain_gpt2.py) only"),
    ("pretrain_bert", ["--eod-mask-loss"],
     "error: --eod-mask-loss applies to GPT-2 (pretrain_gpt2.py) only"),
    ("pretrain_gpt2", ["--no-whole-word-masking"],
     "error: --no-whole-word-masking applies to BERT (pretrain_bert.py) only"),
    ("pretrain_gpt2", ["--mask-prob", "0.2"],
     "error: --mask-prob applies to BERT (pretrain_bert.py) only"),
    ("pretrain_gpt2", ["--standalone-embedding-stage"],
     "error: --standalone-embedding-stage is not supported: not implemented (--partition-method "
     "parameters balances the embedding instead)"),
    ("pretrain_gpt2", ["--pipeline-model-parallel-layout", "EtL"],
     "error: --pipeline-model-parallel-layout 'EtL' holds 1 transformer layers, --num-layers "
     "is 2"),
    ("pretrain_gpt2", ["--overlap-param-gather"],
     "error: --overlap-param-gather needs --use-distributed-optimizer"),
    ("pretrain_gpt2", ["--log-memory-to-tensorboard"],
     "error: --log-memory-to-tensorboard requires --tensorboard-dir"),
])
def test_entry_scripts_reject_with_one_line(script, flags, message, capsys, monkeypatch):
    """As ``python pretrain_*.py`` runs: one ``error:`` line, exit code 2, before any process
    group or dataset exists."""
    import signal
    import sys

    from megatron_chimera.training import rank_errors

    module = importlib.import_module(script)
    from megatron_chimera.training import run_main

    # in this process: a plain SystemExit, without the exit watchdog that would end pytest
    # seconds later (errors.exit_process), and pytest's own SIGTERM handler afterwards
    monkeypatch.setattr(rank_errors, "exit_process", lambda code, immediate=False: sys.exit(code))
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    with pytest.raises(SystemExit) as info:
        run_main(lambda: module.main([*BASE, *flags]))
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [message]


@pytest.mark.parametrize("flags, message", [
    ("--use-flash-attn --no-masked-softmax-fusion", "--use-flash-attn and --no-masked-softmax"),
    ("--document-attention loop", "--document-attention loop requires --reset-attention-mask"),
    ("--reset-attention-mask --document-attention varlen",
     "--document-attention varlen has no attention dropout"),
    ("--reset-attention-mask --document-attention varlen --attention-dropout 0",
     "--document-attention varlen needs --fp16 or --bf16"),
    ("--log-timers-to-tensorboard", "--log-timers-to-tensorboard requires --tensorboard-dir"),
])
def test_contradictory_attention_and_logging_flags(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args([*BASE, *flags.split()], world_size=1)
    # and the same flags in a consistent setting parse
    if "--reset-attention-mask" in flags:
        parse_args([*BASE, *flags.split(), "--attention-dropout", "0", "--bf16"], world_size=1)
