"""One clear line per user-facing error: the exception types, their one-line form, the tools' main.

A :class:`UserError` (a bad flag, a missing or corrupt file, bad data, an unwritable directory)
is reported as one line ``error: <message>`` and a non-zero exit code, without a traceback; any
other exception is a bug and keeps its traceback. ``--debug-tracebacks`` on the command line, or
``MEGATRON_CHIMERA_TRACEBACKS=1`` in the environment, shows the traceback of every error.

Torch-free (base layer): the tools use :func:`run_tool`; the entry scripts use the rank-aware
``megatron_chimera.training.rank_errors.run_main`` built on these pieces.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn

DEBUG_FLAG = "--debug-tracebacks"
DEBUG_ENV = "MEGATRON_CHIMERA_TRACEBACKS"
INTERRUPTED_EXIT_CODE = 130
EXIT_GRACE_SECONDS = 10.0  # interpreter shutdown may take this long before the exit is forced


class UserError(Exception):
    """A problem with the user's input or environment; the message names it (flag, file, rank).

    ``exit_code`` is the process exit status when it ends the program.
    """

    exit_code = 1


class ConfigError(UserError, ValueError):
    """An inconsistent or invalid setting; the message names the offending flag (exit code 2)."""

    exit_code = 2


class InputFileError(UserError, ValueError):
    """Unusable content in an input file (text, JSON, tokens); the message names file and line."""


class UsageError(UserError):
    """A bad command line of a tool (argparse's complaint, as one line)."""

    exit_code = 2


class ScheduleError(ValueError):
    """A schedule that is malformed, incomplete or would deadlock (``schedules.validate``)."""


class StoppedByPeer(Exception):
    """This rank stops because rank ``rank`` found a problem (and reports it itself)."""

    def __init__(self, rank: int, what: str = "") -> None:
        self.rank = rank
        self.what = what
        super().__init__(f"rank {rank} {what or 'failed'}")


class ToolArgumentParser(argparse.ArgumentParser):
    """argparse that raises :class:`UsageError` (one line) instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        raise UsageError(f"{message} (see {self.prog} --help)")


def tracebacks_requested(argv: list[str] | None = None) -> bool:
    """True when ``--debug-tracebacks`` is in ``argv`` (default ``sys.argv``) or the env var is
    set to a non-empty value other than ``0``."""
    argv = sys.argv if argv is None else argv
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "0") not in ("", "0")


def user_error_in(exc: BaseException) -> BaseException | None:
    """The user-facing error behind ``exc`` (itself, or along its cause/context chain), or None.

    User-facing: :class:`UserError`, and ``OSError`` (a missing file, a permission, a full disk:
    its message names the file).
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (UserError, OSError)):
            return current
        current = current.__cause__ or current.__context__
    return None


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` as one line (its lines joined), or its type name when empty."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return text or type(exc).__name__


def exit_code_of(exc: BaseException) -> int:
    """Exit status for an exception ending the program (2 for usage/config errors, 130 for ^C)."""
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED_EXIT_CODE
    return int(getattr(exc, "exit_code", 1))


def print_error(exc: BaseException, suffix: str = "", debug: bool | None = None) -> int:
    """Report ``exc`` on stderr and return the exit code: one ``error:`` line for a user error
    (plus the traceback with debugging on), the traceback and the line for anything else."""
    debug = tracebacks_requested() if debug is None else debug
    user = user_error_in(exc)
    if debug or user is None:
        traceback.print_exception(exc, file=sys.stderr)
    shown = user if user is not None else exc
    print(f"error: {one_line(shown)}{suffix}", file=sys.stderr, flush=True)
    return exit_code_of(shown)


def exit_process(code: int, immediate: bool = False) -> NoReturn:
    """End the process with ``code``: at once (``os._exit`` after flushing; for Ctrl-C, when
    helper threads or processes may be wedged), or by ``sys.exit`` guarded by a watchdog that
    forces the exit if shutdown hangs (a pool's or a collective's threads) for
    :data:`EXIT_GRACE_SECONDS`."""
    if immediate:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    timer = threading.Timer(EXIT_GRACE_SECONDS, os._exit, (code,))
    timer.daemon = True
    timer.start()
    sys.exit(code)


def _strip_debug_flag() -> None:
    while DEBUG_FLAG in sys.argv:
        sys.argv.remove(DEBUG_FLAG)


def run_tool(main: Callable[[], int | None]) -> NoReturn:
    """Run a tool's ``main`` and exit: user errors become one ``error:`` line (exit 1, or 2 for a
    bad command line), ``SystemExit("message")`` too, Ctrl-C prints ``interrupted`` and exits
    130 at once. ``--debug-tracebacks`` is taken out of ``sys.argv`` before ``main`` parses it.
    """
    debug = tracebacks_requested()
    _strip_debug_flag()
    try:
        code = main()
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(f"error: {exc.code}", file=sys.stderr, flush=True)
            exit_process(1)
        raise
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print("interrupted", file=sys.stderr, flush=True)
        exit_process(INTERRUPTED_EXIT_CODE, immediate=True)
    except Exception as exc:  # noqa: BLE001 - every error ends here, reported once
        exit_process(print_error(exc, debug=debug))
    sys.exit(int(code or 0))
