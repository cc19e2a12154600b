"""``kvwatch incidents``: the affected requests, from journals and incidents logs, for the
disclosure team.

Rows come from :meth:`kvwatch.journal.Journal.incidents` or from an incidents log
(:mod:`kvwatch.incidents_log`), in one shape; several of them merge into one fleet-wide list, an
incident found in both a journal and a log counted once (by node, producer and sequence number,
which name one spool record). ``--exposed`` turns the list into the disclosure view: who
received other requests' KV (readers), whose KV was received (sources), and how many pages.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Final, TextIO

from kvwatch.incidents_log import iso

_COLUMNS = (
    "TIME (UTC)",
    "NODE",
    "ROLE",
    "ENGINE",
    "REQUEST",
    "INSTANCE",
    "DETECTOR",
    "KIND",
    "SOURCES",
    "PAGES",
)
_SHOWN_PAGES = 8
#: Kinds whose request read nothing: a write into a free page is its late writer's (older
#: producers named the page's next owner there, with the writer as a source). A read of such
#: a page before it is overwritten is a finding of its own.
NOT_READS: Final = frozenset({"write_to_free_page"})
#: The disclosure view's JSON format (``--exposed --json``): its ``v``.
EXPOSED_VERSION: Final = 1


def _pages(row: dict[str, Any]) -> str:
    pages = [str(p) for p in row["pages"][:_SHOWN_PAGES]]
    text = ",".join(pages)
    if row["pages_total"] > len(pages):
        text += f",... ({row['pages_total']} pages)"
    return text or "-"


def identity(row: dict[str, Any]) -> tuple[str, str, int]:
    """What names one incident anywhere: its node, producer and the record's sequence number."""
    return (row["node"] or "", row["producer"], row["seq"])


def merge(
    sources: Iterable[list[dict[str, Any]]],
    *,
    since: float | None = None,
    until: float | None = None,
    detector: str | None = None,
    kind: str | None = None,
) -> list[dict[str, Any]]:
    """One time-ordered list from several journals and logs, each incident once."""
    seen: dict[tuple[str, str, int], dict[str, Any]] = {}
    for rows in sources:
        for row in rows:
            if since is not None and row["time"] < since:
                continue
            if until is not None and row["time"] >= until:
                continue
            if detector is not None and row["detector"] != detector:
                continue
            if kind is not None and row["kind"] != kind:
                continue
            seen.setdefault(identity(row), row)
    return sorted(seen.values(), key=lambda r: (r["time"], identity(r)))


def exposed_count(row: dict[str, Any]) -> int:
    """Requests whose KV this incident's reader received (as ``kvwatch_exposed_requests``)."""
    if row["kind"] in NOT_READS:
        return 0
    return len({s["request_id"] for s in row["sources"]}) + int(row["other_sources"])


