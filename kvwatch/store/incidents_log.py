"""The incidents log: every finding the journal commits, once, as one JSON line (the findings
of one incident share its node and request id: ``kvwatch.store.incident.group`` joins them).

The file a log shipper (Grafana Alloy, Promtail, Fluent Bit) tails into Loki, and that
``kvwatch incidents --incidents-log`` reads back for a fleet-wide list. Each line is an
:class:`IncidentLine`; its fields are a public format, versioned by ``v`` (a new field may be
added within a version; removing or changing one is a new version). Like the journal it holds
request ids, page ids and counts, never prompt text, token ids or KV bytes.

Exactly once, across restarts and ``kill -9``: lines are written after the commit that stored
the incidents (encoded from the rows that commit handed over, or read back from the journal for
what it did not), in id order, and the journal's ``meta`` keeps the id of the last incident
written. A crash between the write and that update is repaired at start from the log itself:
its last complete line names the journal and the incident id it holds, and a torn last line is
cut off (its incident is written again, whole).

Rotation by size, as ``logrotate`` and Python's ``RotatingFileHandler`` name files: ``PATH`` is
written, ``PATH.1`` is the newest rotated file, ``PATH.<keep>`` the oldest kept.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta, Struct

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
)
from kvwatch.store.journal import ExposureRow, IncidentRow, Journal

#: The line format's version (``v``).
LOG_VERSION: Final = 1
#: ``meta`` key: the id of the last incident written to the log.
HIGH_WATER_KEY: Final = "incidents_log_id"
#: Incidents written per round: a backlog drains over several polls, in bounded memory.
DRAIN_BATCH: Final = 1000
#: Batches written per round at most.
DRAIN_ROUNDS: Final = 10
#: Incidents whose lines wait in memory for the next drain at most: past that, the drain
#: reads them back from the journal (bounded memory, whatever the spool holds).
MAX_PENDING: Final = 65536
#: Held lines are written at once from this many on (when they follow the log's last line):
#: memory stays flat over a long catch-up.
WRITE_AT: Final = 1024
#: The longest line a reader accepts (a full event's line is well under this).
MAX_LINE_BYTES: Final = 1 << 20


class IncidentLine(Struct, kw_only=True, frozen=True, gc=False):
    """One incident. Fields mean what the journal's columns mean (``kvwatch incidents``)."""

    v: Literal[1]
    #: The journal that recorded it (its ``meta`` journal_id) and the incident's id there.
    journal: Text
    id: Count
    #: Unix seconds, and the same instant in ISO 8601 UTC (to the millisecond) for people.
    ts: Timestamp
    time: Text
    node: Text
    producer: Text
    seq: Seq
    role: Text
    engine: Text
    engine_version: Text
    model: Text
    rank: Int64
    request_id: Text
    instance: Text | None
    detector: Text
    kind: Text
    mode: Text
    action: Text
    pages: Annotated[list[Int64], Meta(max_length=MAX_EVENT_PAGES)]
    pages_total: Count
    #: Whose KV the pages held, most pages first, and the count of the unnamed rest.
    sources: Annotated[list[Source], Meta(max_length=MAX_EVENT_SOURCES)]
    other_sources: Count
    other_source_pages: Count
    detail: Annotated[dict[Text, Int64 | Text], Meta(max_length=MAX_DETAIL_ITEMS)]


_decode: Final = msgspec.json.Decoder(IncidentLine).decode


def iso(ts: float) -> str:
    """``ts`` in ISO 8601 UTC, to the microsecond (isoformat: several times strftime's speed)."""
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="microseconds")[:-6] + "Z"


def _real(column: str) -> str:
    # 17 significant digits: the float read back is the float stored (ts, written_at).
    return f"json(printf('%!.17g', {column}))"


