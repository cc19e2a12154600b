"""``kvwatch spool``: the records in a spool folder, as JSON lines."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from kvwatch.commands.clihelp import add_command, fail


def run(args: argparse.Namespace) -> int:
    import kvspool

    if not os.path.isdir(args.directory):
        what = "is not a folder" if os.path.exists(args.directory) else "does not exist"
        return fail("spool", f"{args.directory} {what} (give the daemon's spool_dir)")
    try:
        contents = kvspool.read_spool(args.directory)
    except OSError as exc:
        return fail("spool", f"cannot read {args.directory}: {exc.strerror or exc}")
    for record in contents.records:
        if args.events and record["type"] != "event":
            continue
        print(json.dumps(record, sort_keys=True))
    for reason, count in sorted(contents.errors.items()):
        print(f"kvwatch: {count} unreadable frame(s) in the spool: {reason}", file=sys.stderr)
    return 1 if contents.errors else 0


def add_parser(commands: Any) -> argparse.ArgumentParser:
    spool = add_command(
        commands,
        "spool",
        help="print the records in a spool folder as JSON lines",
        description="Decode every spool segment in a folder and print its records, one JSON "
        "object a line. Exit 1 when a frame cannot be read.",
        examples=["kvwatch spool /run/kvwatch/spool --events | head"],
    )
    spool.add_argument("directory", metavar="DIR", help="the spool folder (the daemon's spool_dir)")
    spool.add_argument("--events", action="store_true", help="only detection events")

    return spool