def render(rows: list[dict[str, Any]], out: TextIO, *, as_json: bool) -> None:
    if as_json:
        stamped = [{**row, "time_iso": iso(row["time"])} for row in rows]
        out.write(json.dumps(stamped, sort_keys=True, indent=2) + "\n")
        return
    table: list[tuple[str, ...]] = [_COLUMNS]
    for row in rows:
        table.append(
            (
                iso(row["time"]),
                row["node"] or "-",
                row["role"] or "-",
                row["engine"] or "-",
                row["request_id"] or "-",
                row["instance"] or "-",
                row["detector"],
                row["kind"],
                str(exposed_count(row)),
                _pages(row),
            )
        )
    _table(table, out)
    out.write(f"{len(rows)} incident(s)\n")


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
    rows: list[dict[str, Any]], *, since: float | None, until: float | None
) -> dict[str, Any]:
    """The disclosure view of ``rows`` (format version :data:`EXPOSED_VERSION`).

    ``readers``: each request (per node and instance) that received other requests' KV, with
    its node, role, engine and instance, the pages its incidents named (the most any one
    finding named) and its sources. ``sources``: each request whose KV was received, with the
    pages received (summed over readers) and which readers. A source is known by its request
    id and instance on the reader's node (a KV pool is one node's). ``unnamed_sources``: the
    sources a finding only counted (beyond the 16 an event names). Pages of one reader-source
    pair found by several detectors count once: the most any one finding named.
    """
    readers: dict[tuple[str, str, str], dict[str, Any]] = {}
    sources: dict[tuple[str, str, str], dict[str, Any]] = {}
    edges: dict[tuple[tuple[str, str, str], tuple[str, str, str]], int] = {}
    unnamed = 0
    unnamed_pages = 0
    for row in rows:
        if not row["sources"] and not row["other_sources"]:
            continue
        if row["kind"] in NOT_READS:
            continue
        node = row["node"] or ""
        rkey = (node, row["request_id"], row["instance"] or "")
        reader = readers.setdefault(
            rkey,
            {
                "request_id": row["request_id"],
                "instance": row["instance"],
                "node": node,
                "role": row["role"],
                "engine": row["engine"],
                "engine_version": row["engine_version"],
                "model": row["model"],
                "producer": row["producer"],
                "first_time": row["time"],
                "last_time": row["time"],
                "pages": 0,
                "detectors": [],
                "incidents": 0,
                "other_sources": 0,
                "other_source_pages": 0,
            },
        )
        reader["last_time"] = max(reader["last_time"], row["time"])
        reader["first_time"] = min(reader["first_time"], row["time"])
        reader["pages"] = max(reader["pages"], row["pages_total"])
        reader["incidents"] += 1
        if row["detector"] not in reader["detectors"]:
            reader["detectors"].append(row["detector"])
        reader["other_sources"] = max(reader["other_sources"], row["other_sources"])
        reader["other_source_pages"] = max(reader["other_source_pages"], row["other_source_pages"])
        unnamed += row["other_sources"]
        unnamed_pages += row["other_source_pages"]
        for source in row["sources"]:
            skey = (node, source["request_id"], source["instance"] or "")
            sources.setdefault(
                skey,
                {
                    "request_id": source["request_id"],
                    "instance": source["instance"],
                    "node": node,
                    "last_written": 0.0,
                },
            )
            entry = sources[skey]
            entry["last_written"] = max(entry["last_written"], source["written_at"])
            edges[(rkey, skey)] = max(edges.get((rkey, skey), 0), source["pages"])
    reader_sources: dict[tuple[str, str, str], list[dict[str, Any]]] = {k: [] for k in readers}
    source_readers: dict[tuple[str, str, str], list[dict[str, Any]]] = {k: [] for k in sources}
    for (rkey, skey), pages in sorted(edges.items(), key=lambda e: (-e[1], e[0])):
        s, r = sources[skey], readers[rkey]
        reader_sources[rkey].append(
            {"request_id": s["request_id"], "instance": s["instance"], "pages": pages}
        )
        source_readers[skey].append(
            {"request_id": r["request_id"], "instance": r["instance"], "pages": pages}
        )
    reader_list = []
    for rkey, reader in readers.items():
        reader["sources"] = reader_sources[rkey]
        reader["first_time_iso"] = iso(reader["first_time"])
        reader["last_time_iso"] = iso(reader["last_time"])
        reader_list.append(reader)
    source_list = []
    for skey, source in sources.items():
        source["readers"] = source_readers[skey]
        source["pages"] = sum(r["pages"] for r in source["readers"])
        source_list.append(source)
    reader_list.sort(key=lambda r: (r["first_time"], r["node"], r["request_id"]))
    source_list.sort(key=lambda s: (-s["pages"], s["node"], s["request_id"]))
    return {
        "v": EXPOSED_VERSION,
        "since": since,
        "until": until,
        "readers": reader_list,
        "sources": source_list,
        "counts": {
            "incidents": sum(r["incidents"] for r in reader_list),
            "readers": len(reader_list),
            "sources": len(source_list),
            "unnamed_sources": unnamed,
            "unnamed_source_pages": unnamed_pages,
            "pages": sum(edges.values()) + unnamed_pages,
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
        named = ", ".join(f"{s['request_id']} ({s['pages']})" for s in r["sources"])
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
    counts = view["counts"]
    out.write(
        f"\n{counts['readers']} reader(s), {counts['sources']} named source(s)"
        f" and {counts['unnamed_sources']} unnamed, {counts['pages']} page(s),"
        f" from {counts['incidents']} incident(s)\n"
    )
