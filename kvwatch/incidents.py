"""``kvwatch incidents``: the affected requests, from journals and incidents logs, for the
disclosure team.

A *finding* is one detector's event: one spool record, one row of the journal's ``incidents``
table, one line of the incidents log. Rows come from :meth:`kvwatch.journal.Journal.incidents`
or from an incidents log (:mod:`kvwatch.incidents_log`), in one shape; several of them merge into
one fleet-wide list, a finding found in both a journal and a log counted once (by node, producer
and sequence number, which name one spool record).

An *incident* is one affected request instance: its findings, grouped by :func:`group` (see
:data:`JOIN_SECONDS` for the rule), and its sources (the distinct requests whose KV it
received). Every count an operator reads (the status headline, ``kvwatch status``, the pages,
this command's table and JSON, ``--exposed``) counts incidents and exposed requests through
:func:`counts`. ``--exposed`` turns the list into the disclosure view: who received other
requests' KV (readers), whose KV was received (sources), and how many pages.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Final, TextIO

from kvspool.records import stopped_before_read
from kvwatch.incidents_log import iso

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
)
_SHOWN_PAGES = 8
#: Kinds whose request read nothing: a write into a free page is its late writer's (older
#: producers named the page's next owner there, with the writer as a source). A read of such
#: a page before it is overwritten is a finding of its own. A finding of any kind whose
#: ``detail`` says :data:`kvspool.records.STOPPED_BEFORE_READ` names no reader either: enforce
#: mode failed its request before it read.
NOT_READS: Final = frozenset({"write_to_free_page"})
#: The disclosure view's JSON format (``--exposed --json``): its ``v``. 2: a reader is an
#: incident (``findings``, ``id``); ``counts`` counts incidents, not findings, and ``exposed``.
EXPOSED_VERSION: Final = 2
#: The join rule of :func:`group`. A request id is not an identity (clients reuse ids) and an
#: instance is one admission on one side (prefill and decode each mint theirs, and decode's
#: admission check and its reservation may be two), so neither alone names the affected request.
#: A finding joins the incident of its node and request id whose last finding is at most this
#: many seconds older, unless that incident already holds the same (role, detector, kind) from
#: another instance: the hooks report a request instance once per detector and kind, so a
#: repeat from a new instance is a new admission of a reused id, a new incident. Findings of one
#: instance always stay together.
JOIN_SECONDS: Final = 60.0


def identity(row: dict[str, Any]) -> tuple[str, str, int]:
    """What names one finding anywhere: its node, producer and the record's sequence number."""
    return (row["node"] or "", row["producer"], row["seq"])


def merge(
    sources: Iterable[list[dict[str, Any]]],
    *,
    since: float | None = None,
    until: float | None = None,
    detector: str | None = None,
    kind: str | None = None,
) -> list[dict[str, Any]]:
    """One time-ordered list of findings from several journals and logs, each finding once."""
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


def _source_key(source: dict[str, Any]) -> tuple[str, str]:
    return (source["request_id"], source["instance"] or "")


class Joiner:
    """The join rule (:data:`JOIN_SECONDS`), once: which incident each finding belongs to.

    :func:`group` joins a list of findings with it; the spool reader joins the stream it
    ingests with it, so that ``kvwatch_affected_requests_total`` and
    ``kvwatch_exposed_requests_total`` count what every view counts. ``limit`` bounds the
    incidents it remembers (the reader's memory); the oldest are forgotten first."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self._next = 0
        self._by_instance: dict[tuple[str, str, str], int] = {}
        self._latest: dict[tuple[str, str], int] = {}
        #: An incident's last finding's time, and (role, detector, kind) -> the instance that
        #: reported it first.
        self._incidents: dict[int, tuple[float, dict[tuple[str, str, str], str]]] = {}

    def join(
        self, node: str, request_id: str, instance: str, what: tuple[str, str, str], time: float
    ) -> tuple[int, bool]:
        """The incident key of a finding (``what``: role, detector, kind), and whether the
        finding starts that incident."""
        key = self._by_instance.get((node, request_id, instance)) if instance else None
        if key is None or key not in self._incidents:
            key = self._latest.get((node, request_id))
            state = None if key is None else self._incidents.get(key)
            if (
                state is None
                or time - state[0] > JOIN_SECONDS
                or state[1].get(what, instance) != instance
            ):
                key = None
        new = key is None
        if key is None:
            key, self._next = self._next, self._next + 1
            self._incidents[key] = (time, {})
        last, seen = self._incidents[key]
        seen.setdefault(what, instance)
        self._incidents[key] = (max(last, time), seen)
        if instance:
            self._by_instance[(node, request_id, instance)] = key
        self._latest.pop((node, request_id), None)
        self._latest[(node, request_id)] = key
        if self.limit is not None and len(self._incidents) > self.limit:
            # Bounded memory: the oldest half of the incidents goes (a finding that would
            # have joined one starts a new incident, counted once more).
            for old in list(self._incidents)[: len(self._incidents) // 2]:
                del self._incidents[old]
            for table in (self._by_instance, self._latest):
                for name in [n for n, k in table.items() if k not in self._incidents]:
                    del table[name]  # type: ignore[arg-type]
        return key, new


def group(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The incidents of ``findings`` (time-ordered, as :func:`merge` gives them), in order of
    their first finding. The join rule: :class:`Joiner`."""
    incidents: list[dict[str, Any]] = []
    by_key: dict[int, dict[str, Any]] = {}
    joiner = Joiner()
    for row in findings:
        what = (row["role"], row["detector"], row["kind"])
        key, new = joiner.join(
            row["node"] or "", row["request_id"], row["instance"] or "", what, row["time"]
        )
        if new:
            incident = by_key[key] = _new_incident(row)
            incidents.append(incident)
        _add_finding(by_key[key], row)
    for incident in incidents:
        incident["sources"] = sorted(
            incident["sources"].values(), key=lambda s: (-s["pages"], _source_key(s))
        )
        incident["exposed"] = len(incident["sources"]) + incident["other_sources"]
    return join_peers(incidents)


