"""The command line's shared parts: one-line usage errors, help that shows every default."""

from __future__ import annotations

import argparse
import os
import sys
from typing import IO, Any, NoReturn


class Parser(argparse.ArgumentParser):
    """A usage error is one line naming the command and the fault, then exit 2."""

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
