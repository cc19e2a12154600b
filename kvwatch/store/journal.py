"""The incident journal: SQLite in WAL mode, the daemon's durable memory.

Every accepted spool record is committed here together with the read position that follows it, in
one transaction, so a ``kill -9`` of the daemon at any moment neither loses nor repeats a record:
after a restart the reader resumes from the committed position. Detection events land in
``incidents`` (what an operator hands to the disclosure team); every record leaves a row in
``records`` (producer, sequence number, type, time) for accounting. Nothing here holds prompt
text, token ids or KV bytes: the spool schema carries none, and rejected frames are recorded by
position and reason only.

Longer than 450 lines: every SQL statement of the daemon lives here (the schema, its
migrations, the hot path's INSERTs, the prune and the queries), so that one file shows the
journal whole.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain, groupby
from operator import attrgetter
from pathlib import Path
from typing import Any, Final, NamedTuple, get_args, get_type_hints

import msgspec

from kvspool.records import CounterSeries, Source
from kvwatch.store.incident import FINDING_FIELDS, Finding
from kvwatch.store.state import (
    LabelKey,
    Producer,
    Segment,
    State,
    Totals,
    producer_counter_series,
    totals,
)

SCHEMA_VERSION: Final = 4
#: Retired producers kept in memory (and in the producers table) before the oldest are folded.
MAX_RETIRED_PRODUCERS: Final = 1024
#: A retired producer is never folded sooner: one whose spool directory was removed comes back
#: with new segments within seconds, and folding it would count its counters twice.
RETIRED_GRACE: Final = 600.0


class ExposureRow(NamedTuple):
    """One row of ``exposures``: a reader -> source edge. The reader is the incident of
    (``producer``, ``seq``); the source is a request whose KV ``pages`` of its pages held."""

    producer: str
    seq: int
    ts: float
    request_id: str
    instance: str | None
    pages: int
    written_at: float


class AckRow(NamedTuple):
    """One row of ``acks``: an operator acknowledged incidents (``kvwatch ack``). ``incident``:
    one incident, by the id of any of its findings; else every incident whose first finding
    falls in [``since``, ``until``) (either end open when null). An acknowledgement covers
    what the journal held when it was made (``ts``; findings up to id ``upto``): a finding
    stored after it raises the alarm again."""

    ts: float
    by: str
    upto: int
    incident: int | None = None
    since: float | None = None
    until: float | None = None


class RejectRow(NamedTuple):
    """One row of ``rejects``: a frame, record or file the reader did not store, and why. A
    dead-lettered record (reason "internal") names its producer and sequence number."""

    ts: float
    segment: str
    offset: int
    length: int
    reason: str
    message: str
    producer: str | None = None
    seq: int | None = None


#: A field's SQL type: lists and dicts (a finding's pages and detail) are stored as JSON text.
_SQL_TYPES: Final = {float: "REAL", int: "INTEGER", str: "TEXT", list: "TEXT", dict: "TEXT"}


#: The value a column added to an older journal gives the rows it already holds.
_SQL_DEFAULTS: Final = {float: "0.0", int: "0", str: "''", list: "'[]'", dict: "'{}'"}


def _column_types(row: type) -> dict[str, tuple[type, bool]]:
    """Each field's base type (``list[int]`` -> list) and whether it may be null."""
    out = {}
    for name, hint in get_type_hints(row).items():
        args = get_args(hint)
        optional = type(None) in args
        base = next(a for a in args if a is not type(None)) if optional else hint
        out[name] = (getattr(base, "__origin__", base), optional)
    return out


def _columns(row: type, names: tuple[str, ...] | None = None) -> str:
    types = _column_types(row)
    return ", ".join(
        f"{name} {_SQL_TYPES[base]}{'' if optional else ' NOT NULL'}"
        for name, (base, optional) in types.items()
        if names is None or name in names
    )


def _default(name: str) -> str:
    """What a finding's column reads as where a journal older than the field lacks it."""
    base, optional = _column_types(Finding)[name]
    return "NULL" if optional else _SQL_DEFAULTS[base]


