"""What every console script shares: one exit-code convention, a mistake answered in one line
(or one JSON object with ``--json``), and Ctrl-C without a traceback.

Exit codes (README states them):

- 0: done.
- 1: the card, the image or the link said no, or the result is wrong (a refused flash, a corrupt
  image, a lost link, demo output that differs from the target's).
- 2: the command line is wrong: an argument, a URL, a file that is not there.
- 130: interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from exstill_sdk.errors import BadURLError, ExstillError, InvalidArgumentError

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

_USAGE_ERRORS = (
    InvalidArgumentError,
    BadURLError,
    FileNotFoundError,
    IsADirectoryError,
    NotADirectoryError,
)


class UsageError(InvalidArgumentError):
    """A command line that cannot be carried out as written; the message says what to give."""


Subcommands = argparse._SubParsersAction
"""What a group of benchmarks registers its sub-commands on (``add_parser``)."""


class Parser(argparse.ArgumentParser):
    """argparse, with a mistake answered in one line (exit 2) instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def require_plotting(option: str) -> None:
    """Refuse ``option`` (a plot) before any work when matplotlib is not installed."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        raise UsageError(
            f"{option} needs matplotlib: pip install 'exstill-sdk[bench]' (or pip install "
            f"matplotlib), or leave {option} out"
        ) from None


def comma_numbers(option: str, text: str) -> tuple[int, ...]:
    """``1,2,4`` as whole numbers of 1 or more; a UsageError naming ``option`` otherwise."""
    try:
        numbers = tuple(int(u) for u in text.split(","))
    except ValueError:
        raise UsageError(f"{option} wants numbers separated by commas, not {text!r}") from None
    if not numbers or min(numbers) < 1:
        raise UsageError(f"{option} wants numbers of 1 or more, not {text!r}")
    return numbers


def exit_code(exc: BaseException) -> int:
    """1 for what the card, the image or the link said; 2 for a mistake in the command line."""
    return EXIT_USAGE if isinstance(exc, _USAGE_ERRORS) else EXIT_FAILED


def message_of(exc: BaseException) -> str:
    if isinstance(exc, ExstillError):
        return exc.message
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    return str(exc)


def report(prog: str, message: str, code: int, as_json: bool, error_code: int = 0) -> int:
    """Say what went wrong in one line (stderr), or as one JSON object (stdout); ``code``."""
    if as_json:
        print(json.dumps({"ok": False, "error": message, "code": error_code, "exit": code}))
    else:
        print(f"{prog}: {message}", file=sys.stderr)
    return code


def run(
    prog: str,
    as_json: bool,
    body: Callable[[], int],
    *,
    interrupted: Callable[[], str] | None = None,
    hint: Callable[[BaseException], str] | None = None,
) -> int:
    """Run a tool's body under the convention. ``interrupted()`` says how far a Ctrl-C got;
    ``hint(exc)`` adds what to do to an error's line (text output only)."""
    try:
        return body()
    except KeyboardInterrupt:
        how_far = interrupted() if interrupted is not None else ""
        return report(
            prog, "interrupted" + (f"; {how_far}" if how_far else ""), EXIT_INTERRUPTED, as_json
        )
    except (ExstillError, OSError) as exc:
        return fail(prog, exc, as_json, hint(exc) if hint is not None and not as_json else "")


def fail(prog: str, exc: BaseException, as_json: bool, hint: str = "") -> int:
    """Report an error under the convention; its exit code."""
    error_code = int(exc.code) if isinstance(exc, ExstillError) else 0
    return report(prog, message_of(exc) + hint, exit_code(exc), as_json, error_code)


def print_result(result: dict[str, Any], as_json: bool, human: Callable[[], str]) -> None:
    """One JSON object with ``--json``, else the tool's human text."""
    print(json.dumps(result) if as_json else human())


def human_text(result: dict[str, Any], indent: int = 0) -> str:
    """A nested result as aligned ``name  value`` lines, nested tables indented beneath their
    name, lists of numbers on one line: what a benchmark prints without ``--json``."""
    if not result:
        return ""
    width = max(len(str(k)) for k in result)
    pad = " " * indent
    lines = []
    for key, value in result.items():
        if isinstance(value, dict):
            lines.append(f"{pad}{key}")
            lines.append(human_text(value, indent + 2))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            lines.append(f"{pad}{key}")
            for i, item in enumerate(value):
                lines.append(f"{pad}  [{i}]")
                lines.append(human_text(item, indent + 4))
        elif isinstance(value, list | tuple):
            lines.append(f"{pad}{key:<{width}}  {' '.join(_scalar(v) for v in value)}")
        else:
            lines.append(f"{pad}{key:<{width}}  {_scalar(value)}")
    return "\n".join(line for line in lines if line)


def _scalar(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
