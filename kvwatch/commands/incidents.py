"""``kvwatch incidents``: the affected requests, from journals and incidents logs, for the
disclosure team. The table, the JSON and the disclosure view (``--exposed``) of the incidents
:func:`kvwatch.store.incident.group` makes.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TextIO, TypeAlias

from kvwatch import config as configuration
from kvwatch.commands.clihelp import add_command, fail
from kvwatch.commands.common import (
    DETECTORS,
    KINDS,
    access_problem,
    choice,
    journal_problem,
    time_range,
)
from kvwatch.store import incidents_log
from kvwatch.store.incident import Finding, Incident, counts, finding_summary, source_key
from kvwatch.store.incidents_log import ReadResult, iso

if TYPE_CHECKING:
    from kvwatch.store.journal import AckRow

_COLUMNS = (
    "ID",
    "FIRST SEEN (UTC)",
    "NODE",
    "ROLE",
    "ENGINE",
    "REQUEST",
    "INSTANCE",
    "FINDINGS",
    "EXPOSED",
    "PAGES",
    "ACKED",
)
_SHOWN_PAGES = 8
#: The disclosure view's JSON format (``--exposed --json``): its ``v``. 2: a reader is an
#: incident (``findings``, ``id``); ``counts`` counts incidents, not findings, and ``exposed``.
EXPOSED_VERSION: Final = 2


#: (node, incident id) -> the acknowledgement that covers it (``kvwatch ack``).
Acked: TypeAlias = "dict[tuple[str, int | None], AckRow]"


def _ack(acked: Acked, incident: Incident) -> dict[str, object] | None:
    ack = acked.get((incident["node"], incident["id"]))
    return None if ack is None else {"by": ack.by, "time": ack.ts, "time_iso": iso(ack.ts)}


def render(
    incidents: list[Incident], out: TextIO, *, as_json: bool, acked: Acked | None = None
) -> None:
    """The incidents as a table or JSON; ``acknowledged`` (who and when, or none) from the
    journals' acknowledgements (``acked``), as the status page marks them."""
    acked = acked or {}
    if as_json:
        stamped = [
            {
                **i,
                "time_iso": iso(i["time"]),
                "last_time_iso": iso(i["last_time"]),
                "acknowledged": _ack(acked, i),
            }
            for i in incidents
        ]
        out.write(json.dumps(stamped, sort_keys=True, indent=2) + "\n")
        return
    table: list[tuple[str, ...]] = [_COLUMNS]
    for i in incidents:
        findings = ", ".join(finding_summary(f) for f in i["findings"][:_SHOWN_FINDINGS])
        if len(i["findings"]) > _SHOWN_FINDINGS:
            findings += f", +{len(i['findings']) - _SHOWN_FINDINGS} more"
        table.append(
            (
                "-" if i["id"] is None else str(i["id"]),
                iso(i["time"]),
                i["node"] or "-",
                i["role"] or "-",
                i["engine"] or "-",
                i["request_id"] or "-",
                i["instance"] or "-",
                findings,
                str(i["exposed"]),
                _pages(i),
                _acked_cell(_ack(acked, i)),
            )
        )
    _table(table, out)
    total = counts(incidents)
    out.write(  # an incident is an affected request: its count last
        f"{sum(len(i['findings']) for i in incidents)} finding(s), "
        f"{total['exposed']} exposed request(s), {total['affected']} incident(s)\n"
    )


_SHOWN_FINDINGS = 4


def _acked_cell(ack: dict[str, object] | None) -> str:
    return "-" if ack is None else f"{ack['by']} {ack['time_iso']}"


def _pages(incident: Incident) -> str:
    """The pages of the finding that named the most."""
    widest = max(incident["findings"], key=lambda f: f["pages_total"])
    pages = [str(p) for p in widest["pages"][:_SHOWN_PAGES]]
    text = ",".join(pages)
    if widest["pages_total"] > len(pages):
        text += f",... ({widest['pages_total']} pages)"
    return text or "-"