# -- across nodes: a reader and the writer's side of the same request -------------------------

#: The writer's finding whose sources are a remote reader's: the requests that took a sent
#: request's pages before its reader read them (vLLM: NIXL's lease expired).
WRITER_SIDE: Final = frozenset({"freed_before_read"})


def _peer(finding: dict[str, Any]) -> tuple[str, str, str] | None:
    """The writer's request instance a reader's finding names (node, request id, instance)."""
    detail = finding.get("detail") or {}
    peer = tuple(detail.get(k) for k in ("peer_node", "peer_request_id", "peer_instance"))
    return peer if all(isinstance(v, str) and v for v in peer) else None  # type: ignore[return-value]


def join_peers(incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One incident for a request that two nodes saw: a reader's finding names the writer's
    request instance (``peer_*`` in its detail) and that instance has a :data:`WRITER_SIDE`
    finding on its node. The reader's incident takes the writer's findings, and, as sources
    on the writer's node (``node`` in the source), the requests that wrote into the sent pages
    no later than the reader's first finding on them (it read before it checked; the rest came
    too late to be read). Times are two nodes' clocks: keep them in sync (NTP)."""
    writers: dict[tuple[str, str, str], dict[str, Any]] = {}
    for incident in incidents:
        if any(f["kind"] in WRITER_SIDE for f in incident["findings"]):
            for instance in incident["instances"]:
                writers[(incident["node"], incident["request_id"], instance)] = incident
    if not writers:
        return incidents
    merged: set[int] = set()
    for incident in incidents:
        reads = [(f["time"], _peer(f)) for f in incident["findings"] if _peer(f) is not None]
        for read_at, peer in sorted(reads, key=lambda r: r[0]):
            writer = writers.get(peer)  # type: ignore[arg-type]
            if writer is None or writer is incident or id(writer) in merged:
                continue
            merged.add(id(writer))
            _take_writer(incident, writer, read_at)
    return [i for i in incidents if id(i) not in merged]


def _take_writer(reader: dict[str, Any], writer: dict[str, Any], read_at: float) -> None:
    reader["findings"].extend(writer["findings"])
    reader["findings"].sort(key=lambda f: f["time"])
    for name in ("instances", "roles"):
        reader[name].extend(v for v in writer[name] if v not in reader[name])
    reader["detectors"].extend(d for d in writer["detectors"] if d not in reader["detectors"])
    reader["peer"] = {"node": writer["node"], "request_id": writer["request_id"],
                      "instance": writer["instance"]}  # fmt: skip
    known = {(s.get("node") or reader["node"], *_source_key(s)) for s in reader["sources"]}
    for source in writer["sources"]:
        key = (writer["node"], *_source_key(source))
        if source["written_at"] <= read_at and key not in known:
            reader["sources"].append({**source, "node": writer["node"]})
    reader["sources"].sort(key=lambda s: (-s["pages"], _source_key(s)))
    reader["exposed"] = len(reader["sources"]) + reader["other_sources"]