#: The columns of ``incidents``: a finding's fields but its ``id`` (the row's) and its
#: ``sources`` (its ``exposures`` rows). The producer's labels first: a run of one producer's
#: findings binds them once per INSERT (see _insert_findings).
_SHARED: Final = ("node", "role", "engine", "engine_version", "model", "rank", "producer")
_JSON: Final = ("pages", "detail")
_OWN: Final = tuple(f for f in FINDING_FIELDS if f not in (*_SHARED, *_JSON, "id", "sources"))
FINDING_COLUMNS: Final = (*_SHARED, *_OWN, *_JSON)
_shared_of: Final = attrgetter(*_SHARED)
_own_of: Final = attrgetter(*_OWN)
#: A row of the SELECT (``id``, then FINDING_COLUMNS) -> the Finding's arguments, in order.
_FROM_ROW: Final = tuple(
    None if f == "sources" else (1 + FINDING_COLUMNS.index(f) if f != "id" else 0)
    for f in FINDING_FIELDS
)
_JSON_AT: Final = tuple(FINDING_FIELDS.index(f) for f in _JSON)


def _insert(table: str, row: type[tuple[Any, ...]]) -> str:
    fields: tuple[str, ...] = row._fields  # type: ignore[attr-defined]
    return f"INSERT INTO {table} ({', '.join(fields)})"


#: Rows per INSERT on the hot path (records, findings). One multi-row ``VALUES`` statement binds
#: the same parameters as a row-by-row ``executemany`` but runs the statement once per chunk
#: (the figures: docs/performance.md, "The daemon's catch-up").
ROWS_PER_INSERT: Final = 64


class _Insert:
    """``INSERT INTO ...`` for rows of ``width`` values: whole chunks of ``ROWS_PER_INSERT`` rows
    as one statement each, the rest row by row. Row order, and so rowid order, is kept."""

    def __init__(self, head: str, width: int) -> None:
        self.one = f"{head} VALUES ({', '.join('?' * width)})"
        row = f"({', '.join('?' * width)})"
        self.many = f"{head} VALUES {', '.join([row] * ROWS_PER_INSERT)}"

    def __call__(self, db: sqlite3.Connection, rows: Sequence[Sequence[Any]]) -> None:
        # A row of the wrong width fails its chunk's parameter count, as it would alone.
        full = len(rows) - len(rows) % ROWS_PER_INSERT
        if full:
            db.executemany(
                self.many,
                [
                    list(chain.from_iterable(rows[first : first + ROWS_PER_INSERT]))
                    for first in range(0, full, ROWS_PER_INSERT)
                ],
            )
        if full < len(rows):
            db.executemany(self.one, rows[full:])


#: Findings per INSERT: ROWS_PER_INSERT, fewer if a chunk's parameters would pass 999 (the
#: smallest limit a SQLite build has had), whatever fields Finding gains.
_FINDING_ROWS: Final = min(
    ROWS_PER_INSERT, (999 - len(_SHARED)) // (len(FINDING_COLUMNS) - len(_SHARED))
)


def _findings_insert() -> tuple[str, str]:
    """The INSERTs of findings: one row, and ``_FINDING_ROWS`` rows that share the producer's
    labels, bound once (``?1``.. ``?7``): binding a parameter is most of what a row costs
    SQLite (docs/performance.md)."""
    head = f"INSERT INTO incidents ({', '.join(FINDING_COLUMNS)})"
    common, own = len(_SHARED), len(FINDING_COLUMNS) - len(_SHARED)
    shared = ", ".join(f"?{i + 1}" for i in range(common))
    rows = (
        f"({shared}, {', '.join(f'?{common + k * own + i + 1}' for i in range(own))})"
        for k in range(_FINDING_ROWS)
    )
    return (
        f"{head} VALUES ({', '.join('?' * len(FINDING_COLUMNS))})",
        f"{head} VALUES {', '.join(rows)}",
    )


_INSERT_FINDING, _INSERT_FINDINGS = _findings_insert()


