"""Every command's help: a description, an example, and every option's meaning and default."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from kvwatch.cli import build_parser
from tests.kvwatch.daemonproc import REPO


def commands() -> dict[str, argparse.ArgumentParser]:
    """Every leaf command, by its words (``daemon``, ``dashboards push``, ...)."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(words: str, parser: argparse.ArgumentParser) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            found[words] = parser
        for action in subs:
            for name, child in action.choices.items():
                walk(f"{words} {name}".strip(), child)

    walk("", build_parser())
    return found


COMMANDS = commands()


def test_every_command_is_covered() -> None:
    assert set(COMMANDS) == {
        "init", "spool", "daemon", "check-config", "incidents", "check-logs", "status", "ack",
        "export", "probe", "dashboards push",
    }  # fmt: skip


@pytest.mark.parametrize("words", sorted(COMMANDS))
def test_help_has_meaning_default_and_example(words: str) -> None:
    parser = COMMANDS[words]
    assert parser.description and "``" not in parser.description, "raw RST in the description"
    assert parser.epilog and parser.epilog.startswith(("example:", "examples:"))
    assert f"kvwatch {words}" in parser.epilog
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help, f"{words}: {name} has no help"
        shown_default = action.default not in (None, False, argparse.SUPPRESS)
        if shown_default and action.option_strings:
            assert re.search(rf"default:? {re.escape(str(action.default))}", text), (words, name)


@pytest.mark.parametrize("words", sorted(COMMANDS))
def test_help_runs(words: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvwatch.cli", *words.split(), "--help"],
        cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0 and result.stdout.startswith(f"usage: kvwatch {words}")


def test_daemon_help_states_the_defaults_that_come_from_config() -> None:
    text = COMMANDS["daemon"].format_help()
    shown = (
        "default: 30d", "default: 2d", "default: 250ms", "default: 5s", "default: 127.0.0.1:29321",
        "default: /run/kvwatch/spool", ":PORT means every interface", "SIGHUP",
        "default: incidents.jsonl beside the journal",
    )  # fmt: skip
    for words in shown:
        assert words in " ".join(text.split()), words


def test_incidents_help_names_the_fleet_and_disclosure_options() -> None:
    text = " ".join(COMMANDS["incidents"].format_help().split())
    for words in (
        "--journal FILE", "repeatable", "--incidents-log FILE", "FILE.1, FILE.2", "--until WHEN",
        "--exposed", "the disclosure view", "format v2", "listed once",
    ):  # fmt: skip
        assert words in text, words
