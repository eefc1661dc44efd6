"""A configuration field that carries its command-line flag.

Every training flag is declared once, on the frozen dataclass field it sets: ``flag(default,
"--name", help=...)`` stores the flag's spelling, help, choices and check in the field's metadata.
The parser (:mod:`megatron_chimera.training.argument_parser`) is one loop over these fields, the
flag writer (:mod:`megatron_chimera.model.flags`) and ``docs/FLAGS.md`` read the same metadata, so
a default, a choice list or a help text exists in one place only. The schedule options do the same
through ``schedules.registry.option``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Flag", "flag", "flag_spec", "flag_fields", "positive", "non_negative", "probability"]

Check = Callable[[Any], "str | None"]  # a value's problem ("must be positive, got 0"), or None


def positive(value: float) -> str | None:
    """The value must be > 0."""
    return None if value > 0 else f"must be positive, got {value}"


def non_negative(value: float) -> str | None:
    """The value must be >= 0."""
    return None if value >= 0 else f"must be >= 0, got {value}"


def probability(value: float) -> str | None:
    """The value must lie in [0, 1) (a dropout or masking probability)."""
    return None if 0.0 <= value < 1.0 else f"must be in [0, 1), got {value}"


@dataclass(frozen=True)
class Flag:
    """How one configuration field is spelt on the command line.

    A ``bool`` field defaulting to False is a switch (``store_true``); one defaulting to True is
    turned off by its flag (``store_false``: ``--no-...``, ``--disable-...``). ``required``: the
    flag has no default on the command line (the field's default serves library code only);
    ``derived``: an absent flag is computed from others (the help says how). ``group`` None: the
    section's ``FLAG_GROUP``. ``after``: the flag that this one (and the fields after it in its
    section) follow in ``--help``, when that is not the previous field of its section. ``model``:
    part of what a model is (``model_flags`` writes it when it differs from its default);
    ``decoder``: one of today's decoder-architecture flags that tools share. ``needs``: flags that
    must accompany it when it is written. ``family``: the one model family that reads it.
    """

    name: str
    help: str
    type: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] | None = None
    nargs: int | str | None = None
    metavar: str | tuple[str, ...] | None = None
    check: Check | None = None
    required: bool = False
    derived: bool = False
    group: str | None = None
    after: str | None = None
    model: bool = False
    decoder: bool = False
    needs: tuple[str, ...] = ()
    family: str | None = None

    def add_to(self, group: Any, dest: str, default: Any) -> None:
        """Declare this flag on an argparse group, storing into ``dest``."""
        if isinstance(default, bool):
            action = "store_false" if default else "store_true"
            group.add_argument(self.name, action=action, dest=dest, help=self.help)
            return
        kwargs: dict[str, Any] = {"dest": dest, "help": self.help,
                                  "default": None if self.required or self.derived else default}
        value_type = self.type or (type(default) if default is not None else None)
        if value_type is not None and value_type is not str:
            kwargs["type"] = value_type
        for key in ("choices", "nargs", "metavar"):
            if getattr(self, key) is not None:
                kwargs[key] = getattr(self, key)
        group.add_argument(self.name, **kwargs)

    def spelled(self, value: Any, default: Any) -> list[str]:
        """The command-line words that set ``value`` (nothing for a switch at its default)."""
        if isinstance(default, bool):
            return [self.name] if value != default else []
        return [self.name, repr(value) if isinstance(value, float) else str(value)]


def flag(default: Any, name: str, *, help: str, type: Callable[[str], Any] | None = None,
         choices: Sequence[Any] | None = None, nargs: int | str | None = None,
         metavar: str | tuple[str, ...] | None = None, check: Check | None = None,
         required: bool = False, derived: bool = False, group: str | None = None,
         after: str | None = None, model: bool = False, decoder: bool = False,
         needs: tuple[str, ...] = (), family: str | None = None) -> Any:
    """A dataclass field with ``default`` whose command-line flag is ``name`` (:class:`Flag`)."""
    spec = Flag(name, help, type, tuple(choices) if choices is not None else None, nargs, metavar,
                check, required, derived, group, after, model or decoder, decoder, needs, family)
    return field(default=default, metadata={"flag": spec})


def flag_spec(f: dataclasses.Field) -> Flag | None:
    """The flag of a dataclass field, or None when it has none."""
    return f.metadata.get("flag")


def flag_fields(section: type) -> Iterator[tuple[dataclasses.Field, Flag]]:
    """(field, flag) of every field of ``section`` that has a flag, in field order, with the
    section's ``FLAG_GROUP`` filled in where the flag names none."""
    for f in dataclasses.fields(section):
        spec = flag_spec(f)
        if spec is not None:
            if spec.group is None:
                spec = dataclasses.replace(spec, group=section.FLAG_GROUP)
            yield f, spec