def printable(text: str) -> str:
    """``text`` safe for a terminal: each non-printable character (C0 and C1 controls, DEL,
    newlines, tabs, bidi overrides) written as ``repr`` writes it (``\\x1b``, ``\\n``).

    Ids and node names come from other nodes' logs and engines' requests: raw, they could clear
    the screen, retitle the terminal or forge rows.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _table(table: list[tuple[str, ...]], out: TextIO) -> None:
    # Every text view writes through here: each cell made printable once.
    table = [tuple(printable(c) for c in r) for r in table]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]) - 1)]
    for r in table:
        cells = [c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)]
        out.write("  ".join([*cells, r[-1]]).rstrip() + "\n")


# -- the disclosure view ----------------------------------------------------------------------


def exposure(
    incidents: list[Incident], *, since: float | None, until: float | None
) -> dict[str, Any]:
    """The disclosure view of ``incidents`` (:func:`group`; format :data:`EXPOSED_VERSION`).

    ``readers``: each incident whose request received other requests' KV, with its node, role,
    engine and instance (the reading side's), the pages its findings named (the most any one
    finding named) and its sources. ``sources``: each request whose KV was received, with the
    pages received (summed over readers) and which readers. A source is known by its request
    id and instance on the node whose pool held its KV: the reader's, or for the writer's side
    of a transfer (:func:`join_peers`) the writer's, named in the source's ``node``.
    ``unnamed_sources``: the sources a finding only counted (beyond the 16 an event names).
    Pages of one reader-source pair found by several detectors count once: the most any one
    finding named. ``counts``:
    ``incidents`` and ``exposed`` are :func:`counts`' ``affected`` and ``exposed``.
    """
    readers: list[dict[str, Any]] = []
    sources: dict[tuple[str, str, str], dict[str, Any]] = {}
    for incident in incidents:
        if not incident["sources"] and not incident["other_sources"]:
            continue
        node = incident["node"]
        reader: dict[str, Any] = {
            name: incident[name]
            for name in (
                "id", "request_id", "instance", "node", "role", "engine", "engine_version",
                "model", "producer", "detectors", "other_sources", "other_source_pages",
            )
        }  # fmt: skip
        reader["first_time"] = incident["first_time"]
        reader["last_time"] = incident["last_time"]
        reader["first_time_iso"] = iso(incident["first_time"])
        reader["last_time_iso"] = iso(incident["last_time"])
        reader["pages"] = incident["pages_total"]
        reader["findings"] = len(incident["findings"])
        if incident.get("peer"):  # the writer's request instance it was joined with
            reader["peer"] = incident["peer"]
        # A source on another node than the reader's (the writer's side of a transfer) says so.
        reader["sources"] = [
            {"request_id": s["request_id"], "instance": s["instance"], "pages": s["pages"]}
            | ({"node": s["node"]} if s.get("node") not in (None, node) else {})
            for s in incident["sources"]
        ]
        readers.append(reader)
        for source in incident["sources"]:
            held = source.get("node") or node  # a writer-side source: the writer's node
            entry = sources.setdefault(
                (held, *source_key(source)),
                {
                    "request_id": source["request_id"],
                    "instance": source["instance"],
                    "node": held,
                    "last_written": 0.0,
                    "readers": [],
                },
            )
            entry["last_written"] = max(entry["last_written"], source["written_at"])
            entry["readers"].append(
                {
                    "request_id": incident["request_id"],
                    "instance": incident["instance"],
                    "pages": source["pages"],
                }
            )
    source_list = []
    for entry in sources.values():
        entry["readers"].sort(key=lambda r: (-r["pages"], r["request_id"]))
        entry["pages"] = sum(r["pages"] for r in entry["readers"])
        source_list.append(entry)
    readers.sort(key=lambda r: (r["first_time"], r["node"], r["request_id"]))
    source_list.sort(key=lambda s: (-s["pages"], s["node"], s["request_id"]))
    unnamed = sum(r["other_sources"] for r in readers)
    unnamed_pages = sum(r["other_source_pages"] for r in readers)
    total = counts(incidents)
    return {
        "v": EXPOSED_VERSION,
        "since": since,
        "until": until,
        "readers": readers,
        "sources": source_list,
        "counts": {
            "incidents": total["affected"],
            "exposed": total["exposed"],
            "readers": len(readers),
            "sources": len(source_list),
            "unnamed_sources": unnamed,
            "unnamed_source_pages": unnamed_pages,
            "pages": sum(s["pages"] for s in source_list) + unnamed_pages,
        },
    }


def render_exposure(view: dict[str, Any], out: TextIO, *, as_json: bool) -> None:
    if as_json:
        out.write(json.dumps(view, sort_keys=True, indent=2) + "\n")
        return
    window = (
        f"{iso(view['since']) if view['since'] is not None else 'the start of the journal'}"
        f" to {iso(view['until']) if view['until'] is not None else 'now'}"
    )
    out.write(f"Exposed requests, {window}\n\n")
    out.write("READERS: requests that received other requests' KV\n")
    table: list[tuple[str, ...]] = [
        ("FIRST SEEN (UTC)", "NODE", "ROLE", "ENGINE", "REQUEST", "INSTANCE", "PAGES", "SOURCES")
    ]
    for r in view["readers"]:
        named = ", ".join(
            f"{s['request_id']}{'@' + s['node'] if 'node' in s else ''} ({s['pages']})"
            for s in r["sources"]
        )
        if r["other_sources"]:
            named += f"{', ' if named else ''}+{r['other_sources']} more"
        table.append(
            (
                r["first_time_iso"],
                r["node"] or "-",
                r["role"] or "-",
                r["engine"] or "-",
                r["request_id"],
                r["instance"] or "-",
                str(r["pages"]),
                named or "-",
            )
        )
    _table(table, out)
    out.write("\nSOURCES: requests whose KV was received\n")
    table = [("NODE", "REQUEST", "INSTANCE", "PAGES", "READERS")]
    for s in view["sources"]:
        table.append(
            (
                s["node"] or "-",
                s["request_id"],
                s["instance"] or "-",
                str(s["pages"]),
                ", ".join(f"{r['request_id']} ({r['pages']})" for r in s["readers"]),
            )
        )
    _table(table, out)
    tally = view["counts"]
    out.write(
        f"\n{tally['readers']} reader(s), {tally['sources']} named source(s)"
        f" and {tally['unnamed_sources']} unnamed, {tally['pages']} page(s) of theirs read;"
        f" {tally['incidents']} incident(s) (affected requests),"
        f" {tally['exposed']} exposed request(s)\n"
    )


# -- the command ------------------------------------------------------------------------------

#: Skipped log lines named one by one; the rest are counted.
_SHOWN_ERRORS = 20


def log_problem(path: str) -> str | None:
    from kvwatch.store.incidents_log import rotated

    problem = access_problem("the incidents log", path)
    if problem:
        return problem
    log = Path(path)
    if log.exists() and not log.is_file():
        return f"the incidents log {path} is not a regular file"
    files = rotated(log)
    if not files:
        return f"no incidents log at {path} (give the daemon's incidents_log path)"
    for file in files:
        problem = access_problem("the incidents log", str(file))
        if problem:
            return problem
    return None


class _ReadError(Exception):
    """A journal or log that cannot be read: its one-line error."""


def _from_journals(
    journals: list[str], since: float | None, until: float | None, detector: str | None
) -> tuple[list[list[Finding]], Acked]:
    from kvwatch.expose.status import acknowledgement
    from kvwatch.store import incident as incidents
    from kvwatch.store.journal import Journal, JournalError

    found: list[list[Finding]] = []
    acked: Acked = {}
    for path in journals:
        try:
            journal = Journal(path, readonly=True)
            try:
                # The absolute time: a "since" given as a timestamp must not drift by the
                # query's own latency.
                rows = journal.incidents(since=since, until=until, detector=detector)
                found.append(rows)
                # An acknowledgement is its journal's: matched to that journal's incidents.
                acks = journal.acks()
                for incident in incidents.group(rows) if acks else ():
                    ack = acknowledgement(acks, incident)
                    if ack is not None:
                        acked[(incident["node"], incident["id"])] = ack
            finally:
                journal.close()
        except JournalError as exc:  # it names the journal
            raise _ReadError(str(exc)) from None
        except (sqlite3.Error, OSError) as exc:
            raise _ReadError(f"cannot read the journal {path}: {exc}") from None
    return found, acked


def _from_logs(paths: list[str]) -> ReadResult:
    read = ReadResult()
    for path in paths:
        try:
            incidents_log.read(Path(path), read)
        except OSError as exc:
            raise _ReadError(
                f"cannot read the incidents log {path}: {exc.strerror or exc}"
            ) from None
    for error in read.errors[:_SHOWN_ERRORS]:
        print(f"kvwatch incidents: {error}", file=sys.stderr)
    if read.bad_files > 1 or len(read.errors) > _SHOWN_ERRORS:
        print(
            f"kvwatch incidents: {read.skipped} line(s) skipped in the incidents log(s); "
            "every other line is listed",
            file=sys.stderr,
        )
    return read


def _problem(journals: list[str], logs: list[str]) -> str | None:
    for path in journals:
        problem = journal_problem(path)
        if problem:
            return problem
    for path in logs:
        problem = log_problem(path)
        if problem:
            return problem
    return None


def run(args: argparse.Namespace) -> int:
    from kvwatch.store import incident as incidents

    now = time.time()
    try:
        since, until = time_range(args, now)
        choice("--detector", args.detector, DETECTORS)
        choice("--kind", args.kind, KINDS)
    except configuration.ConfigError as exc:
        return fail("incidents", str(exc), 2)
    logs: list[str] = args.incidents_log or []
    journals: list[str] = args.journal or ([] if logs else [configuration.DEFAULT_JOURNAL])
    problem = _problem(journals, logs)
    if problem:
        return fail("incidents", problem)
    try:
        found, acked = _from_journals(journals, since, until, args.detector)
        read = _from_logs(logs)
    except _ReadError as exc:
        return fail("incidents", str(exc))
    found.append(read.rows)
    rows = incidents.merge(found, since=since, until=until, detector=args.detector, kind=args.kind)
    grouped = incidents.group(rows)
    if args.exposed:
        view = exposure(grouped, since=since, until=until)
        render_exposure(view, sys.stdout, as_json=args.json)
    else:
        render(grouped, sys.stdout, as_json=args.json, acked=acked)
    return 1 if read.skipped else 0


def add_parser(commands: Any) -> argparse.ArgumentParser:
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

    return inc