#: Fields of a line as SQL over ``incidents AS i``: SQLite writes the line (JSON1) from the
#: columns as stored, pages and detail as the JSON they already are. Every other field of
#: IncidentLine is the column of its name (one that has neither fails the first query, and the
#: round-trip tests). The ``journal`` id is the query's parameter.
_SOURCE_SQL: Final = {
    "request_id": "e.request_id",
    "pages": "e.pages",
    "instance": "e.instance",
    "written_at": _real("e.written_at"),
}
_LINE_SQL: Final = {
    "v": str(LOG_VERSION),
    "journal": "?",
    "ts": _real("i.ts"),
    "time": "strftime('%Y-%m-%dT%H:%M:%fZ', i.ts, 'unixepoch')",
    "pages": "json(i.pages)",
    "detail": "json(i.detail)",
    "sources": "(SELECT json(coalesce(json_group_array(json_object("
    + ", ".join(f"'{k}', {v}" for k, v in _SOURCE_SQL.items())
    + ")), '[]')) FROM (SELECT * FROM exposures WHERE producer = i.producer AND seq = i.seq"
    " ORDER BY pages DESC, id) AS e)",
}
_SELECT_LINES: Final = (
    "SELECT i.id, json_object("
    + ", ".join(
        f"'{name}', {_LINE_SQL.get(name, 'i.' + name)}" for name in IncidentLine.__struct_fields__
    )
    + ") FROM incidents AS i WHERE i.id > ? AND i.id < ? ORDER BY i.id LIMIT ?"
)
assert set(_SOURCE_SQL) == set(Source.__struct_fields__)


class _Line(Struct, gc=False):
    """IncidentLine as written from the rows a commit just stored (positional: cheaper to
    build): pages and detail are the JSON the rows already hold."""

    v: int
    journal: str
    id: int
    ts: float
    time: str
    node: str
    producer: str
    seq: int
    role: str
    engine: str
    engine_version: str
    model: str
    rank: int
    request_id: str
    instance: str | None
    detector: str
    kind: str
    mode: str
    action: str
    pages: msgspec.Raw
    pages_total: int
    sources: tuple[dict[str, Any], ...]
    other_sources: int
    other_source_pages: int
    detail: msgspec.Raw


assert _Line.__struct_fields__ == IncidentLine.__struct_fields__
_encode_lines: Final = msgspec.json.Encoder().encode_lines
#: SQLite's Julian day number of the Unix epoch, in seconds (its date.c counts from there).
_EPOCH_JD: Final = 210866760000
#: "SSS" + "Z": the milliseconds of ``time``, formatted once.
_MILLIS: Final = tuple(f"{m:03d}Z" for m in range(1000))


def _sources(exposures: list[ExposureRow]) -> dict[tuple[str, int], tuple[dict[str, Any], ...]]:
    """Each reader's sources, most pages first, then in stored (id) order, as _SELECT_LINES."""
    edges: dict[tuple[str, int], list[Any]] = {}
    for edge in exposures:
        edges.setdefault((edge.producer, edge.seq), []).append(edge)
    return {
        key: tuple(
            {
                "request_id": e.request_id,
                "pages": e.pages,
                "instance": e.instance,
                "written_at": e.written_at,
            }
            for e in sorted(found, key=lambda e: -e.pages)
        )
        for key, found in edges.items()
    }


def to_row(line: IncidentLine) -> dict[str, Any]:
    """The row :meth:`Journal.incidents` would give for ``line`` (one shape for both)."""
    row = msgspec.structs.asdict(line)
    del row["v"], row["journal"]
    row["time"] = row.pop("ts")
    row["sources"] = [msgspec.structs.asdict(s) for s in line.sources]
    return row


def rotated(path: Path) -> list[Path]:
    """``path`` and its rotated files, oldest first."""
    numbered = []
    prefix = path.name + "."
    candidates = path.parent.iterdir() if path.parent.is_dir() else iter(())
    for candidate in candidates:
        suffix = candidate.name.removeprefix(prefix)
        if candidate.name.startswith(prefix) and suffix.isdigit():
            numbered.append((int(suffix), candidate))
    files = [p for _, p in sorted(numbered, reverse=True)]
    return [*files, path] if path.exists() else files


# -- writing ----------------------------------------------------------------------------------