def _insert_findings(db: sqlite3.Connection, findings: list[Finding]) -> None:
    """Insert ``findings`` in order (ids follow it): runs of one producer's labels in chunks of
    ``_FINDING_ROWS`` rows, the rest row by row. A chunk's pages and details are encoded in one
    call each (one line per finding), and the runs found in C (groupby): per finding, this is
    what the catch-up spends outside SQLite (docs/performance.md)."""
    rows = _FINDING_ROWS
    for common, run in groupby(findings, _shared_of):
        group = list(run)
        full = len(group) - len(group) % rows
        chunks = []
        for first in range(0, full, rows):
            flat = list(common)
            for own in _own_rows(group[first : first + rows]):
                flat += own
            chunks.append(flat)
        if chunks:
            db.executemany(_INSERT_FINDINGS, chunks)
        if full < len(group):
            db.executemany(_INSERT_FINDING, [(*common, *own) for own in _own_rows(group[full:])])


def _own_rows(findings: list[Finding]) -> Iterator[tuple[Any, ...]]:
    """Each finding's own columns (``_OWN``, then pages and detail as JSON text)."""
    pages = _encode_lines([f.pages for f in findings]).decode().split("\n")
    details = _encode_lines([f.detail for f in findings]).decode().split("\n")
    for own, page, detail in zip(map(_own_of, findings), pages, details):  # noqa: B905 (a split's last item is empty)
        yield (*own, page, detail)


def _exposures(findings: list[Finding]) -> list[tuple[Any, ...]]:
    """The ``exposures`` rows of ``findings``: one per source (a reader -> source edge)."""
    return [
        (f.producer, f.seq, f.ts, s.request_id, s.instance, s.pages, s.written_at)
        for f in findings
        if f.sources
        for s in f.sources
    ]


def _select(table: str, row: type[tuple[Any, ...]]) -> str:
    fields: tuple[str, ...] = row._fields  # type: ignore[attr-defined]
    return f"SELECT {', '.join(fields)} FROM {table}"


