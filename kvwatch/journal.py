"""The incident journal: SQLite in WAL mode, the daemon's durable memory.

Every accepted spool record is committed here together with the read position that follows it, in
one transaction, so a ``kill -9`` of the daemon at any moment neither loses nor repeats a record:
after a restart the reader resumes from the committed position. Detection events land in
``incidents`` (what an operator hands to the disclosure team); every record leaves a row in
``records`` (producer, sequence number, type, time) for accounting. Nothing here holds prompt
text, token ids or KV bytes: the spool schema carries none, and rejected frames are recorded by
position and reason only.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kvwatch.state import (
    LabelKey,
    Producer,
    Segment,
    State,
    Totals,
    producer_counter_series,
    totals,
)

SCHEMA_VERSION: Final = 1
#: Retired producers kept in memory (and in the producers table) before the oldest are folded.
MAX_RETIRED_PRODUCERS: Final = 1024
#: A retired producer is never folded sooner: one whose spool directory was removed comes back
#: with new segments within seconds, and folding it would count its counters twice.
RETIRED_GRACE: Final = 600.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS producers (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE,
    engine TEXT, engine_version TEXT, role TEXT, model TEXT, rank INTEGER, host TEXT,
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
    id INTEGER PRIMARY KEY, ts REAL NOT NULL, node TEXT, role TEXT, engine TEXT,
    engine_version TEXT, model TEXT, rank INTEGER, producer TEXT NOT NULL, seq INTEGER NOT NULL,
    request_id TEXT NOT NULL, detector TEXT NOT NULL, kind TEXT NOT NULL, mode TEXT,
    action TEXT, pages TEXT NOT NULL, pages_total INTEGER NOT NULL, detail TEXT NOT NULL,
    instance TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS incidents_ts ON incidents (ts);
CREATE TABLE IF NOT EXISTS rejects (
    id INTEGER PRIMARY KEY, ts REAL NOT NULL, segment TEXT NOT NULL, offset INTEGER NOT NULL,
    length INTEGER NOT NULL, reason TEXT NOT NULL, message TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS gaps (
    id INTEGER PRIMARY KEY, ts REAL NOT NULL, producer TEXT NOT NULL,
    first_seq INTEGER NOT NULL, last_seq INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS counters (
    name TEXT NOT NULL, labels TEXT NOT NULL, value REAL NOT NULL, PRIMARY KEY (name, labels)
);
"""

_SEP: Final = "\x1f"  # joins label values in the counters table


def _labels_text(labels: LabelKey) -> str:
    return _SEP.join(labels)


def _labels_key(text: str) -> LabelKey:
    return tuple(text.split(_SEP)) if text else ()


@dataclass
class Batch:
    """What one transaction writes: rows to add and the state rows they change."""

    records: list[tuple[int, int, str, float]] = field(default_factory=list)
    incidents: list[tuple[Any, ...]] = field(default_factory=list)
    rejects: list[tuple[float, str, int, int, str, str]] = field(default_factory=list)
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