def _new_incident(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": row.get("id"),
        "node": row["node"] or "",
        "request_id": row["request_id"],
        "instance": row["instance"],
        "instances": [],
        "roles": [],
        "role": row["role"],
        "engine": row["engine"],
        "engine_version": row["engine_version"],
        "model": row["model"],
        "producer": row["producer"],
        "time": row["time"],
        "first_time": row["time"],
        "last_time": row["time"],
        "detectors": [],
        "pages_total": 0,
        "findings": [],
        "sources": {},
        "other_sources": 0,
        "other_source_pages": 0,
        "exposed": 0,
    }


_FINDING_FIELDS: Final = (
    "id", "time", "role", "producer", "seq", "instance", "detector", "kind", "mode", "action",
    "pages", "pages_total", "detail", "sources", "other_sources", "other_source_pages",
)  # fmt: skip


def _add_finding(incident: dict[str, Any], row: dict[str, Any]) -> None:
    incident["findings"].append({k: row.get(k) for k in _FINDING_FIELDS})
    incident["last_time"] = max(incident["last_time"], row["time"])
    if row.get("id") is not None and (incident["id"] is None or row["id"] < incident["id"]):
        incident["id"] = row["id"]
    for name, value in (("instances", row["instance"]), ("roles", row["role"])):
        if value and value not in incident[name]:
            incident[name].append(value)
    if row["detector"] not in incident["detectors"]:
        incident["detectors"].append(row["detector"])
    incident["pages_total"] = max(incident["pages_total"], row["pages_total"])
    if row["kind"] in NOT_READS:  # its request read nothing: it names no reader, no source
        return
    # Stopped before it read (enforce, at a check ahead of the read): the pages' holders are
    # kept in the finding, but nobody's KV reached the request: no source, not exposed.
    read = not stopped_before_read(row.get("detail"))
    sourced = read and bool(row["sources"] or row["other_sources"])
    named = bool(incident["sources"] or incident["other_sources"])
    # The reader names the incident: the side whose pages held other requests' KV, else the
    # decode side (which reads what prefill sent), else the first finding's.
    if not named and (sourced or (row["role"] == "decode" != incident["role"])):
        for name in ("instance", "role", "engine", "engine_version", "model", "producer"):
            incident[name] = row[name]
    if sourced:
        for source in row["sources"]:
            key = _source_key(source)
            kept = incident["sources"].get(key)
            if kept is None:
                incident["sources"][key] = dict(source)
            else:  # a pair found by several detectors counts its pages once: the most named
                kept["pages"] = max(kept["pages"], source["pages"])
                kept["written_at"] = max(kept["written_at"], source["written_at"])
        incident["other_sources"] = max(incident["other_sources"], row["other_sources"])
        incident["other_source_pages"] = max(
            incident["other_source_pages"], row["other_source_pages"]
        )


def counts(incidents: list[dict[str, Any]]) -> dict[str, int]:
    """What every view says: ``affected`` requests (incidents) and ``exposed`` requests (the
    distinct sources on their node, and the ones only counted, beyond the 16 an event names)."""
    named = {(s.get("node") or i["node"], *_source_key(s)) for i in incidents for s in i["sources"]}
    return {
        "affected": len(incidents),
        "exposed": len(named) + sum(i["other_sources"] for i in incidents),
    }


def render(incidents: list[dict[str, Any]], out: TextIO, *, as_json: bool) -> None:
    if as_json:
        stamped = [
            {
                **i,
                "time_iso": iso(i["time"]),
                "last_time_iso": iso(i["last_time"]),
            }
            for i in incidents
        ]
        out.write(json.dumps(stamped, sort_keys=True, indent=2) + "\n")
        return
    table: list[tuple[str, ...]] = [_COLUMNS]
    for i in incidents:
        findings = ", ".join(
            f"{f['role']} {f['detector']} {f['kind']}" for f in i["findings"][:_SHOWN_FINDINGS]
        )
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
            )
        )
    _table(table, out)
    total = counts(incidents)
    out.write(  # an incident is an affected request: its count last, as before
        f"{sum(len(i['findings']) for i in incidents)} finding(s), "
        f"{total['exposed']} exposed request(s), {total['affected']} incident(s)\n"
    )


_SHOWN_FINDINGS = 4


def _pages(incident: dict[str, Any]) -> str:
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
    incidents: list[dict[str, Any]], *, since: float | None, until: float | None
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
        reader = {
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
                (held, *_source_key(source)),
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
    for source in sources.values():
        source["readers"].sort(key=lambda r: (-r["pages"], r["request_id"]))
        source["pages"] = sum(r["pages"] for r in source["readers"])
        source_list.append(source)
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
