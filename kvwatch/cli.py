"""kvwatch: catch KV-cache pages read by a request that never wrote them, and page a human.

Engine hooks write detection records to a spool; `kvwatch daemon` turns them into Prometheus
metrics, an incident journal and a status page. Every command answers --help with an example.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvspool.catalogue import DETECTOR, KIND, OTHER, ROLE
from kvwatch import __version__, assets
from kvwatch import config as configuration
from kvwatch.commands import dashboards_push, probe
from kvwatch.commands.clihelp import (
    Formatter,
    Parser,
    add_command,
    fail,
    join_negative_values,
    number,
    paint,
    use_colour,
)
from kvwatch.commands.incidents import EXPOSED_VERSION

# What `incidents` filters on: the catalogue's names ("other" is no detector or kind of its own).
DETECTORS = tuple(v for v in DETECTOR.sorted_values if v != OTHER)
KINDS = tuple(v for v in KIND.sorted_values if v != OTHER)
ROLES = ROLE.sorted_values

# -- kvwatch spool ---------------------------------------------------------------------------


def _spool(args: argparse.Namespace) -> int:
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


# -- kvwatch daemon --------------------------------------------------------------------------


def _daemon(args: argparse.Namespace) -> int:
    from kvwatch import logsetup
    from kvwatch.daemon import Daemon, DaemonError

    logsetup.configure(args.log_level, fmt=args.log_format)
    try:
        config = configuration.load(args.config)
        overrides: dict[str, object] = {}
        for key in (
            "spool_dir",
            "journal",
            "listen",
            "retention",
            "records_retention",
            "incidents_log",
            "node",
        ):
            value = getattr(args, key)
            if value is not None:
                overrides[key] = value
        for key in ("poll_interval", "idle_grace"):
            if getattr(args, key) is not None:
                overrides[key] = getattr(args, key)
        if args.no_nvml:
            overrides["nvml"] = False
        if args.allowed_user:
            overrides["allowed_users"] = args.allowed_user
        config = configuration.from_mapping(overrides, config)
        if args.log:
            config.logs = config.logs + [configuration.parse_log_flag(v) for v in args.log]
        warnings = configuration.check_retention(config, allow_short=args.allow_short_retention)
    except configuration.ConfigError as exc:
        return fail("daemon", str(exc), 2)
    import structlog

    for warning in warnings:
        structlog.get_logger("kvwatch.config").warning("config.adjusted", message=warning)
    try:
        daemon = Daemon(config)
    except DaemonError as exc:
        return fail("daemon", str(exc))
    return daemon.run()


# -- kvwatch incidents -----------------------------------------------------------------------


def parse_since(text: str, now: float, *, option: str = "--since") -> float:
    """A Unix time from a duration back from now (``1h``) or a UTC date or time (ISO 8601)."""
    try:
        return now - configuration.parse_duration(text, setting=option)
    except configuration.ConfigError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise configuration.ConfigError(
            f"{option} {text!r}: expected a duration (1h, 7d) or a UTC time "
            "(2026-11-30 or 2026-11-30T14:00:00Z)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def _choice(option: str, value: str | None, allowed: Sequence[str]) -> None:
    if value is not None and value not in allowed:
        raise configuration.ConfigError(
            f"{option}: unknown {option[2:]} {value!r}{configuration.did_you_mean(value, allowed)}"
        )


def _time_range(args: argparse.Namespace, now: float) -> tuple[float | None, float | None]:
    """``--since`` and ``--until`` as Unix times; a range that nothing can match is refused."""
    since = None if args.since is None else parse_since(args.since, now)
    until = None if args.until is None else parse_since(args.until, now, option="--until")
    if since is not None and until is not None and since >= until:
        raise configuration.ConfigError(
            f"--since {args.since} is not before --until {args.until}: nothing can match "
            "(a duration counts back from now: --since 2h --until 1h)"
        )
    return since, until


def _journal_problem(path: str) -> str | None:
    journal = Path(path)
    if not journal.exists():
        return f"no journal at {path} (give the daemon's journal path with --journal)"
    if journal.is_dir():
        return f"the journal {path} is a directory, not a journal file"
    if not os.access(journal, os.R_OK):
        return f"the journal {path} is not readable by this user (try sudo, or the kvwatch user)"
    return None


def _log_problem(path: str) -> str | None:
    from kvwatch.store.incidents_log import rotated

    log = Path(path)
    if log.is_dir():
        return f"the incidents log {path} is a directory, not a file"
    if log.exists() and not log.is_file():
        return f"the incidents log {path} is not a regular file"
    files = rotated(log)
    if not files:
        return f"no incidents log at {path} (give the daemon's incidents_log path)"
    for file in files:
        if not os.access(file, os.R_OK):
            return f"the incidents log {file} is not readable by this user (try sudo)"
    return None


def _incidents(args: argparse.Namespace) -> int:
    from kvwatch.commands import incidents as views
    from kvwatch.store import incident as incidents
    from kvwatch.store import incidents_log
    from kvwatch.store.incident import Finding
    from kvwatch.store.journal import Journal, JournalError

    now = time.time()
    try:
        since, until = _time_range(args, now)
        _choice("--detector", args.detector, DETECTORS)
        _choice("--kind", args.kind, KINDS)
    except configuration.ConfigError as exc:
        return fail("incidents", str(exc), 2)
    default = [] if args.incidents_log else [configuration.DEFAULT_JOURNAL]
    journals: list[str] = args.journal or default
    for path in journals:
        problem = _journal_problem(path)
        if problem:
            return fail("incidents", problem)
    for path in args.incidents_log or []:
        problem = _log_problem(path)
        if problem:
            return fail("incidents", problem)
    found: list[list[Finding]] = []
    for path in journals:
        try:
            journal = Journal(path, readonly=True)
            try:
                # The absolute time: a "since" given as a timestamp must not drift by the
                # query's own latency.
                found.append(journal.incidents(since=since, until=until, detector=args.detector))
            finally:
                journal.close()
        except JournalError as exc:  # it names the journal
            return fail("incidents", str(exc))
        except (sqlite3.Error, OSError) as exc:
            return fail("incidents", f"cannot read the journal {path}: {exc}")
    read = incidents_log.ReadResult()
    for path in args.incidents_log or []:
        try:
            incidents_log.read(Path(path), read)
        except OSError as exc:
            return fail("incidents", f"cannot read the incidents log {path}: {exc.strerror or exc}")
    found.append(read.rows)
    for error in read.errors[:_SHOWN_ERRORS]:
        print(f"kvwatch incidents: {error}", file=sys.stderr)
    if read.bad_files > 1 or len(read.errors) > _SHOWN_ERRORS:
        print(
            f"kvwatch incidents: {read.skipped} line(s) skipped in the incidents log(s); "
            "every other line is listed",
            file=sys.stderr,
        )
    rows = incidents.merge(found, since=since, until=until, detector=args.detector, kind=args.kind)
    grouped = incidents.group(rows)
    if args.exposed:
        view = views.exposure(grouped, since=since, until=until)
        views.render_exposure(view, sys.stdout, as_json=args.json)
    else:
        views.render(grouped, sys.stdout, as_json=args.json)
    return 1 if read.skipped else 0


# -- kvwatch ack -----------------------------------------------------------------------------


def _ack(args: argparse.Namespace) -> int:
    import getpass

    from kvwatch.store import incident as incidents
    from kvwatch.store.incidents_log import iso
    from kvwatch.store.journal import SCHEMA_VERSION, AckRow, Journal, JournalError, acknowledge

    now = time.time()
    chosen = [args.incident is not None, bool(args.since or args.until), args.all]
    if sum(chosen) != 1:
        return fail("ack", "give one incident ID, a time range (--since/--until) or --all", 2)
    try:
        since, until = _time_range(args, now)
    except configuration.ConfigError as exc:
        return fail("ack", str(exc), 2)
    if args.incident is not None and args.incident < 1:
        return fail("ack", f"incident id {args.incident}: expected a positive whole number", 2)
    path = args.journal or configuration.DEFAULT_JOURNAL
    problem = _journal_problem(path)
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
        upto = int(reader.scalar("SELECT coalesce(max(id), 0) FROM incidents"))
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


#: Skipped log lines named one by one; the rest are counted.
_SHOWN_ERRORS = 20


# -- kvwatch check-logs ----------------------------------------------------------------------


def _check_logs(args: argparse.Namespace) -> int:
    from kvwatch.commands import check_logs as checklogs

    rows = checklogs.check_files(args.files, role=args.role)
    checklogs.render(rows, sys.stdout, as_json=args.json)
    return checklogs.exit_status(rows)


# -- kvwatch export --------------------------------------------------------------------------


def _export(args: argparse.Namespace) -> int:
    try:
        written = assets.export(args.kind, Path(args.directory), force=args.force)
    except assets.AssetError as exc:
        return fail("export", str(exc))
    except OSError as exc:
        return fail("export", f"cannot write to {args.directory}: {exc.strerror or exc}")
    for path in written:
        print(path)
    return 0


# -- kvwatch status --------------------------------------------------------------------------

STATUS_EXIT = {"ok": 0, "warning": 3, "alarm": 4}


#: The longest ``status --timeout`` (seconds): a health check that waits longer is stuck.
STATUS_MAX_TIMEOUT = 3600.0


def status_url(args: argparse.Namespace) -> str:
    if args.url:
        return _daemon_url(str(args.url))
    listen = configuration.load(args.config).listen if args.config else configuration.DEFAULT_LISTEN
    host, port = configuration.parse_listen(listen)
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"  # every interface includes loopback
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def _daemon_url(text: str) -> str:
    """``--url``: an http(s) URL, or the daemon's ``HOST:PORT`` (its listen setting), as
    http."""
    url = text.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise configuration.ConfigError(
            f"--url {text!r}: expected HOST:PORT or an http(s) URL "
            f"(e.g. 127.0.0.1:{configuration.DEFAULT_PORT} or "
            f"https://10.0.0.7:{configuration.DEFAULT_PORT})"
        )
    return url


def _status(args: argparse.Namespace) -> int:
    def error(message: str, code: int) -> int:
        if args.json:  # a machine reading --json gets JSON, whatever went wrong
            print(json.dumps({"error": message, "exit_code": code}, sort_keys=True))
        return fail("status", message, code)

    try:
        url = status_url(args)
    except configuration.ConfigError as exc:
        return error(str(exc), 2)
    request = urllib.request.Request(url + "/", headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as reply:
            summary: dict[str, Any] = json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return error(f"the daemon at {url} answered HTTP {exc.code}", 1)
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return error(
            f"no kvwatch daemon answers at {url} ({reason}); is it running? "
            "(systemctl status kvwatch)",
            1,
        )
    except ValueError:
        return error(f"{url} did not answer with kvwatch's status JSON", 1)
    if args.json:
        print(json.dumps(summary, sort_keys=True, indent=2))
    else:
        colour = use_colour(sys.stdout, args.color)
        print(paint(summary["headline"], summary["level"], colour))
        for check in summary["checks"]:
            mark = {"ok": "ok  ", "warning": "WARN", "alarm": "ALRM"}[check["level"]]
            print(f"  {paint(mark, check['level'], colour)}  {check['name']:<12} {check['line']}")
    return STATUS_EXIT.get(summary["level"], 1)


# -- the parser ------------------------------------------------------------------------------


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
    spool.set_defaults(func=_spool)

    _add_daemon(commands)

    inc = add_command(
        commands,
        "incidents",
        help="list the requests a detector flagged, or whose KV they received (--exposed)",
        description="The affected requests, for the disclosure team: time, node, role, engine, "
        "request id, detector, kind, exposed sources and pages. Reads the journal without "
        "locking the daemon out. Several journals (--journal, repeated) and incidents logs "
        "(--incidents-log, rotated files included) merge into one fleet-wide list; an incident "
        "in both a journal and a log is listed once. --exposed prints the disclosure view: "
        "every request that received other requests' KV (readers), every request whose KV was "
        "received (sources), and the pages. Exit 1 when a log line could not be read (the "
        "others are listed).",
        examples=[
            "kvwatch incidents --since 24h --detector canary",
            "kvwatch incidents --exposed --since 2026-11-30T00:00:00Z --until 2026-12-01",
            "kvwatch incidents --exposed --json --incidents-log /srv/fleet/node-*.jsonl "
            "> disclosure.json",
            "kvwatch incidents --journal node-a.db --journal node-b.db --since 7d",
        ],
    )
    inc.add_argument(
        "--journal",
        action="append",
        metavar="FILE",
        help="a daemon's SQLite journal, repeatable "
        f"(default: {configuration.DEFAULT_JOURNAL} when no --incidents-log is given)",
    )
    inc.add_argument(
        "--incidents-log",
        dest="incidents_log",
        action="append",
        metavar="FILE",
        help="a daemon's incidents log (JSON lines; FILE.1, FILE.2 ... are read too), repeatable",
    )
    inc.add_argument(
        "--since",
        metavar="WHEN",
        help="only incidents since then: a duration back from now (1h, 7d) or a UTC time "
        "(2026-11-30T14:00:00Z) (default: all)",
    )
    inc.add_argument(
        "--until",
        metavar="WHEN",
        help="only incidents before then, as --since (default: now)",
    )
    inc.add_argument(
        "--detector",
        help=f"only this detector: {', '.join(sorted(DETECTORS))} (default: all)",
    )
    inc.add_argument("--kind", help=f"only this kind: {', '.join(sorted(KINDS))} (default: all)")
    inc.add_argument(
        "--exposed",
        action="store_true",
        help="the disclosure view: readers, the sources whose KV they received, pages, counts",
    )
    inc.add_argument(
        "--json",
        action="store_true",
        help="JSON for machines: an array of incidents, or with --exposed the disclosure view "
        f"(format v{EXPOSED_VERSION}, docs/architecture.md)",
    )
    inc.set_defaults(func=_incidents)

    check = add_command(
        commands,
        "check-logs",
        help="gate a deploy on KV pool >= context length on every node (exit 1 if not)",
        description="Read engine start-up logs and print, per node and role, the KV pool, the "
        "context length and the unsafe band between them. Exit 0: no band; 1: a band; 2: a "
        "file without a start-up line, or unreadable.",
        examples=[
            "kvwatch check-logs /var/log/sglang/prefill.log /var/log/sglang/decode.log",
            "kubectl logs deploy/decode | kvwatch check-logs --role decode -",
        ],
    )
    check.add_argument("files", nargs="+", metavar="FILE", help="engine logs ('-' for stdin)")
    check.add_argument(
        "--role",
        choices=sorted(ROLES),
        help="role for lines without a 'prefill:'/'decode:' prefix (default: from the file name)",
    )
    check.add_argument("--json", action="store_true", help="a JSON array, for machines")
    check.set_defaults(func=_check_logs)

    status = add_command(
        commands,
        "status",
        help="this node's verdict from the running daemon, in the terminal",
        description="The status page's summary: the headline (the worst of integrity, spool "
        "access, unsafe band, coverage and freshness) and one line per check. Exit 0 ok, 3 "
        "warning, 4 alarm, 1 when no daemon answers (with --json, an object with the error), "
        "2 for a usage error. The integrity alarm counts affected requests (incidents) until "
        "each is acknowledged (kvwatch ack) or its last finding is older than the daemon's "
        "alarm_window (unless alarm_until_ack is set).",
        examples=["kvwatch status", "kvwatch status --url 10.0.0.7:29321 --json"],
    )
    status.add_argument(
        "--url",
        help="the daemon's HOST:PORT (its listen setting) or an http(s) URL (default: from "
        f"--config's listen, else "
        f"{configuration.DEFAULT_LISTEN})",
    )
    status.add_argument("--config", help="the daemon's TOML config, to find its listen address")
    status.add_argument("--json", action="store_true", help="the summary as JSON")
    status.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="colour the verdict; auto: on a terminal, unless NO_COLOR is set",
    )
    status.add_argument(
        "--timeout",
        type=number(0, STATUS_MAX_TIMEOUT, above=True, unit="s"),
        default=5.0,
        help="seconds to wait for the daemon",
    )
    status.set_defaults(func=_status)

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
    ack.set_defaults(func=_ack)

    export = add_command(
        commands,
        "export",
        help="write the dashboards, alert rules or deploy files installed with kvwatch",
        description="Copy files that ship in the kvwatch package into a folder:\n"
        + "\n".join(f"  {k:<15} {v}" for k, v in assets.DESCRIPTIONS.items()),
        examples=[
            "kvwatch export rules /etc/prometheus/rules/kvwatch",
            "kvwatch export dashboards ./grafana-dashboards",
            "kvwatch export deploy /tmp/kvwatch-deploy",
        ],
    )
    export.add_argument("kind", choices=sorted(assets.KINDS), help="what to write")
    export.add_argument("directory", metavar="DIR", help="the folder to write into (created)")
    export.add_argument("--force", action="store_true", help="overwrite files already there")
    export.set_defaults(func=_export)

    probe.add_parser(commands)
    dashboards_push.add_parser(commands)
    return parser


def _add_daemon(commands: Any) -> None:
    d = add_command(
        commands,
        "daemon",
        help="read the spool, engine logs and NVML; keep the journal; serve /metrics",
        description="The per-node daemon. Settings come from --config (TOML), flags override "
        "them. HTTP: /metrics, / (status page), /-/healthy, /-/ready. Logs go to stderr: "
        "coloured lines on a terminal, JSON lines otherwise. SIGTERM/SIGINT stop it after the "
        "batch in hand is committed; SIGHUP is logged and ignored (restart to apply a config "
        "change). One daemon per journal and per spool folder.",
        examples=[
            "kvwatch daemon --config /etc/kvwatch/kvwatch.toml",
            "kvwatch daemon --spool-dir /run/kvwatch/spool --listen :29321 "
            "--log prefill:sglang:/var/log/sglang/prefill.log",
        ],
    )
    d.add_argument("--config", metavar="FILE", help="TOML settings file (default: none)")
    d.add_argument(
        "--spool-dir",
        dest="spool_dir",
        metavar="DIR",
        help=f"where the engine hooks write (default: {configuration.DEFAULT_SPOOL_DIR})",
    )
    d.add_argument(
        "--journal",
        metavar="FILE",
        help="SQLite incident journal, on persistent disk "
        f"(default: {configuration.DEFAULT_JOURNAL})",
    )
    d.add_argument(
        "--incidents-log",
        dest="incidents_log",
        metavar="FILE",
        help="append every incident as a JSON line here, for a log shipper; 'off' for none "
        f"(default: {configuration.INCIDENTS_LOG_NAME} beside the journal)",
    )
    d.add_argument(
        "--node",
        metavar="NAME",
        help="this node's name in the journal, incidents, status and pages: the same as the "
        "node label Prometheus gives this target (default: the config's node, else the host "
        "name; on Kubernetes, the pod's spec.nodeName)",
    )
    d.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help=f"HTTP address; :PORT means every interface (default: {configuration.DEFAULT_LISTEN})",
    )
    d.add_argument(
        "--log",
        action="append",
        metavar="ROLE:ENGINE:PATH",
        help="an engine log to watch, repeatable; ROLE is one of "
        f"{', '.join(configuration.LOG_ROLES)}, ENGINE one of "
        f"{', '.join(configuration.LOG_ENGINES)}; ROLE:PATH and an absolute PATH also work "
        "(default: none)",
    )
    d.add_argument("--no-nvml", action="store_true", help="do not read GPU memory through NVML")
    d.add_argument(
        "--retention",
        metavar="DURATION",
        help="keep incidents, rejects and gaps this long, with a unit: 30d, 12h (default: 30d)",
    )
    d.add_argument(
        "--records-retention",
        dest="records_retention",
        metavar="DURATION",
        help="keep per-record accounting rows this long, with a unit (default: 2d)",
    )
    d.add_argument(
        "--allow-short-retention",
        action="store_true",
        help="accept a retention under one hour (otherwise refused as a likely unit mistake)",
    )
    d.add_argument(
        "--poll-interval",
        dest="poll_interval",
        metavar="DURATION",
        help="time between spool polls, with a unit, e.g. 250ms (default: 250ms)",
    )
    d.add_argument(
        "--idle-grace",
        dest="idle_grace",
        metavar="DURATION",
        help="how long a silent producer's unlocked segment waits before it counts as abandoned,"
        " with a unit (default: 5s)",
    )
    d.add_argument(
        "--allowed-user",
        action="append",
        metavar="USER",
        help="user name or uid allowed to own spool segments, repeatable "
        "(default: the daemon's own user; members of the spool folder's group are allowed "
        "when that group may write it)",
    )
    from kvwatch.logsetup import FORMATS, LEVELS

    d.add_argument("--log-level", choices=LEVELS, default="info", help="least severe log level")
    d.add_argument(
        "--log-format",
        choices=FORMATS,
        default="auto",
        help="auto: coloured human-readable lines on a terminal, JSON lines otherwise",
    )
    d.set_defaults(func=_daemon)


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
