"""The incident journal: SQLite in WAL mode, the daemon's durable memory.

Every accepted spool record is committed here together with the read position that follows it, in
one transaction, so a ``kill -9`` of the daemon at any moment neither loses nor repeats a record:
after a restart the reader resumes from the committed position. Detection events land in
``incidents`` (what an operator hands to the disclosure team); every record leaves a row in
``records`` (producer, sequence number, type, time) for accounting. Nothing here holds prompt
text, token ids or KV bytes: the spool schema carries none, and rejected frames are recorded by
position and reason only.

Every SQL statement of the daemon lives in this package: its tables, schema and migrations
(``tables``), the hot path's INSERTs and the batch (``writes``), the queries
(``queries``) and the connection with its loading, commit and prune (here). Its public names
are exported from the package.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Final

import msgspec

from kvspool.records import CounterSeries
from kvwatch.store.incident import Finding
from kvwatch.store.journal.queries import JournalQueries
from kvwatch.store.journal.tables import (
    _INSERT_ACK,
    _MIGRATIONS,
    _PRODUCER_COLUMNS,
    _SCHEMA,
    FINDING_COLUMNS,
    FINDINGS_RENAMED,
    PRODUCER_ADDED,
    SCHEMA_VERSION,
    AckRow,
    _columns,
    _default,
    _not_a_journal,
)
from kvwatch.store.journal.writes import (
    _INSERT_REJECT,
    Batch,
    Stored,
    _exposures,
    _insert_exposures,
    _insert_findings,
    _insert_records,
    _labels_key,
    _labels_text,
    _producer_row,
    _segment_row,
)
from kvwatch.store.state import (
    Producer,
    Segment,
    State,
    Totals,
    producer_counter_series,
    totals,
)

#: Retired producers kept in memory (and in the producers table) before the oldest are folded.
MAX_RETIRED_PRODUCERS: Final = 1024
#: A retired producer is never folded sooner: one whose spool directory was removed comes back
#: with new segments within seconds, and folding it would count its counters twice.
RETIRED_GRACE: Final = 600.0

_decode_counters: Final = msgspec.json.Decoder(list[CounterSeries]).decode
_decode_json: Final = msgspec.json.Decoder().decode


class JournalError(RuntimeError):
    pass


class Journal(JournalQueries):
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
        self._catch_up(int(row[0]) if row else SCHEMA_VERSION)
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
        if self.schema not in (2, 3, 4, SCHEMA_VERSION):
            raise JournalError(
                f"{self.path}: journal schema {schema}, expected 2 to {SCHEMA_VERSION}"
            )

    def _catch_up(self, was: int) -> None:
        """What a journal of schema ``was`` lacks beside the migrations: the columns added to
        Finding and Producer since, and the finding counter's new name."""
        for name in sorted(set(FINDING_COLUMNS) - self._finding_columns()):
            default = _default(name)
            column = _columns(Finding, (name,)) + (
                "" if default == "NULL" else f" DEFAULT {default}"
            )
            self.db.execute(f"ALTER TABLE incidents ADD COLUMN {column}")
        if was < FINDINGS_RENAMED[0]:
            self.db.execute(FINDINGS_RENAMED[1])
        have = {column[1] for column in self.db.execute("PRAGMA table_info(producers)")}
        for name, definition in PRODUCER_ADDED.items():
            if name not in have:
                self.db.execute(f"ALTER TABLE producers ADD COLUMN {name} {definition}")

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
                mode=row[16],
                scrub=row[17],
                config_errors=tuple(json.loads(row[18])),
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
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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


def acknowledge(path: str | Path, ack: AckRow) -> None:
    """Store ``ack`` in the journal at ``path`` (``kvwatch ack``): a connection of its own
    beside the daemon's (WAL lets the two write in turn), that creates nothing."""
    db = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=10.0, isolation_level=None)
    try:
        db.execute(_INSERT_ACK, ack)
    finally:
        db.close()
