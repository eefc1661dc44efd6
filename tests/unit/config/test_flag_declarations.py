"""Every training flag is declared once, on its configuration field: the parser's default is the
field's (or None for a required or derived flag), the destination is the field, no flag is
declared twice, and the ``--help`` order follows the declarations."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from megatron_chimera.config import flag
from megatron_chimera.training import argument_parser
from megatron_chimera.training.argument_parser import _Entry, _help_order, build_parser, field_flags


def _actions_by_flag() -> dict[str, argparse.Action]:
    return {name: action for action in build_parser()._actions  # noqa: SLF001
            for name in action.option_strings}


def test_parser_defaults_are_the_field_defaults():
    actions = _actions_by_flag()
    differ = []
    for section, f, spec in field_flags():
        action = actions[spec.name]
        assert action.dest == f.name, (spec.name, action.dest)
        expected = None if spec.required or spec.derived else f.default
        if action.default != expected:
            differ.append(f"{section.__name__}.{f.name}: parser {action.default!r}, "
                          f"field {f.default!r}")
    assert not differ, differ


def test_the_default_check_can_fail(monkeypatch):
    """A flag whose parser default drifted from its field is caught by the same comparison."""
    section, f, spec = next(iter(field_flags()))
    drifted = dataclasses.replace(spec, derived=True)  # parser default None, field default 2
    group = argparse.ArgumentParser().add_argument_group("g")
    drifted.add_to(group, f.name, f.default)
    assert group._group_actions[0].default != f.default  # noqa: SLF001


def test_switches_follow_the_field_default():
    actions = _actions_by_flag()
    for _, f, spec in field_flags():
        if isinstance(f.default, bool):
            action = actions[spec.name]
            assert action.nargs == 0 and action.default is f.default, spec.name
            assert action.const is (not f.default), spec.name


def test_no_flag_is_declared_twice_and_every_flag_has_help():
    names = [n for a in build_parser()._actions for n in a.option_strings]  # noqa: SLF001
    assert len(names) == len(set(names))
    assert all(spec.help for _, _, spec in field_flags())


def test_required_flags_have_no_parser_default_and_are_reported(tmp_path):
    from megatron_chimera.config import ConfigError
    from megatron_chimera.training.arguments import parse_args

    required = [spec.name for _, _, spec in field_flags() if spec.required]
    assert required == ["--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                        "--micro-batch-size", "--lr"]
    with pytest.raises(ConfigError, match="^--num-layers is required$"):
        parse_args(["--lr", "1"], world_size=1)


def _entry(name: str, section: type | None, after: str | None = None) -> _Entry:
    return _Entry("g", after, (name,), section, lambda g: None)


def test_help_order_follows_anchors_then_the_section():
    a, b = type("A", (), {}), type("B", (), {})
    entries = [_entry("--a1", a), _entry("--a2", a), _entry("--a3", a, after="--b2"),
               _entry("--b1", b, after="--a1"), _entry("--b2", b), _entry("--h", None, "--a2")]
    order = [e.names[0] for e in _help_order(entries)]
    # b1 follows a1 (and b2 follows b1) before a1's section successor a2; a3 follows b2
    assert order == ["--a1", "--b1", "--b2", "--a3", "--a2", "--h"]


def test_an_anchor_outside_the_group_is_refused():
    with pytest.raises(AssertionError, match="--x follows --nope"):
        _help_order([_entry("--x", None, after="--nope")])


def test_a_new_field_flag_needs_only_its_declaration(monkeypatch):
    """Adding a flag is one edit: a field declared with ``flag`` appears in the parser, is parsed
    into its field, and is range-checked."""
    from megatron_chimera.config import ConfigError, LoggingConfig
    from megatron_chimera.config.flag import positive

    @dataclasses.dataclass(frozen=True)
    class Extra(LoggingConfig):
        log_every_new_thing: int = flag(7, "--log-every-new-thing", check=positive,
                                        help="a flag added by one declaration")

    sections = tuple(Extra if s is LoggingConfig else s
                     for s in argument_parser.FLAG_SECTIONS)
    monkeypatch.setattr(argument_parser, "FLAG_SECTIONS", sections)
    parser = build_parser()
    assert parser.parse_args([]).log_every_new_thing == 7
    assert parser.parse_args(["--log-every-new-thing", "3"]).log_every_new_thing == 3
    from megatron_chimera.training import arguments
    args = parser.parse_args(["--log-every-new-thing", "0"])
    with pytest.raises(ConfigError, match="--log-every-new-thing must be positive, got 0"):
        arguments._check_values(args)  # noqa: SLF001
