"""The incident model: the one shape of a finding (:class:`Finding`), the join rule that groups
findings into incidents (:class:`Joiner`, :func:`group`) and the counts every view shows
(:func:`counts`).

A *finding* is one detector's event: one spool record, one row of the journal's ``incidents``
table, one line of the incidents log, always a :class:`Finding`. The spool reader builds it, the
journal's columns derive from its fields, the incidents log encodes it, the journal's queries and
the log's reader return it; several lists of them merge into one fleet-wide list (:func:`merge`),
a finding found in both a journal and a log counted once (by node, producer and sequence number,
which name one spool record).

An *incident* is one affected request instance: its findings, grouped by :func:`group` (see
:data:`JOIN_SECONDS` for the rule), and its sources (the distinct requests whose KV it
received). Every count an operator reads (the status headline, ``kvwatch status``, the pages,
``kvwatch incidents``' table and JSON, ``--exposed``) counts incidents and exposed requests
through :func:`counts`.

About 460 lines, kept in one module on purpose: the finding, its typed views
(:class:`Incident`, :class:`FindingView`, :class:`SourceView`), the join rule and the counts are
one definition of what an incident is, and every view reads them from here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Final, NotRequired, TypedDict

from msgspec import Meta, Struct, structs

from kvspool.records import (
    MAX_DETAIL_ITEMS,
    MAX_EVENT_PAGES,
    MAX_EVENT_SOURCES,
    Count,
    Int64,
    Seq,
    Source,
    Text,
    Timestamp,
    stopped_before_read,
)


class Finding(Struct, gc=False):
    """One finding, wherever it is: built by the spool reader from an ``event`` record and its
    producer's ``hello``, stored by the journal (one column per field but ``id`` and
    ``sources``, which are the row's id and its ``exposures`` rows), written by the incidents
    log (one line: these fields in this order, after ``v`` and ``journal``, with ``time``
    after ``ts``) and read back from either.

    Adding a field: add it here (after ``rank``, the reader copies it from the event record's
    field of the same name), and to the renderers that should show it. The journal adds its
    column to a journal that predates it (the rows there read the type's zero), the log writes
    it (a field added within the line format's version).

    Positional: the reader builds one per event on its hot path, every field given. A field
    added later gets its type's zero as a default, so that what was written before it (the
    journal's rows, the log's lines, the tests' hand-built findings) still reads, as that zero
    (docs/architecture.md shows the diff)."""

    #: The journal's id (the reader's findings: None until stored).
    id: Annotated[int, Meta(ge=0)] | None
    #: Unix seconds (the record's, or the daemon's clock for one outside its window).
    ts: Timestamp
    #: The daemon's ``node`` setting; the producer and the record's sequence number.
    node: Text
    producer: Text
    seq: Seq
    #: The producer's ``hello``.
    role: Text
    engine: Text
    engine_version: Text
    model: Text
    rank: Int64
    #: The reader: its request id and instance (one per admission, where the engine knows it).
    request_id: Text
    instance: Text | None
    detector: Text
    kind: Text
    mode: Text
    action: Text
    #: The pages (at most 256 named) and their count.
    pages: Annotated[list[Int64], Meta(max_length=MAX_EVENT_PAGES)]
    pages_total: Count
    #: Whose KV the pages held, most pages first (stable), and the count of the unnamed rest.
    sources: Annotated[list[Source], Meta(max_length=MAX_EVENT_SOURCES)]
    other_sources: Count
    other_source_pages: Count
    #: The detector's counts and names, keys sorted (as the journal and the log hold them).
    detail: Annotated[dict[Text, Int64 | Text], Meta(max_length=MAX_DETAIL_ITEMS)]


#: The fields of a finding (the journal's columns but ``id`` and ``sources``, the log's line).
FINDING_FIELDS: Final = Finding.__struct_fields__


def sorted_sources(sources: list[Source]) -> list[Source]:
    """``sources`` most pages first, ties in their order (what the journal and the log hold)."""
    if len(sources) < 2:
        return sources
    return sorted(sources, key=lambda s: -s.pages)


def sorted_detail(detail: dict[str, Any]) -> dict[str, Any]:
    """``detail`` with its keys sorted (what the journal and the log hold)."""
    if len(detail) < 2:
        return detail
    return dict(sorted(detail.items()))


#: Kinds whose request read nothing: a write into a free page is its late writer's (older
#: producers named the page's next owner there, with the writer as a source). A read of such
#: a page before it is overwritten is a finding of its own. A finding of any kind whose
#: ``detail`` says :data:`kvspool.records.STOPPED_BEFORE_READ` names no reader either: enforce
#: mode failed its request before it read.
NOT_READS: Final = frozenset({"write_to_free_page"})
#: The join rule of :func:`group`. A request id is not an identity (clients reuse ids) and an
#: instance is one admission on one side (prefill and decode each mint theirs, and decode's
#: admission check and its reservation may be two), so neither alone names the affected request.
#: A finding joins the incident of its node and request id whose last finding is at most this
#: many seconds older, unless that incident already holds the same (role, detector, kind) from
#: another instance: the hooks report a request instance once per detector and kind, so a
#: repeat from a new instance is a new admission of a reused id, a new incident. Findings of one
#: instance always stay together.
JOIN_SECONDS: Final = 60.0


def identity(finding: Finding) -> tuple[str, str, int]:
    """What names one finding anywhere: its node, producer and the record's sequence number."""
    return (finding.node or "", finding.producer, finding.seq)


def merge(
    sources: Iterable[list[Finding]],
    *,
    since: float | None = None,
    until: float | None = None,
    detector: str | None = None,
    kind: str | None = None,
) -> list[Finding]:
    """One time-ordered list of findings from several journals and logs, each finding once."""
    seen: dict[tuple[str, str, int], Finding] = {}
    for findings in sources:
        for finding in findings:
            if since is not None and finding.ts < since:
                continue
            if until is not None and finding.ts >= until:
                continue
            if detector is not None and finding.detector != detector:
                continue
            if kind is not None and finding.kind != kind:
                continue
            seen.setdefault(identity(finding), finding)
    return sorted(seen.values(), key=lambda f: (f.ts, identity(f)))


class SourceView(TypedDict):
    """A source as the views show it (JSON-ready); ``node`` only on one joined from another
    node (:func:`join_peers`)."""

    request_id: str
    pages: int
    instance: str | None
    written_at: float
    node: NotRequired[str]


class FindingView(TypedDict):
    """A finding as an incident shows it (JSON-ready, :func:`finding_view`): the fields of
    :data:`_SHOWN_FIELDS`, ``time`` being the finding's ``ts``."""

    id: int | None
    time: float
    role: str
    rank: int
    producer: str
    seq: int
    instance: str | None
    detector: str
    kind: str
    mode: str
    action: str
    pages: list[int]
    pages_total: int
    detail: dict[str, int | str]
    sources: list[SourceView]
    other_sources: int
    other_source_pages: int


class Peer(TypedDict):
    """The writer's request instance a joined incident took (:func:`join_peers`)."""

    node: str
    request_id: str
    instance: str | None


class Incident(TypedDict):
    """One affected request instance, as :func:`group` builds it and every view renders it
    (``kvwatch incidents``' table and JSON, the status page, ``kvwatch status``, acks): its
    labels (the reader's, see :func:`_add_finding`), its findings in time order, and its
    sources (distinct, most pages first) and the count of those only counted. JSON-ready, keys
    in the order the JSON output shows them."""

    id: int | None
    node: str
    request_id: str
    instance: str | None
    instances: list[str]
    roles: list[str]
    #: The tensor-parallel ranks whose findings it holds (every rank's on one request: one
    #: incident, its exposure counted once).
    ranks: list[int]
    role: str
    engine: str
    engine_version: str
    model: str
    producer: str
    time: float
    first_time: float
    last_time: float
    detectors: list[str]
    pages_total: int
    findings: list[FindingView]
    sources: list[SourceView]
    other_sources: int
    other_source_pages: int
    exposed: int
    peer: NotRequired[Peer]


def source_key(source: SourceView) -> tuple[str, str]:
    """A source as an incident's views key it: its request id and instance."""
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
        #: reported it first (a list: updated in place, once per finding).
        self._incidents: dict[int, list[Any]] = {}

    def join(
        self, node: str, request_id: str, instance: str, what: tuple[str, str, str], time: float
    ) -> tuple[int, bool]:
        """The incident key of a finding (``what``: role, detector, kind), and whether the
        finding starts that incident."""
        incidents = self._incidents
        key = self._by_instance.get((node, request_id, instance)) if instance else None
        if key is None or key not in incidents:
            key = self._latest.get((node, request_id))
            state = None if key is None else incidents.get(key)
            if (
                state is None
                or time - state[0] > JOIN_SECONDS
                or state[1].get(what, instance) != instance
            ):
                key = None
        new = key is None
        if key is None:
            key = self._next
            self._next = key + 1
            incidents[key] = [time, {what: instance}]
        else:
            state = incidents[key]
            if time > state[0]:  # noqa: PLR1730 (max() per finding costs more)
                state[0] = time
            state[1].setdefault(what, instance)
        if instance:
            self._by_instance[(node, request_id, instance)] = key
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


def group(findings: list[Finding]) -> list[Incident]:
    """The incidents of ``findings`` (time-ordered, as :func:`merge` gives them), in order of
    their first finding. The join rule: :class:`Joiner`."""
    incidents: list[Incident] = []
    by_key: dict[int, Incident] = {}
    #: Each incident's distinct sources while it is built (keyed as :func:`source_key`).
    sources: dict[int, dict[tuple[str, str], SourceView]] = {}
    joiner = Joiner()
    for row in findings:
        what = (row.role, row.detector, row.kind)
        key, new = joiner.join(row.node or "", row.request_id, row.instance or "", what, row.ts)
        if new:
            incident = by_key[key] = _new_incident(row)
            incidents.append(incident)
            sources[id(incident)] = {}
        _add_finding(by_key[key], sources[id(by_key[key])], row)
    for incident in incidents:
        incident["sources"] = sorted(
            sources[id(incident)].values(), key=lambda s: (-s["pages"], source_key(s))
        )
        incident["exposed"] = len(incident["sources"]) + incident["other_sources"]
    return join_peers(incidents)


# -- across nodes: a reader and the writer's side of the same request -------------------------

#: The writer's finding whose sources are a remote reader's: the requests that took a sent
#: request's pages before its reader read them (vLLM: NIXL's lease expired).
WRITER_SIDE: Final = frozenset({"freed_before_read"})


def _peer(finding: FindingView) -> tuple[str, str, str] | None:
    """The writer's request instance a reader's finding names (node, request id, instance)."""
    detail = finding["detail"] or {}
    peer = tuple(detail.get(k) for k in ("peer_node", "peer_request_id", "peer_instance"))
    return peer if all(isinstance(v, str) and v for v in peer) else None  # type: ignore[return-value]


def join_peers(incidents: list[Incident]) -> list[Incident]:
    """One incident for a request that two nodes saw: a reader's finding names the writer's
    request instance (``peer_*`` in its detail) and that instance has a :data:`WRITER_SIDE`
    finding on its node. The reader's incident takes the writer's findings, and, as sources
    on the writer's node (``node`` in the source), the requests that wrote into the sent pages
    no later than the reader's first finding on them (it read before it checked; the rest came
    too late to be read). Times are two nodes' clocks: keep them in sync (NTP)."""
    writers: dict[tuple[str, str, str], Incident] = {}
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


def _take_writer(reader: Incident, writer: Incident, read_at: float) -> None:
    reader["findings"].extend(writer["findings"])
    reader["findings"].sort(key=lambda f: f["time"])
    for mine, theirs in (
        (reader["instances"], writer["instances"]),
        (reader["roles"], writer["roles"]),
        (reader["detectors"], writer["detectors"]),
    ):
        mine.extend(v for v in theirs if v not in mine)
    reader["ranks"] = sorted({*reader["ranks"], *writer["ranks"]})  # whose findings it holds
    reader["peer"] = {"node": writer["node"], "request_id": writer["request_id"],
                      "instance": writer["instance"]}  # fmt: skip
    known = {(s.get("node") or reader["node"], *source_key(s)) for s in reader["sources"]}
    for source in writer["sources"]:
        key = (writer["node"], *source_key(source))
        if source["written_at"] <= read_at and key not in known:
            reader["sources"].append(SourceView(**source, node=writer["node"]))
    reader["sources"].sort(key=lambda s: (-s["pages"], source_key(s)))
    reader["exposed"] = len(reader["sources"]) + reader["other_sources"]


def _new_incident(row: Finding) -> Incident:
    return {
        "id": row.id,
        "node": row.node or "",
        "request_id": row.request_id,
        "instance": row.instance,
        "instances": [],
        "roles": [],
        "ranks": [],
        "role": row.role,
        "engine": row.engine,
        "engine_version": row.engine_version,
        "model": row.model,
        "producer": row.producer,
        "time": row.ts,
        "first_time": row.ts,
        "last_time": row.ts,
        "detectors": [],
        "pages_total": 0,
        "findings": [],
        "sources": [],
        "other_sources": 0,
        "other_source_pages": 0,
        "exposed": 0,
    }


#: A finding's fields an incident's ``findings`` show (its producer's labels are the incident's).
_SHOWN_FIELDS: Final = (
    "id", "time", "role", "rank", "producer", "seq", "instance", "detector", "kind", "mode",
    "action",
    "pages", "pages_total", "detail", "sources", "other_sources", "other_source_pages",
)  # fmt: skip


def finding_summary(finding: FindingView) -> str:
    """A finding in one phrase, as the incident lists show it: its role (and its TP rank past
    rank 0), detector and kind."""
    rank = f" rank {finding['rank']}" if finding["rank"] else ""
    return f"{finding['role']}{rank} {finding['detector']} {finding['kind']}"


def finding_view(finding: Finding) -> FindingView:
    """A finding as an incident's views show it (JSON-ready): ``time`` is its ``ts``."""
    view = {name: getattr(finding, "ts" if name == "time" else name) for name in _SHOWN_FIELDS}
    view["sources"] = [structs.asdict(s) for s in finding.sources]
    return view  # type: ignore[return-value]  # the keys of FindingView: _SHOWN_FIELDS


def _add_finding(
    incident: Incident, sources: dict[tuple[str, str], SourceView], finding: Finding
) -> None:
    row = finding_view(finding)
    incident["findings"].append(row)
    incident["last_time"] = max(incident["last_time"], row["time"])
    if row["id"] is not None and (incident["id"] is None or row["id"] < incident["id"]):
        incident["id"] = row["id"]
    for kept_list, value in (
        (incident["instances"], row["instance"]),
        (incident["roles"], row["role"]),
    ):
        if value and value not in kept_list:
            kept_list.append(value)
    if row["detector"] not in incident["detectors"]:
        incident["detectors"].append(row["detector"])
    if row["rank"] not in incident["ranks"]:
        incident["ranks"] = sorted([*incident["ranks"], row["rank"]])
    incident["pages_total"] = max(incident["pages_total"], row["pages_total"])
    if row["kind"] in NOT_READS:  # its request read nothing: it names no reader, no source
        return
    # Stopped before it read (enforce, at a check ahead of the read): the pages' holders are
    # kept in the finding, but nobody's KV reached the request: no source, not exposed.
    read = not stopped_before_read(row["detail"])
    sourced = read and bool(row["sources"] or row["other_sources"])
    named = bool(sources or incident["other_sources"])
    # The reader names the incident: the side whose pages held other requests' KV, else the
    # decode side (which reads what prefill sent), else the first finding's.
    if not named and (sourced or (row["role"] == "decode" != incident["role"])):
        incident["instance"] = finding.instance
        incident["role"] = finding.role
        incident["engine"] = finding.engine
        incident["engine_version"] = finding.engine_version
        incident["model"] = finding.model
        incident["producer"] = finding.producer
    if sourced:
        for source in row["sources"]:
            key = source_key(source)
            kept = sources.get(key)
            if kept is None:
                sources[key] = SourceView(**source)
            else:  # a pair found by several detectors counts its pages once: the most named
                kept["pages"] = max(kept["pages"], source["pages"])
                kept["written_at"] = max(kept["written_at"], source["written_at"])
        incident["other_sources"] = max(incident["other_sources"], row["other_sources"])
        incident["other_source_pages"] = max(
            incident["other_source_pages"], row["other_source_pages"]
        )


def counts(incidents: list[Incident]) -> dict[str, int]:
    """What every view says: ``affected`` requests (incidents) and ``exposed`` requests (the
    distinct sources on their node, and the ones only counted, beyond the 16 an event names)."""
    named = {(s.get("node") or i["node"], *source_key(s)) for i in incidents for s in i["sources"]}
    return {
        "affected": len(incidents),
        "exposed": len(named) + sum(i["other_sources"] for i in incidents),
    }
