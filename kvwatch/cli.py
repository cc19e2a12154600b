"""The ``kvwatch`` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import kvspool
from kvwatch import __version__


def _spool(args: argparse.Namespace) -> int:
    contents = kvspool.read_spool(args.directory)
    for record in contents.records:
        if args.events and record["type"] != "event":
            continue
        print(json.dumps(record, sort_keys=True))
    for reason, count in sorted(contents.errors.items()):
        print(f"kvwatch: {count} unreadable frame(s) in the spool: {reason}", file=sys.stderr)
    return 1 if contents.errors else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvwatch", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvwatch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    spool = commands.add_parser("spool", help="print the records in a spool directory as JSON")
    spool.add_argument("directory")
    spool.add_argument("--events", action="store_true", help="detection events only")
    spool.set_defaults(func=_spool)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
