"""The journal's tables: their rows (the ones named by a type), the ``incidents`` columns
derived from :class:`~kvwatch.store.incident.Finding`, the schema, its migrations, and the check
that a file is a kvwatch journal before anything is written to it. Part of the journal package,
the only place with SQL (see the package).
"""

from __future__ import annotations

import sqlite3
from operator import attrgetter
from pathlib import Path
from typing import Any, Final, NamedTuple, get_args, get_type_hints

from kvwatch.store.incident import FINDING_FIELDS, Finding

SCHEMA_VERSION: Final = 5


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


def _select(table: str, row: type[tuple[Any, ...]]) -> str:
    fields: tuple[str, ...] = row._fields  # type: ignore[attr-defined]
    return f"SELECT {', '.join(fields)} FROM {table}"


#: Schema 5 renamed the daemon's finding counter (kvwatch_incidents_total counted findings, not
#: incidents): a journal older than 5 has its rows under the old name.
FINDINGS_RENAMED: Final = (5, "UPDATE counters SET name = 'findings' WHERE name = 'incidents'")
#: Producer columns newer than the producers table of some journals, with their definitions.
PRODUCER_ADDED: Final = {
    "mode": "TEXT NOT NULL DEFAULT ''",
    "scrub": "TEXT NOT NULL DEFAULT ''",
    "config_errors": "TEXT NOT NULL DEFAULT '[]'",
}

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS producers (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE,
    engine TEXT, engine_version TEXT, role TEXT, model TEXT, rank INTEGER, node TEXT,
    pid INTEGER, first_seen REAL, last_ts REAL, last_seq INTEGER NOT NULL,
    counters TEXT NOT NULL, gauges TEXT NOT NULL, retired INTEGER NOT NULL, retired_at REAL,
    {", ".join(f"{name} {definition}" for name, definition in PRODUCER_ADDED.items())}
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
#: Schema 4 -> 5: how each producer's hooks run (its hello's mode, scrub and config errors):
#: columns added where missing (PRODUCER_ADDED), as a Finding's new fields are.
_MIGRATE_4: Final = ()
_MIGRATIONS: Final = {1: _MIGRATE_1, 2: _MIGRATE_2, 3: _MIGRATE_3, 4: _MIGRATE_4}
_INSERT_ACK: Final = _insert("acks", AckRow) + " VALUES (?, ?, ?, ?, ?, ?)"
_SELECT_ACKS: Final = _select("acks", AckRow) + " ORDER BY id"
_SELECT_EXPOSURES: Final = _select("exposures", ExposureRow)
_PRODUCER_COLUMNS: Final = (
    "id, name, engine, engine_version, role, model, rank, node, pid, first_seen, last_ts,"
    " last_seq, counters, gauges, retired, retired_at, mode, scrub, config_errors"
)


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
