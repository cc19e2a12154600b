"""kvwatch: catch KV-cache pages read by requests that never wrote them, and page a human."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import kvspool
from kvwatch import __version__, dashboards_push, probe
from kvwatch import config as configuration


def _spool(args: argparse.Namespace) -> int:
    contents = kvspool.read_spool(args.directory)
    for record in contents.records:
        if args.events and record["type"] != "event":
            continue
        print(json.dumps(record, sort_keys=True))
    for reason, count in sorted(contents.errors.items()):
        print(f"kvwatch: {count} unreadable frame(s) in the spool: {reason}", file=sys.stderr)
    return 1 if contents.errors else 0


def _daemon(args: argparse.Namespace) -> int:
    import sqlite3

    from kvwatch import logsetup
    from kvwatch.daemon import Daemon
    from kvwatch.journal import JournalError

    logsetup.configure(args.log_level)
    try:
        config = configuration.load(args.config)
        overrides: dict[str, object] = {}
        for key in ("spool_dir", "journal", "listen", "retention", "records_retention"):
            value = getattr(args, key)
            if value is not None:
                overrides[key] = value
        if args.poll_interval is not None:
            overrides["poll_interval"] = args.poll_interval
        if args.idle_grace is not None:
            overrides["idle_grace"] = args.idle_grace
        if args.no_nvml:
            overrides["nvml"] = False
        if args.allowed_user:
            overrides["allowed_users"] = args.allowed_user
        config = configuration.from_mapping(overrides, config)
        if args.log:
            config.logs = config.logs + [configuration.parse_log_flag(v) for v in args.log]
        daemon = Daemon(config)
    except (configuration.ConfigError, JournalError, OSError, sqlite3.Error) as exc:
        print(f"kvwatch daemon: {exc}", file=sys.stderr)
        return 2
    return daemon.run()


def _incidents(args: argparse.Namespace) -> int:
    from kvwatch import incidents
    from kvwatch.journal import Journal, JournalError

    try:
        since = None if args.since is None else configuration.parse_duration(args.since)
        journal = Journal(args.journal, readonly=True)
    except (configuration.ConfigError, JournalError) as exc:
        print(f"kvwatch incidents: {exc}", file=sys.stderr)
        return 2
    try:
        rows = incidents.query(journal, since_seconds=since, detector=args.detector)
    finally:
        journal.close()
    incidents.render(rows, sys.stdout, as_json=args.json)
    return 0


def _check_logs(args: argparse.Namespace) -> int:
    from kvwatch import checklogs

    rows = checklogs.check_files(args.files, role=args.role)
    checklogs.render(rows, sys.stdout, as_json=args.json)
    return checklogs.exit_status(rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvwatch", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvwatch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    spool = commands.add_parser("spool", help="print the records in a spool directory as JSON")
    spool.add_argument("directory")
    spool.add_argument("--events", action="store_true", help="detection events only")
    spool.set_defaults(func=_spool)

    daemon = commands.add_parser(
        "daemon", help="read the spool, engine logs and NVML; keep the journal; serve /metrics"
    )
    daemon.add_argument("--config", help="TOML file (flags override it)")
    daemon.add_argument("--spool-dir", dest="spool_dir")
    daemon.add_argument("--journal", help="SQLite journal path")
    daemon.add_argument(
        "--listen", help=f"HOST:PORT for /metrics (default {configuration.DEFAULT_LISTEN})"
    )
    daemon.add_argument(
        "--log",
        action="append",
        metavar="ROLE:ENGINE:PATH",
        help="an engine log to watch (repeatable); ROLE:PATH and PATH also work",
    )
    daemon.add_argument("--no-nvml", action="store_true", help="do not read GPU memory")
    daemon.add_argument("--retention", help="keep incidents this long (default 30d)")
    daemon.add_argument("--records-retention", dest="records_retention")
    daemon.add_argument("--poll-interval", dest="poll_interval", type=float)
    daemon.add_argument("--idle-grace", dest="idle_grace", type=float)
    daemon.add_argument(
        "--allowed-user", action="append", help="user (or uid) allowed to own spool segments"
    )
    daemon.add_argument("--log-level", default="info")
    daemon.set_defaults(func=_daemon)

    incidents = commands.add_parser("incidents", help="list the requests detectors flagged")
    incidents.add_argument("--journal", default=configuration.DEFAULT_JOURNAL)
    incidents.add_argument("--since", help="only the last DURATION (e.g. 1h, 7d)")
    incidents.add_argument("--detector", help="only this detector (canary, checksum, ...)")
    incidents.add_argument("--json", action="store_true", help="a JSON array, for machines")
    incidents.set_defaults(func=_incidents)

    check = commands.add_parser(
        "check-logs",
        help="gate a deploy on KV pool >= context length on every node (exit 1 if not)",
    )
    check.add_argument("files", nargs="+", metavar="FILE", help="engine logs ('-' for stdin)")
    check.add_argument(
        "--role", help="role for lines without a 'prefill:'/'decode:' prefix (default: from name)"
    )
    check.add_argument("--json", action="store_true")
    check.set_defaults(func=_check_logs)
    probe.add_parser(commands)
    dashboards_push.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