class Journal:
    """One SQLite database; the daemon's connection writes, ``readonly=True`` is for queries."""

    def __init__(self, path: str | Path, *, readonly: bool = False) -> None:
        self.path = Path(path)
        if readonly:
            if not self.path.exists():
                raise JournalError(f"no journal at {self.path}")
            uri = f"file:{self.path}?mode=ro"
            self.db = sqlite3.connect(uri, uri=True, isolation_level=None)
            self.db.execute("PRAGMA query_only = ON")
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None)
        mode = self.db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise JournalError(f"{self.path}: SQLite refused WAL mode ({mode})")
        # NORMAL in WAL mode: a committed transaction survives a kill -9 of the daemon; only
        # a power loss can roll back the last ones, records and positions together (and the
        # spool on tmpfs goes with the power anyway).
        self.db.execute("PRAGMA synchronous = NORMAL")
        self.db.execute("PRAGMA busy_timeout = 5000")
        self.db.executescript(_SCHEMA)
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(incidents)")}
        if "instance" not in columns:  # a journal written before events carried instances
            self.db.execute("ALTER TABLE incidents ADD COLUMN instance TEXT NOT NULL DEFAULT ''")
        row = self.db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        if row is None:
            self.db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        elif int(row[0]) != SCHEMA_VERSION:
            raise JournalError(f"{self.path}: journal schema {row[0]}, expected {SCHEMA_VERSION}")

    def close(self) -> None:
        self.db.close()

    # -- loading ------------------------------------------------------------------------------

    def load(self) -> State:
        """The state as last committed."""
        state = State()
        for row in self.db.execute(
            "SELECT id, name, engine, engine_version, role, model, rank, host, pid, first_seen,"
            " last_ts, last_seq, counters, gauges, retired, retired_at FROM producers ORDER BY id"
        ):
            producer = Producer(
                name=row[1],
                id=row[0],
                engine=row[2],
                engine_version=row[3],
                role=row[4],
                model=row[5],
                rank=row[6],
                host=row[7],
                pid=row[8],
                first_seen=row[9],
                last_ts=row[10],
                last_seq=row[11],
                counters=json.loads(row[12]),
                gauges=json.loads(row[13]),
                retired=bool(row[14]),
                retired_at=row[15] or 0.0,
            )
            state.producers[producer.name] = producer
            state.next_producer_id = max(state.next_producer_id, producer.id + 1)
            if not producer.retired:
                state.models(producer.model)
                state.versions(producer.engine_version)
                state.ranks(producer.rank)
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

    def commit(self, batch: Batch, state: State) -> None:
        """Write ``batch`` in one transaction; on any error nothing of it is written."""
        db = self.db
        now = time.time()
        try:
            db.execute("BEGIN IMMEDIATE")
            if batch.records:
                db.executemany("INSERT INTO records VALUES (?, ?, ?, ?)", batch.records)
            if batch.incidents:
                db.executemany(
                    "INSERT INTO incidents (ts, node, role, engine, engine_version, model, rank,"
                    " producer, seq, request_id, detector, kind, mode, action, pages, pages_total,"
                    " detail, instance) VALUES"
                    " (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    batch.incidents,
                )
            if batch.rejects:
                db.executemany(
                    "INSERT INTO rejects (ts, segment, offset, length, reason, message)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    batch.rejects,
                )
            if batch.gaps:
                db.executemany(
                    "INSERT INTO gaps (ts, producer, first_seq, last_seq) VALUES (?, ?, ?, ?)",
                    batch.gaps,
                )
            if batch.producers:
                db.executemany(
                    "INSERT OR REPLACE INTO producers VALUES"
                    " (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
            for table in ("incidents", "rejects", "gaps"):
                deleted += db.execute(f"DELETE FROM {table} WHERE ts < ?", (cutoff,)).rowcount
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
        self, *, since: float | None = None, detector: str | None = None
    ) -> list[dict[str, Any]]:
        sql = (
            "SELECT ts, node, role, engine, engine_version, model, rank, producer, seq,"
            " request_id, detector, kind, mode, action, pages, pages_total, detail, instance"
            " FROM incidents"
        )
        where: list[str] = []
        args: list[Any] = []
        if since is not None:
            where.append("ts >= ?")
            args.append(since)
        if detector is not None:
            where.append("detector = ?")
            args.append(detector)
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY ts, id"
        out = []
        for row in self.db.execute(sql, args):
            out.append(
                {
                    "time": row[0],
                    "node": row[1],
                    "role": row[2],
                    "engine": row[3],
                    "engine_version": row[4],
                    "model": row[5],
                    "rank": row[6],
                    "producer": row[7],
                    "seq": row[8],
                    "request_id": row[9],
                    "detector": row[10],
                    "kind": row[11],
                    "mode": row[12],
                    "action": row[13],
                    "pages": [int(p) for p in row[14].split(",") if p],
                    "pages_total": row[15],
                    "detail": json.loads(row[16]),
                    "instance": row[17],
                }
            )
        return out

    def scalar(self, sql: str, args: Iterable[Any] = ()) -> Any:
        row = self.db.execute(sql, tuple(args)).fetchone()
        return None if row is None else row[0]


def _producer_row(p: Producer) -> tuple[Any, ...]:
    return (
        p.id,
        p.name,
        p.engine,
        p.engine_version,
        p.role,
        p.model,
        p.rank,
        p.host,
        p.pid,
        p.first_seen,
        p.last_ts,
        p.last_seq,
        json.dumps(p.counters, separators=(",", ":")),
        json.dumps(p.gauges, separators=(",", ":")),
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
