"""``kvwatch ack``: acknowledge incidents (the integrity alarm stops counting them)."""

from __future__ import annotations

import argparse
import os
import sqlite3
import time
from typing import Any

from kvwatch import config as configuration
from kvwatch.commands.clihelp import add_command, fail
from kvwatch.commands.common import journal_problem, time_range


def run(args: argparse.Namespace) -> int:
    import getpass

    from kvwatch.store import incident as incidents
    from kvwatch.store.incidents_log import iso
    from kvwatch.store.journal import SCHEMA_VERSION, AckRow, Journal, JournalError, acknowledge

    now = time.time()
    chosen = [args.incident is not None, bool(args.since or args.until), args.all]
    if sum(chosen) != 1:
        return fail("ack", "give one incident ID, a time range (--since/--until) or --all", 2)
    try:
        since, until = time_range(args, now)
    except configuration.ConfigError as exc:
        return fail("ack", str(exc), 2)
    if args.incident is not None and args.incident < 1:
        return fail("ack", f"incident id {args.incident}: expected a positive whole number", 2)
    path = args.journal or configuration.DEFAULT_JOURNAL
    problem = journal_problem(path, write=True)
    if problem:
        return fail("ack", problem)
    try:
        reader = Journal(path, readonly=True)
    except (JournalError, sqlite3.Error, OSError) as exc:
        return fail("ack", f"cannot read the journal {path}: {exc}")
    try:
        if reader.schema != SCHEMA_VERSION:
            return fail(
                "ack",
                f"{path}: journal schema {reader.schema}; start the daemon once to migrate it",
            )
        grouped = incidents.group(reader.incidents())
        upto = reader.newest_finding_id()
    except sqlite3.Error as exc:
        return fail("ack", f"cannot read the journal {path}: {exc}")
    finally:
        reader.close()
    if args.incident is not None:
        # An incident's id is its first finding's (the ID column of kvwatch incidents): a later
        # finding's id names no incident, and must not acknowledge the one it joined.
        found = [i for i in grouped if i["id"] == args.incident]
        if not found:
            return fail(
                "ack", f"no incident {args.incident} in {path} (the ID column of kvwatch incidents)"
            )
        ids = [i["id"] for i in found]
    else:
        ids = [
            i["id"]
            for i in grouped
            if (since is None or i["first_time"] >= since)
            and (until is None or i["first_time"] < until)
        ]
    try:
        by = args.by or getpass.getuser()
    except (KeyError, OSError):
        by = str(os.geteuid())
    ack = AckRow(now, by[:256], upto, args.incident, since, until)
    try:
        acknowledge(path, ack)
    except sqlite3.Error as exc:
        return fail("ack", f"cannot write to the journal {path}: {exc}")
    what = (
        f"incident {args.incident}"
        if args.incident is not None
        else "every incident" + ("" if args.all else " first seen in the range")
    )
    print(
        f"acknowledged {what} ({len(ids)} incident(s): {', '.join(map(str, ids[:20])) or '-'}"
        f"{', ...' if len(ids) > 20 else ''}) by {by} at {iso(now)}; a later finding "
        "raises the alarm again"
    )
    return 0


def add_parser(commands: Any) -> argparse.ArgumentParser:
    ack = add_command(
        commands,
        "ack",
        help="acknowledge incidents: the integrity alarm (status) no longer counts them",
        description="Record in the journal that incidents were seen and handled, who (the "
        "invoking user, or --by) and when. The integrity alarm of the status page and of "
        "kvwatch status stops counting them; a finding after the acknowledgement raises it "
        "again. Give one incident ID (the ID column of kvwatch incidents), a time range "
        "(incidents first seen in [--since, --until)) or --all.",
        examples=[
            "kvwatch ack 42",
            "kvwatch ack --since 2026-12-01T08:00:00Z --until 2026-12-01T09:00:00Z --by alice",
            "kvwatch ack --all --journal /var/lib/kvwatch/journal.db",
        ],
    )
    ack.add_argument("incident", nargs="?", type=int, metavar="ID", help="one incident's id")
    ack.add_argument(
        "--since", metavar="WHEN", help="incidents first seen since then: 1h, 7d or a UTC time"
    )
    ack.add_argument("--until", metavar="WHEN", help="incidents first seen before then")
    ack.add_argument("--all", action="store_true", help="every incident in the journal now")
    ack.add_argument("--by", help="who acknowledges (default: the invoking user)")
    ack.add_argument(
        "--journal",
        metavar="FILE",
        help=f"the daemon's journal (default: {configuration.DEFAULT_JOURNAL})",
    )

    return ack
