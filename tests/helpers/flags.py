"""Command-line flag lists in tests."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def without_flags(flags: Sequence[str], names: Collection[str]) -> list[str]:
    """``flags`` less every flag in ``names`` and the value that follows it."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in names:
            skip = True
        else:
            out.append(flag)
    return out
