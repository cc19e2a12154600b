"""The journal's queries (``kvwatch incidents``, ``ack``, the status page, the incidents log's
drain): findings with their sources, acknowledgements, gaps, ``meta``. Read-only connections
and the daemon's share them (:class:`JournalQueries`, which :class:`Journal` extends). Part of
the journal package, the only place with SQL (see the package).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

import msgspec

from kvspool.records import Source
from kvwatch.store.incident import Finding
from kvwatch.store.journal.tables import (
    _FROM_ROW,
    _JSON_AT,
    _SELECT_ACKS,
    _SELECT_EXPOSURES,
    FINDING_COLUMNS,
    AckRow,
    ExposureRow,
    _default,
)

_decode_json: Final = msgspec.json.Decoder().decode


class JournalQueries:
    """The queries on one SQLite connection (``db``) to a journal of schema ``schema``."""

    path: Path
    db: sqlite3.Connection
    schema: int

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

    def finding_count(self) -> int:
        """How many findings are stored."""
        return int(self.scalar("SELECT count(*) FROM incidents"))

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
