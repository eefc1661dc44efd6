"""Reading the tools' text inputs line by line, with errors that name the file and the line."""

from __future__ import annotations

from collections.abc import Iterator

from megatron_chimera.errors import InputFileError


def read_lines(path: str) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each line of ``path``, decoded as UTF-8; a line that is not
    UTF-8 is an InputFileError naming the file and the line."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputFileError(
                    f"{path}:{number}: not UTF-8 text ({e.reason} at byte {e.start} of the "
                    "line); convert the file to UTF-8") from None
