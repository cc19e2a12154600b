"""kvwatch: catch KV-cache pages read by a request that never wrote them, and page a human.

Engine hooks write detection records to a spool; `kvwatch daemon` turns them into Prometheus
metrics, an incident journal and a status page. Every command answers --help with an example.
"""

# Each command is a module of kvwatch.commands with add_parser() and run(); main() wires them.
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from kvwatch import __version__
from kvwatch.commands import (
    ack,
    check_config,
    check_logs,
    daemon,
    dashboards_push,
    export,
    incidents,
    init,
    probe,
    spool,
    status,
)
from kvwatch.commands.clihelp import Formatter, Parser, join_negative_values

#: The commands, in the order --help lists them: each module's add_parser() and run().
COMMANDS: tuple[ModuleType, ...] = (
    init, spool, daemon, check_config, incidents, check_logs, status, ack, export, probe,
    dashboards_push,
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kvwatch",
        description=__doc__,
        formatter_class=Formatter,
        epilog=(
            "examples:\n  kvwatch daemon --config /etc/kvwatch/kvwatch.toml\n"
            "  kvwatch status\n  kvwatch incidents --since 1h\n"
            "  kvwatch export rules /etc/prometheus/rules/"
        ),
    )
    parser.add_argument("--version", action="version", version=f"kvwatch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for command in COMMANDS:
        command.add_parser(commands).set_defaults(func=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(
        join_negative_values(parser, sys.argv[1:] if argv is None else argv)
    )
    if extra:
        # argparse reports a subcommand's unknown option with the top-level usage; name the
        # subcommand whose option it is not.
        target: argparse.ArgumentParser = getattr(args, "_parser", parser)
        target.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        result: int = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # `kvwatch spool DIR | head -1`: the reader left; not an error worth a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        return 130
    return result


if __name__ == "__main__":
    sys.exit(main())
