"""The journal's writes on the hot path: the batch one transaction writes (:class:`Batch`), the
multi-row INSERTs of records and findings, and the rows of the state's producers and segments.
Part of the journal package, the only place with SQL (see the package).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain, groupby
from typing import Any, Final

import msgspec

from kvwatch.store.incident import Finding
from kvwatch.store.journal.tables import (
    _SHARED,
    FINDING_COLUMNS,
    ExposureRow,
    RejectRow,
    _insert,
    _own_of,
    _shared_of,
)
from kvwatch.store.state import LabelKey, Producer, Segment

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
            chunk = group[first : first + rows]
            flat = list(common)
            # Inline, not through _own_rows: no tuple and no generator step per finding.
            append = flat.append
            for own, page, detail in zip(map(_own_of, chunk), *_json_columns(chunk)):  # noqa: B905 (a split's last item is empty)
                flat += own
                append(page)
                append(detail)
            chunks.append(flat)
        if chunks:
            db.executemany(_INSERT_FINDINGS, chunks)
        if full < len(group):
            db.executemany(_INSERT_FINDING, [(*common, *own) for own in _own_rows(group[full:])])


def _json_columns(findings: list[Finding]) -> tuple[list[str], list[str]]:
    """The findings' pages and details as JSON text, one encode each (each list has one item
    more than ``findings``: a split's last, empty)."""
    pages = _encode_lines([f.pages for f in findings]).decode().split("\n")
    details = _encode_lines([f.detail for f in findings]).decode().split("\n")
    return pages, details


def _own_rows(findings: list[Finding]) -> Iterator[tuple[Any, ...]]:
    """Each finding's own columns (``_OWN``, then pages and detail as JSON text)."""
    for own, page, detail in zip(map(_own_of, findings), *_json_columns(findings)):  # noqa: B905 (a split's last item is empty)
        yield (*own, page, detail)


def _exposures(findings: list[Finding]) -> list[tuple[Any, ...]]:
    """The ``exposures`` rows of ``findings``: one per source (a reader -> source edge)."""
    return [
        (f.producer, f.seq, f.ts, s.request_id, s.instance, s.pages, s.written_at)
        for f in findings
        if f.sources
        for s in f.sources
    ]


_insert_records: Final = _Insert("INSERT INTO records", 4)
_insert_exposures: Final = _Insert(_insert("exposures", ExposureRow), len(ExposureRow._fields))
_INSERT_REJECT: Final = _Insert(_insert("rejects", RejectRow), len(RejectRow._fields)).one
_encode_json: Final = msgspec.json.Encoder().encode
_encode_lines: Final = msgspec.json.Encoder().encode_lines

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
    #: Indexes in ``findings`` of those that opened an incident (a newly affected request).
    opened: list[int] = field(default_factory=list)
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
        p.mode,
        p.scrub,
        _encode_json(p.config_errors).decode(),
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