class IncidentsLog:
    """Appends the journal's new incidents to the log; one per daemon (it holds the journal)."""

    def __init__(self, path: str | os.PathLike[str], *, max_bytes: int, keep: int) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.keep = keep
        self.written = -1  # unknown until recover() reads the journal and the log
        self._second, self._prefix = -1, ""  # the last second written into a line's time
        self._journal_id = ""
        #: Lines of committed incidents not written yet: (first id, count, oldest ts, lines).
        self._pending: list[tuple[int, int, float, bytes]] = []
        self._pending_count = 0
        self._marked = -1  # the mark last stored in the journal

    def drain(self, journal: Journal) -> int:
        """Write the incidents committed since the last call; returns how many.

        The lines of what the journal's commits handed over (:meth:`committed`) were encoded
        from the rows in memory. What they do not cover (a backlog from before a
        restart, a prune, a failed write) is read back from the journal, at most
        ``DRAIN_ROUNDS`` batches a call: a backlog never holds up the spool for long."""
        journal_id = journal.meta("journal_id") or ""
        if self.written < 0:
            self.recover(journal)
        pending, self._pending, self._pending_count = self._pending, [], 0
        # Pruning every incident lets SQLite hand out ids from 1 again: whatever is left was
        # written, so the mark comes down to the newest id there is (the daemon drains right
        # after pruning, before it stores new incidents).
        newest = int(journal.scalar("SELECT coalesce(max(id), 0) FROM incidents"))
        if newest < self.written:
            self.written = newest
            journal.set_meta(HIGH_WATER_KEY, str(newest))
            self._marked = newest
        # The table up to the first incident handed over; then those, if the table reached it.
        below = pending[0][0] if pending else newest + 1
        total = self._drain_table(journal, journal_id, below)
        if pending and self.written == below - 1:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            for first, count, _, lines in pending:
                if first != self.written + 1 or self.written + count > newest:
                    break  # not what the table holds next (never seen): it has the rest
                self._append(first, count, lines)
                total += count
        if self.written != self._marked:  # lines written here or at the commits since
            journal.set_meta(HIGH_WATER_KEY, str(self.written))
            self._marked = self.written
        return total

    # -- the journal's commits (CommitListener) --------------------------------------------

    def committed(
        self, first: int, incidents: list[IncidentRow], exposures: list[ExposureRow]
    ) -> None:
        """Encode the lines of incidents the journal just stored, from the rows in memory, while
        they are at hand (the reader's poll, the garbage collector off): the drain writes them."""
        count = len(incidents)
        if self._pending_count + count > MAX_PENDING:
            self._pending, self._pending_count = [], 0  # the drain reads them from the journal
        try:
            oldest, lines = self._lines(first, incidents, exposures)
        except Exception:  # never seen; the commit is done: the drain reads the journal instead
            self._pending, self._pending_count = [], 0
            return
        self._pending.append((first, count, oldest, lines))
        self._pending_count += count
        if self._pending_count >= WRITE_AT and self.written == self._pending[0][0] - 1:
            self._write_pending()

    def _write_pending(self) -> None:
        """Write the held lines now (they follow the log's last line): a long poll's lines do not
        wait in memory for its drain. The mark follows at the drain; a crash before it is
        repaired from the log's last line, as after any write."""
        pending, self._pending, self._pending_count = self._pending, [], 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            for first, count, _, lines in pending:
                self._append(first, count, lines)
        except Exception:  # never raised into the commit: the drain recovers, from the journal
            self.written = -1

    def pruned(self, cutoff: float) -> None:
        """A pruned incident's line must not be written from memory (its id may come again)."""
        if any(oldest < cutoff for _, _, oldest, _ in self._pending):
            self._pending, self._pending_count = [], 0

    def _drain_table(self, journal: Journal, journal_id: str, below: int) -> int:
        """Write incidents with ids under ``below`` from the journal's table."""
        total = 0
        for _ in range(DRAIN_ROUNDS):
            rows = journal.db.execute(
                _SELECT_LINES, (journal_id, self.written, below, DRAIN_BATCH)
            ).fetchall()
            if not rows:
                break
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._write([(incident, line.encode() + b"\n") for incident, line in rows])
            journal.set_meta(HIGH_WATER_KEY, str(self.written))
            self._marked = self.written
            total += len(rows)
            if len(rows) < DRAIN_BATCH:
                break
        return total

    def _lines(
        self, first: int, incidents: list[IncidentRow], exposures: list[ExposureRow]
    ) -> tuple[float, bytes]:
        """The lines of incidents stored with ids ``first`` and up, with the values that
        _SELECT_LINES gives; and the oldest one's ts."""
        journal_id, oldest = self._journal_id, float("inf")
        sources = _sources(exposures) if exposures else {}
        raw, line, millis = msgspec.Raw, _Line, _MILLIS
        second, prefix = self._second, self._prefix
        out = []
        incident = first
        for row in incidents:
            (
                ts,
                node,
                role,
                engine,
                version,
                model,
                rank,
                producer,
                seq,
                request_id,
                instance,
                detector,
                kind,
                mode,
                action,
                pages,
                pages_total,
                detail,
                others,
                other_pages,
            ) = row
            # time as SQLite's strftime('%Y-%m-%dT%H:%M:%fZ', ts, 'unixepoch') writes it: its
            # rounding to the millisecond, iJD = (int64)(ts * 1000.0 + 210866760000000.0 + 0.5)
            # in doubles; the text up to the second computed once per second.
            if ts < oldest:  # noqa: PLR1730 (a call to min() per row costs more)
                oldest = ts
            jd = int(ts * 1000.0 + 210866760000000.0 + 0.5)
            if jd // 1000 != second:
                second = jd // 1000
                when = datetime.fromtimestamp(second - _EPOCH_JD, UTC)
                prefix = when.strftime("%Y-%m-%dT%H:%M:%S.")
            out.append(
                line(
                    LOG_VERSION, journal_id, incident, ts, prefix + millis[jd % 1000], node,
                    producer, seq, role, engine, version, model, rank, request_id, instance,
                    detector, kind, mode, action, raw(pages), pages_total,
                    sources.get((producer, seq), ()), others, other_pages, raw(detail),
                )
            )  # fmt: skip
            incident += 1
        self._second, self._prefix = second, prefix
        return oldest, _encode_lines(out)

    def _append(self, first: int, count: int, blob: bytes) -> None:
        """Append ``blob``, the lines of ``count`` incidents from ``first``: in one write when it
        fits in the file, else line by line (rotating between lines)."""
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            size = 0
        if size + len(blob) <= self.max_bytes:
            self._write([(first + count - 1, blob)])
        else:
            # msgspec escapes a newline inside a string: each line ends at one.
            lines = blob.split(b"\n")[:-1]
            self._write([(first + k, data + b"\n") for k, data in enumerate(lines)])

    def _write(self, lines: list[tuple[int, bytes]]) -> None:
        """Append ``lines`` (incident id, line), rotating before a line that would not fit. The
        mark moves only past lines written whole; after a failed write (a full disk) the next
        round starts over from the log itself (a torn line is cut off, see _recover)."""
        try:
            fd = self._open()
            try:
                size = os.fstat(fd).st_size
                chunk: list[bytes] = []
                last = self.written
                for incident, data in lines:
                    if size and size + len(data) > self.max_bytes:
                        _write_all(fd, b"".join(chunk))
                        self.written, chunk = last, []
                        os.close(fd)
                        fd = -1
                        self._rotate()
                        fd, size = self._open(), 0
                    chunk.append(data)
                    size += len(data)
                    last = incident
                _write_all(fd, b"".join(chunk))
                self.written = last
            finally:
                if fd >= 0:
                    os.close(fd)
        except OSError:
            self.written = -1
            raise

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)

    def _rotate(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.path.parent / f"{self.path.name}.{self.keep}").unlink()
        for index in range(self.keep - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.replace(
                    f"{self.path}.{index}", self.path.parent / f"{self.path.name}.{index + 1}"
                )
        if self.keep > 0:
            os.replace(self.path, f"{self.path}.1")
        else:
            self.path.unlink()

    def recover(self, journal: Journal) -> None:
        """Find where the log stands, before the daemon stores new incidents: the journal's
        mark, or further when the log's last line is an incident written after it (a crash
        before the mark was stored) that the journal still holds under that id; never above
        the newest incident (after a prune of all of them, ids start again from 1)."""
        journal_id = journal.meta("journal_id") or ""
        written = int(journal.meta(HIGH_WATER_KEY) or 0)
        for path in reversed(rotated(self.path)):
            last = _last_line(path)
            if last is None:
                continue
            try:
                line = _decode(last)
            except (msgspec.DecodeError, msgspec.ValidationError):
                break  # not ours to judge: the mark stands
            same = journal.scalar(
                "SELECT 1 FROM incidents WHERE id = ? AND producer = ? AND seq = ?",
                (line.id, line.producer, line.seq),
            )
            if line.journal == journal_id and same:
                written = max(written, line.id)
            break
        newest = int(journal.scalar("SELECT coalesce(max(id), 0) FROM incidents"))
        self.written = min(written, newest)
        journal.set_meta(HIGH_WATER_KEY, str(self.written))
        self._marked = self.written
        self._journal_id = journal_id
        journal.listener = self  # from now on its commits hand their incidents over


def _last_line(path: Path) -> bytes | None:
    """The last complete line of ``path``; a torn line after it (a write cut short) is cut off,
    so that the next line starts on a line of its own."""
    try:
        with path.open("rb+") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                return None  # a pipe or device has no last line to read back
            size = handle.seek(0, os.SEEK_END)
            start = max(0, size - 2 * MAX_LINE_BYTES)
            handle.seek(start)
            tail = handle.read(2 * MAX_LINE_BYTES)
            end = tail.rfind(b"\n")
            if end + 1 < len(tail):
                handle.truncate(start + end + 1)
            if end < 0:
                return None
            begin = tail.rfind(b"\n", 0, end) + 1
            return tail[begin:end]
    except FileNotFoundError:
        return None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# -- reading ----------------------------------------------------------------------------------


@dataclass
class ReadResult:
    rows: list[dict[str, Any]] = field(default_factory=list)
    #: What was skipped, each a line ending in "skipped": "PATH:LINE: why" for the first
    #: :data:`SHOWN_BAD_LINES` bad lines of a file, then one count for its others; or one
    #: line for a file that holds no incident line at all (a journal given as a log).
    errors: list[str] = field(default_factory=list)
    skipped: int = 0
    #: Files with a skipped line.
    bad_files: int = 0


#: Bad lines of one file named one by one; the rest are counted, so a wrong file cannot
#: flood the terminal.
SHOWN_BAD_LINES: Final = 3


class _Version(Struct):
    v: object = None


def _why(line: bytes, exc: Exception) -> str:
    if isinstance(exc, msgspec.ValidationError):
        # A line of a newer format: say so rather than "Invalid enum value 2".
        try:
            version = msgspec.json.decode(line, type=_Version).v
        except (msgspec.DecodeError, msgspec.ValidationError):
            version = LOG_VERSION
        if version is not None and version != LOG_VERSION:
            return f"unsupported format version {version!r}"[:200]
    return " ".join(str(exc).split())[:200]


def read(path: Path, result: ReadResult | None = None) -> ReadResult:
    """The incidents in ``path`` and its rotated files. A line that is not an incident line
    (hostile, torn, from another tool) is skipped and named; the rest are kept."""
    result = result or ReadResult()
    for file in rotated(path):
        good, bad, first = 0, 0, ""
        named: list[str] = []
        for number, line in _lines(file):
            try:
                if len(line) > MAX_LINE_BYTES:
                    raise msgspec.ValidationError(f"longer than {MAX_LINE_BYTES} bytes")
                result.rows.append(to_row(_decode(line)))
                good += 1
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                bad += 1
                reason = _why(line, exc)
                first = first or f"line {number}: {reason}"
                if len(named) < SHOWN_BAD_LINES:
                    named.append(f"{file}:{number}: not an incident line ({reason}); skipped")
        if not bad:
            continue
        result.skipped += bad
        result.bad_files += 1
        if not good:
            result.errors.append(f"{file}: not an incidents log ({first}); {bad} line(s) skipped")
            continue
        result.errors.extend(named)
        if bad > len(named):
            result.errors.append(
                f"{file}: {bad} bad line(s) in all, {bad - len(named)} more not shown; skipped"
            )
    return result


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    with path.open("rb") as handle:
        for number, line in enumerate(handle, 1):
            stripped = line.strip()
            if stripped:
                yield number, stripped
