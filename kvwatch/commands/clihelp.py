"""The command line's shared parts: one-line usage errors, help that shows every default."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import IO, Any, NoReturn


class Parser(argparse.ArgumentParser):
    """A usage error is one line naming the command and the fault, then exit 2.

    No abbreviations (``allow_abbrev=False``, inherited by every subcommand's parser): ``--spool
    DIR`` was taken as ``--spool-dir`` and a mistyped flag ran the daemon on another folder.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and examples keep their lines; every option with a default shows it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "%(default)" not in text
            and "default" not in text
            and action.option_strings
            and default not in (None, False, argparse.SUPPRESS)
        ):
            text += " (default: %(default)s)"
        return text


def number(
    low: float, high: float, *, whole: bool = False, above: bool = False, unit: str = ""
) -> Callable[[str], float]:
    """An argparse ``type``: a number from ``low`` (excluded when ``above``) to ``high``."""
    lo, hi = f"{low:.15g}", f"{high:.15g}"
    span = f"(from {lo} to {hi}{unit})"

    def parse(text: str) -> float:
        try:
            value = int(text) if whole else float(text)
        except ValueError:
            what = "a whole number" if whole else "a number"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r} {span}") from None
        if above and not value > low:
            raise argparse.ArgumentTypeError(f"must be more than {lo}{unit}, got {text} {span}")
        if not (above or value >= low) or not value <= high:
            raise argparse.ArgumentTypeError(f"must be {lo} to {hi}{unit}, got {text}")
        return value

    parse.__name__ = "whole number" if whole else "number"  # argparse's "invalid <name> value"
    return parse


_NEGATIVE: re.Pattern[str] = re.compile(r"^-\.?\d")


def join_negative_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``--retention -5d`` as ``--retention=-5d``: argparse takes ``-5d`` for an option and says
    "expected one argument"; joined, the value reaches its own check and a message that names
    it. Only for options that take one value, and never after ``--``."""
    takes: set[str] = set()
    parsers = [parser]
    while parsers:
        for action in parsers.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
            elif action.option_strings and action.nargs is None:
                takes.update(action.option_strings)
    out: list[str] = []
    items = iter(argv)
    for item in items:
        if item == "--":
            out += [item, *items]
            break
        if item in takes:
            value = next(items, None)
            if value is not None and _NEGATIVE.match(value):
                out.append(f"{item}={value}")
                continue
            out.append(item)
            if value is not None:
                out.append(value)
            continue
        out.append(item)
    return out


def add_command(
    commands: Any, name: str, *, help: str, description: str, examples: list[str]
) -> Parser:
    """A subcommand with a description and an ``examples:`` epilog."""
    parser: Parser = commands.add_parser(
        name,
        help=help,
        description=description,
        epilog="examples:\n" + "\n".join(f"  {e}" for e in examples),
        formatter_class=Formatter,
    )
    parser.set_defaults(_parser=parser)
    return parser


def use_colour(stream: IO[str], choice: str = "auto") -> bool:
    """Colour on a terminal unless NO_COLOR is set (no-color.org); ``always``/``never`` win."""
    if choice != "auto":
        return choice == "always"
    return stream.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


COLOURS = {"ok": "32", "warning": "33", "alarm": "1;31", "dim": "2"}


def paint(text: str, level: str, on: bool) -> str:
    return f"\x1b[{COLOURS[level]}m{text}\x1b[0m" if on else text


def fail(command: str, message: str, code: int = 1) -> int:
    """Print one line to stderr and return ``code`` (1: runtime, 2: usage)."""
    print(f"kvwatch {command}: {' '.join(message.split())}", file=sys.stderr)
    return code