_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS producers (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE,
    engine TEXT, engine_version TEXT, role TEXT, model TEXT, rank INTEGER, node TEXT,
    pid INTEGER, first_seen REAL, last_ts REAL, last_seq INTEGER NOT NULL,
    counters TEXT NOT NULL, gauges TEXT NOT NULL, retired INTEGER NOT NULL, retired_at REAL
);
CREATE TABLE IF NOT EXISTS segments (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, producer TEXT NOT NULL,
    idx INTEGER NOT NULL, offset INTEGER NOT NULL, sealed INTEGER NOT NULL,
    finished INTEGER NOT NULL, removed INTEGER NOT NULL, rejects INTEGER NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS records (
    producer INTEGER NOT NULL, seq INTEGER NOT NULL, type TEXT NOT NULL, ts REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS incidents (
    id INTEGER PRIMARY KEY, {_columns(Finding, FINDING_COLUMNS)}
);
CREATE INDEX IF NOT EXISTS incidents_ts ON incidents (ts);
CREATE TABLE IF NOT EXISTS exposures (id INTEGER PRIMARY KEY, {_columns(ExposureRow)});
CREATE INDEX IF NOT EXISTS exposures_reader ON exposures (producer, seq);
CREATE TABLE IF NOT EXISTS rejects (id INTEGER PRIMARY KEY, {_columns(RejectRow)});
CREATE TABLE IF NOT EXISTS acks (id INTEGER PRIMARY KEY, {_columns(AckRow)});
CREATE TABLE IF NOT EXISTS gaps (
    id INTEGER PRIMARY KEY, ts REAL NOT NULL, producer TEXT NOT NULL,
    first_seq INTEGER NOT NULL, last_seq INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS counters (
    name TEXT NOT NULL, labels TEXT NOT NULL, value REAL NOT NULL, PRIMARY KEY (name, labels)
);
"""
#: Schema 1 -> 2: one word for the node; the request instance; dead letters name their record;
#: pages as a JSON array (what the reader encodes fastest).
_MIGRATE_1: Final = (
    "ALTER TABLE producers RENAME COLUMN host TO node",
    "UPDATE incidents SET pages = '[' || pages || ']'",
    "ALTER TABLE incidents ADD COLUMN instance TEXT",
    "ALTER TABLE rejects ADD COLUMN producer TEXT",
    "ALTER TABLE rejects ADD COLUMN seq INTEGER",
)
#: Schema 2 -> 3: the sources an incident's reader was exposed to (``exposures``, created with
#: the schema, and the count of the unnamed rest on the incident).
_MIGRATE_2: Final = (
    "ALTER TABLE incidents ADD COLUMN other_sources INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE incidents ADD COLUMN other_source_pages INTEGER NOT NULL DEFAULT 0",
)
#: Schema 3 -> 4: acknowledgements (``acks``, created with the schema).
_MIGRATE_3: Final = ()
_MIGRATIONS: Final = {1: _MIGRATE_1, 2: _MIGRATE_2, 3: _MIGRATE_3}
_INSERT_ACK: Final = _insert("acks", AckRow) + " VALUES (?, ?, ?, ?, ?, ?)"
_SELECT_ACKS: Final = _select("acks", AckRow) + " ORDER BY id"
_insert_records: Final = _Insert("INSERT INTO records", 4)
_insert_exposures: Final = _Insert(_insert("exposures", ExposureRow), len(ExposureRow._fields))
_SELECT_EXPOSURES: Final = _select("exposures", ExposureRow)
_INSERT_REJECT: Final = _Insert(_insert("rejects", RejectRow), len(RejectRow._fields)).one
_PRODUCER_COLUMNS: Final = (
    "id, name, engine, engine_version, role, model, rank, node, pid, first_seen, last_ts,"
    " last_seq, counters, gauges, retired, retired_at"
)
_decode_counters: Final = msgspec.json.Decoder(list[CounterSeries]).decode
_encode_json: Final = msgspec.json.Encoder().encode
_encode_lines: Final = msgspec.json.Encoder().encode_lines
_decode_json: Final = msgspec.json.Decoder().decode

_SEP: Final = "\x1f"  # joins label values in the counters table


@dataclass(frozen=True, slots=True)
class Stored:
    """What one commit stored of findings (:meth:`Journal.commit`): ``findings`` with ids
    ``first`` and up, or ``first`` 0 when SQLite's ids for them could not be checked (the
    incidents log then reads them back)."""

    first: int
    findings: list[Finding]


def _labels_text(labels: LabelKey) -> str:
    return _SEP.join(labels)


def _labels_key(text: str) -> LabelKey:
    return tuple(text.split(_SEP)) if text else ()


@dataclass
class Batch:
    """What one transaction writes: rows to add and the state rows they change."""

    records: list[tuple[int, int, str, float]] = field(default_factory=list)
    #: Findings to store; their sources become ``exposures`` rows.
    findings: list[Finding] = field(default_factory=list)
    rejects: list[RejectRow] = field(default_factory=list)
    gaps: list[tuple[float, str, int, int]] = field(default_factory=list)
    segments: dict[str, Segment] = field(default_factory=dict)
    producers: dict[str, Producer] = field(default_factory=dict)
    #: Daemon counters whose value changed (written as absolute values).
    counters: set[tuple[str, LabelKey]] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(
            self.records
            or self.rejects
            or self.gaps
            or self.segments
            or self.producers
            or self.counters
        )


class JournalError(RuntimeError):
    pass


#: The tables a kvwatch journal has (a start interrupted before its schema row wrote some).
_OWN_TABLES: Final = frozenset(
    {"meta", "producers", "segments", "records", "incidents", "exposures", "rejects", "gaps"}
    | {"counters", "acks"}
)


def _not_a_journal(path: Path, db: sqlite3.Connection) -> str | None:
    """Why the database ``db`` has open at ``path`` is not a kvwatch journal (an empty file or
    database is a new one), or None.

    Checked before anything is written: another program's SQLite file must not get kvwatch's
    tables, nor be switched to WAL mode. SQLite itself reads the header: opening and closing the
    file here would drop every POSIX lock this process's SQLite connections hold on it (they
    are per process), and another process could then delete the daemon's WAL under it."""
    try:
        tables = {
            row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
    except sqlite3.DatabaseError as exc:
        if "not a database" not in str(exc):
            raise
        return f"{path} is not a kvwatch journal (not an SQLite database); give another path"
    if "meta" in tables and db.execute("SELECT 1 FROM meta WHERE key = 'schema'").fetchone():
        return None
    if tables - _OWN_TABLES:
        shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
        return (
            f"{path} is an SQLite database but not a kvwatch journal (tables: {shown}); "
            "give another path"
        )
    return None


class Journal:
    """One SQLite database; the daemon's connection writes, ``readonly=True`` is for queries."""

    def __init__(self, path: str | Path, *, readonly: bool = False) -> None:
        self.path = Path(path)
        if readonly:
            self._open_readonly()
            return
        self.schema = SCHEMA_VERSION
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None)
        foreign = _not_a_journal(self.path, self.db)
        if foreign:
            self.db.close()
            raise JournalError(foreign)
        mode = self.db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise JournalError(f"{self.path}: SQLite refused WAL mode ({mode})")
        # NORMAL in WAL mode: a committed transaction survives a kill -9 of the daemon; only
        # a power loss can roll back the last ones, records and positions together (and the
        # spool on tmpfs goes with the power anyway).
        self.db.execute("PRAGMA synchronous = NORMAL")
        self.db.execute("PRAGMA busy_timeout = 5000")
        has_meta = self.db.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
        ).fetchone()
        row = has_meta and self.db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        if row and int(row[0]) in _MIGRATIONS:
            self.db.execute("BEGIN IMMEDIATE")
            for version in range(int(row[0]), SCHEMA_VERSION):
                for statement in _MIGRATIONS[version]:
                    self.db.execute(statement)
            self.db.execute(
                "UPDATE meta SET value = ? WHERE key = 'schema'", (str(SCHEMA_VERSION),)
            )
            self.db.execute("COMMIT")
        elif row and int(row[0]) != SCHEMA_VERSION:
            raise JournalError(f"{self.path}: journal schema {row[0]}, expected {SCHEMA_VERSION}")
        self.db.executescript(_SCHEMA)
        # A field added to Finding is a column added to a journal that predates it.
        for name in sorted(set(FINDING_COLUMNS) - self._finding_columns()):
            default = _default(name)
            column = _columns(Finding, (name,)) + (
                "" if default == "NULL" else f" DEFAULT {default}"
            )
            self.db.execute(f"ALTER TABLE incidents ADD COLUMN {column}")
        if not row:
            self.db.execute(
                "INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),)
            )
        # Names this journal in the incidents log, whose high-water mark is only valid for it.
        self.db.execute("INSERT OR IGNORE INTO meta VALUES ('journal_id', ?)", (uuid.uuid4().hex,))

    def _open_readonly(self) -> None:
        """A query connection (``kvwatch incidents``, ``ack``, the status page): never
        writes, refuses what is not a kvwatch journal."""
        if not self.path.exists():
            raise JournalError(f"no journal at {self.path}")
        if self.path.is_file() and self.path.stat().st_size == 0:
            raise JournalError(
                f"{self.path} is empty: no kvwatch daemon has started on it (give the "
                "daemon's journal)"
            )
        uri = f"file:{self.path}?mode=ro"
        self.db = sqlite3.connect(uri, uri=True, isolation_level=None)
        self.db.execute("PRAGMA query_only = ON")
        foreign = _not_a_journal(self.path, self.db)
        if foreign:
            self.db.close()
            raise JournalError(foreign)
        if not self.db.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
        ).fetchone():
            self.db.close()
            raise JournalError(
                f"{self.path} is an SQLite database but not a kvwatch journal (no kvwatch "
                "tables); give the daemon's journal"
            )
        schema = self.meta("schema")
        # A reader may hold a journal the daemon has not migrated yet (a copy from another
        # node, an older kvwatch): schema 2 reads as one without sources, 3 as one without
        # acknowledgements.
        self.schema = int(schema) if schema is not None and schema.isdigit() else 0
        if self.schema not in (2, 3, SCHEMA_VERSION):
            raise JournalError(
                f"{self.path}: journal schema {schema}, expected 2 to {SCHEMA_VERSION}"
            )

    def close(self) -> None:
        self.db.close()

    # -- loading ------------------------------------------------------------------------------

    def load(self) -> State:
        """The state as last committed."""
        state = State()
        for row in self.db.execute(f"SELECT {_PRODUCER_COLUMNS} FROM producers ORDER BY id"):
            producer = Producer(
                name=row[1],
                id=row[0],
                engine=row[2],
                engine_version=row[3],
                role=row[4],
                model=row[5],
                rank=row[6],
                node=row[7] or "",
                pid=row[8],
                first_seen=row[9],
                last_ts=row[10],
                last_seq=row[11],
                counters=_decode_counters(row[12]),
                gauges=json.loads(row[13]),
                retired=bool(row[14]),
                retired_at=row[15] or 0.0,
            )
            state.producers[producer.name] = producer
            state.next_producer_id = max(state.next_producer_id, producer.id + 1)
        row = self.db.execute("SELECT value FROM meta WHERE key = 'next_producer_id'").fetchone()
        if row is not None:
            state.next_producer_id = max(state.next_producer_id, int(row[0]))
        # Removed segments stay in the table for the retention, not in memory.
        for row in self.db.execute(
            "SELECT id, name, producer, idx, offset, sealed, finished, removed, rejects"
            " FROM segments WHERE removed = 0"
        ):
            segment = Segment(
                name=row[1],
                id=row[0],
                producer=row[2],
                index=row[3],
                offset=row[4],
                sealed=bool(row[5]),
                finished=bool(row[6]),
                removed=bool(row[7]),
                rejects=row[8],
            )
            state.segments[segment.name] = segment
        state.next_segment_id = int(self.scalar("SELECT coalesce(max(id), 0) FROM segments")) + 1
        for name, labels, value in self.db.execute("SELECT name, labels, value FROM counters"):
            key = (name, _labels_key(labels))
            if name.startswith("base:"):
                state.base[(name[5:], key[1])] = value
            else:
                state.daemon[key] = value
        row = self.db.execute("SELECT max(ts) FROM records").fetchone()
        state.last_record_ts = float(row[0] or 0.0)
        return state

    # -- writing ------------------------------------------------------------------------------

    def commit(self, batch: Batch, state: State) -> Stored | None:
        """Write ``batch`` in one transaction; on any error nothing of it is written. Returns
        the findings it stored, with their ids (None: none)."""
        db = self.db
        now = time.time()
        try:
            db.execute("BEGIN IMMEDIATE")
            if batch.records:
                _insert_records(db, batch.records)
            first = 0
            findings = batch.findings
            if findings:
                # No AUTOINCREMENT: SQLite gives a row max(id) + 1, so rows inserted in order
                # take the ids after it (checked: the last one must be first + n - 1).
                first = db.execute("SELECT coalesce(max(id), 0) + 1 FROM incidents").fetchone()[0]
                _insert_findings(db, findings)
                last = db.execute("SELECT last_insert_rowid()").fetchone()[0]
                first = first if last == first + len(findings) - 1 else 0
                exposures = _exposures(findings)
                if exposures:
                    _insert_exposures(db, exposures)
            if batch.rejects:
                db.executemany(_INSERT_REJECT, batch.rejects)
            if batch.gaps:
                db.executemany(
                    "INSERT INTO gaps (ts, producer, first_seq, last_seq) VALUES (?, ?, ?, ?)",
                    batch.gaps,
                )
            if batch.producers:
                db.executemany(
                    f"INSERT OR REPLACE INTO producers ({_PRODUCER_COLUMNS})"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [_producer_row(p) for p in batch.producers.values()],
                )
            if batch.segments:
                db.executemany(
                    "INSERT OR REPLACE INTO segments VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [_segment_row(s, now) for s in batch.segments.values()],
                )
            if batch.counters:
                db.executemany(
                    "INSERT OR REPLACE INTO counters VALUES (?, ?, ?)",
                    [(n, _labels_text(k), state.daemon[(n, k)]) for n, k in batch.counters],
                )
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        return Stored(first, findings) if findings else None

    def prune(
        self,
        state: State,
        *,
        now: float,
        retention: float,
        records_retention: float,
        max_retired: int = MAX_RETIRED_PRODUCERS,
    ) -> int:
        """Drop what is older than the retention; fold retired producers' counters into the base.

        A retired producer (no segment left: its process is gone) is folded once its accounting
        rows are gone, or earlier, oldest first, while more than ``max_retired`` are kept: the
        daemon's memory must not grow with every engine restart. Returns the rows deleted.
        """
        cutoff = now - retention
        deleted = 0
        db = self.db
        try:
            db.execute("BEGIN IMMEDIATE")
            for table in ("incidents", "exposures", "rejects", "gaps", "acks"):
                deleted += db.execute(f"DELETE FROM {table} WHERE ts < ?", (cutoff,)).rowcount
            if db.execute("SELECT 1 FROM incidents LIMIT 1").fetchone() is None:
                # SQLite hands out finding ids from 1 again: no acknowledgement may cover them.
                deleted += db.execute("DELETE FROM acks").rowcount
            # Rows are appended in commit order, so their rowids follow time (closely enough: a
            # skewed producer clock only delays a deletion): delete below the first row inside
            # the retention. A plain "WHERE ts < ?" scans the whole table (no index on ts, which
            # every insert would pay for), stalling the reader for seconds.
            deleted += db.execute(
                "DELETE FROM records WHERE rowid < coalesce("
                " (SELECT rowid FROM records WHERE ts >= ? ORDER BY rowid LIMIT 1),"
                " (SELECT max(rowid) + 1 FROM records))",
                (now - records_retention,),
            ).rowcount
            deleted += db.execute(
                "DELETE FROM segments WHERE removed = 1 AND updated < ?", (cutoff,)
            ).rowcount
            retired = sorted(
                (p for p in state.producers.values() if p.retired), key=lambda p: p.retired_at
            )
            excess = len(retired) - max_retired
            fold_before = now - min(retention, records_retention)
            gone = [
                p
                for i, p in enumerate(retired)
                if p.retired_at < fold_before or (i < excess and p.retired_at < now - RETIRED_GRACE)
            ]
            folded: Totals = totals()
            for producer in gone:
                for family, labels, value in producer_counter_series(producer):
                    folded[(family, labels)] += value
            base = totals()
            base.update(state.base)
            for key, value in folded.items():
                base[key] += value
            db.executemany(
                "INSERT OR REPLACE INTO counters VALUES (?, ?, ?)",
                [("base:" + f, _labels_text(k), base[(f, k)]) for f, k in folded],
            )
            db.executemany("DELETE FROM producers WHERE id = ?", [(p.id,) for p in gone])
            # A folded producer's id may still be on its records rows: never hand it out again.
            db.execute(
                "INSERT OR REPLACE INTO meta VALUES ('next_producer_id', ?)",
                (str(state.next_producer_id),),
            )
            deleted += len(gone)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        with state.lock:
            state.base = base
            for producer in gone:
                del state.producers[producer.name]
            kept = {row[0] for row in self.db.execute("SELECT name FROM segments")}
            for name in [n for n in state.segments if n not in kept]:
                del state.segments[name]
        return deleted

    # -- queries ------------------------------------------------------------------------------

    def incidents(
        self,
        *,
        since: float | None = None,
        until: float | None = None,
        detector: str | None = None,
        after_id: int | None = None,
        before_id: int | None = None,
        limit: int | None = None,
    ) -> list[Finding]:
        """Findings in time order (``after_id``: in id order, those after it, and before
        ``before_id``), each with the journal's row ``id`` and its ``sources`` (the exposures,
        most pages first)."""
        have = self._finding_columns()  # an older journal (read only) lacks newer fields
        columns = (name if name in have else _default(name) for name in FINDING_COLUMNS)
        sql = f"SELECT id, {', '.join(columns)} FROM incidents"
        where: list[str] = []
        args: list[Any] = []
        for clause, value in (
            ("ts >= ?", since),
            ("ts < ?", until),
            ("detector = ?", detector),
            ("id > ?", after_id),
            ("id < ?", before_id),
        ):
            if value is not None:
                where.append(clause)
                args.append(value)
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id" if after_id is not None else " ORDER BY ts, id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        out = []
        decode, at = _decode_json, _FROM_ROW
        for row in self.db.execute(sql, args):
            values = [[] if k is None else row[k] for k in at]
            for k in _JSON_AT:
                values[k] = decode(values[k])
            out.append(Finding(*values))
        if out and self.schema >= 3:
            self._attach_sources(out)
        return out

    def _finding_columns(self) -> set[str]:
        return {row[1] for row in self.db.execute("PRAGMA table_info(incidents)")}

    def newest_finding_id(self) -> int:
        """The id of the newest finding stored (0: none)."""
        return int(self.scalar("SELECT coalesce(max(id), 0) FROM incidents"))

    def holds(self, finding_id: int, producer: str, seq: int) -> bool:
        """Whether the finding ``finding_id`` here is the record (``producer``, ``seq``)."""
        return bool(
            self.scalar(
                "SELECT 1 FROM incidents WHERE id = ? AND producer = ? AND seq = ?",
                (finding_id, producer, seq),
            )
        )

    def acks(self) -> list[AckRow]:
        """Every acknowledgement, oldest first (none in a journal older than schema 4)."""
        if self.schema < 4:
            return []
        return [AckRow(*row) for row in self.db.execute(_SELECT_ACKS)]

    def gaps(self, since: float | None) -> list[tuple[float, int]]:
        """Each gap in sequence numbers seen since ``since`` (all: None): when, and how many
        records it lost."""
        sql = "SELECT ts, last_seq - first_seq + 1 FROM gaps"
        args: tuple[float, ...] = ()
        if since is not None:
            sql, args = sql + " WHERE ts >= ?", (since,)
        return [(float(t), int(n)) for t, n in self.db.execute(sql + " ORDER BY ts", args)]

    def _attach_sources(self, findings: list[Finding]) -> None:
        by_reader = {(f.producer, f.seq): f for f in findings}
        low = min(f.ts for f in findings)
        high = max(f.ts for f in findings)
        # An edge has its incident's time: one scan of the time range finds them all.
        for row in self.db.execute(
            _SELECT_EXPOSURES + " WHERE ts >= ? AND ts <= ? ORDER BY pages DESC, id", (low, high)
        ):
            edge = ExposureRow(*row)
            reader = by_reader.get((edge.producer, edge.seq))
            if reader is not None:
                reader.sources.append(
                    Source(
                        request_id=edge.request_id,
                        pages=edge.pages,
                        instance=edge.instance,
                        written_at=edge.written_at,
                    )
                )

    def meta(self, key: str) -> str | None:
        value = self.scalar("SELECT value FROM meta WHERE key = ?", (key,))
        return None if value is None else str(value)

    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def scalar(self, sql: str, args: Iterable[Any] = ()) -> Any:
        row = self.db.execute(sql, tuple(args)).fetchone()
        return None if row is None else row[0]


def acknowledge(path: str | Path, ack: AckRow) -> None:
    """Store ``ack`` in the journal at ``path`` (``kvwatch ack``): a connection of its own
    beside the daemon's (WAL lets the two write in turn), that creates nothing."""
    db = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=10.0, isolation_level=None)
    try:
        db.execute(_INSERT_ACK, ack)
    finally:
        db.close()


def _producer_row(p: Producer) -> tuple[Any, ...]:
    return (
        p.id,
        p.name,
        p.engine,
        p.engine_version,
        p.role,
        p.model,
        p.rank,
        p.node,
        p.pid,
        p.first_seen,
        p.last_ts,
        p.last_seq,
        _encode_json(p.counters).decode(),
        _encode_json(p.gauges).decode(),
        int(p.retired),
        p.retired_at,
    )


def _segment_row(s: Segment, now: float) -> tuple[Any, ...]:
    return (
        s.id,
        s.name,
        s.producer,
        s.index,
        s.offset,
        int(s.sealed),
        int(s.finished),
        int(s.removed),
        s.rejects,
        now,
    )
