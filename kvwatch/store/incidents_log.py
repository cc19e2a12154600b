"""The incidents log: every finding the journal commits, once, as one JSON line (the findings
of one incident share its node and request id: ``kvwatch.store.incident.group`` joins them).

The file a log shipper (Grafana Alloy, Promtail, Fluent Bit) tails into Loki, and that
``kvwatch incidents --incidents-log`` reads back for a fleet-wide list. Each line is a
:class:`~kvwatch.store.incident.Finding` after ``v`` and ``journal``, with ``time`` after
``ts`` (:data:`LINE_FIELDS`); its fields are a public format, versioned by ``v`` (a new field
may be added within a version; removing or changing one is a new version). Like the journal it
holds request ids, page ids and counts, never prompt text, token ids or KV bytes.

Exactly once, across restarts and ``kill -9``: lines are written after the commit that stored
the findings (encoded from what that commit stored, handed over by the daemon, or read back
from the journal for what was not), in id order, and the journal's ``meta`` keeps the id of the
last finding written. A crash between the write and that update is repaired at start from the
log itself: its last complete line names the journal and the incident id it holds, and a torn
last line is cut off (its incident is written again, whole).

Rotation by size, as ``logrotate`` and Python's ``RotatingFileHandler`` name files: ``PATH`` is
written, ``PATH.1`` is the newest rotated file, ``PATH.<keep>`` the oldest kept.

Longer than 450 lines: the writer and the reader of one public format, kept side by side so that
they change together.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal, get_type_hints

import msgspec
from msgspec import Struct

from kvspool.records import Count, Text, Timestamp
from kvwatch.store.incident import FINDING_FIELDS, Finding
from kvwatch.store.journal import Journal, Stored

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


#: A line's fields: ``v``, ``journal`` (the journal's ``meta`` journal_id), then the finding's,
#: with ``time`` (``ts`` in ISO 8601 UTC, to the millisecond, for people) after ``ts``.
_AFTER_TS: Final = FINDING_FIELDS.index("ts") + 1
if FINDING_FIELDS[:_AFTER_TS] != ("id", "ts"):  # _lines writes the id, then ts, by name
    raise ImportError(f"Finding starts {FINDING_FIELDS[:_AFTER_TS]}, not id and ts")
LINE_FIELDS: Final = (
    "v", "journal", *FINDING_FIELDS[:_AFTER_TS], "time", *FINDING_FIELDS[_AFTER_TS:]
)  # fmt: skip
_HINTS: Final = get_type_hints(Finding, include_extras=True)
#: A line as read back, checked: the finding's constraints (an id is always there).
_LINE_TYPES: Final = {"v": Literal[1], "journal": Text, "id": Count, "ts": Timestamp, "time": Text}
#: A field added to Finding later has a default (a list or dict one, a factory): a line written
#: before it reads as that.
_DEFAULTS: Final = {
    f.name: f.default
    if f.default is not msgspec.NODEFAULT
    else msgspec.field(default_factory=f.default_factory)
    for f in msgspec.structs.fields(Finding)
    if f.default is not msgspec.NODEFAULT or f.default_factory is not msgspec.NODEFAULT
}
IncidentLine: Final = msgspec.defstruct(
    "IncidentLine",
    [
        (name, _LINE_TYPES.get(name) or _HINTS[name], _DEFAULTS[name])
        if name in _DEFAULTS
        else (name, _LINE_TYPES.get(name) or _HINTS[name])
        for name in LINE_FIELDS
    ],
    kw_only=True,
    frozen=True,
    gc=False,
)
#: A line as written: positional (cheaper to build), the same fields.
_Line: Final = msgspec.defstruct("_Line", [(name, Any) for name in LINE_FIELDS], gc=False)
_decode: Final[Any] = msgspec.json.Decoder(IncidentLine).decode


def iso(ts: float) -> str:
    """``ts`` in ISO 8601 UTC, to the microsecond (isoformat: several times strftime's speed)."""
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="microseconds")[:-6] + "Z"


_encode_lines: Final = msgspec.json.Encoder().encode_lines
_astuple: Final = msgspec.structs.astuple
#: SQLite's Julian day number of the Unix epoch, in seconds (its date.c counts from there).
_EPOCH_JD: Final = 210866760000
#: "SSS" + "Z": the milliseconds of ``time``, formatted once.
_MILLIS: Final = tuple(f"{m:03d}Z" for m in range(1000))


def to_finding(line: Any) -> Finding:
    """The finding a line holds (its ``id`` is the journal's that wrote it)."""
    values = _astuple(line)
    return Finding(*values[2 : 2 + _AFTER_TS], *values[3 + _AFTER_TS :])


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
        newest = journal.newest_finding_id()
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

    # -- the journal's commits ---------------------------------------------------------------

    def committed(self, stored: Stored) -> None:
        """Encode the lines of findings a journal commit just stored (the daemon hands them
        over), while they are at hand (the reader's poll, the garbage collector off): the drain
        writes them. Never raises (the commit is done)."""
        first, findings = stored.first, stored.findings
        if not first or not self._journal_id:  # ids unchecked, or before recover(): the
            return  # drain reads them from the journal
        count = len(findings)
        if self._pending_count + count > MAX_PENDING:
            self._pending, self._pending_count = [], 0  # the drain reads them from the journal
        try:
            oldest, lines = self._lines(findings, range(first, first + count))
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
        """The journal pruned findings older than ``cutoff``: a pruned finding's line must not
        be written from memory (its id may come again)."""
        if any(oldest < cutoff for _, _, oldest, _ in self._pending):
            self._pending, self._pending_count = [], 0

    def _drain_table(self, journal: Journal, journal_id: str, below: int) -> int:
        """Write findings with ids under ``below`` from the journal's table."""
        total = 0
        for _ in range(DRAIN_ROUNDS):
            findings = journal.incidents(after_id=self.written, before_id=below, limit=DRAIN_BATCH)
            if not findings:
                break
            self.path.parent.mkdir(parents=True, exist_ok=True)
            ids = [f.id or 0 for f in findings]
            _, blob = self._lines(findings, ids, journal_id)
            # msgspec escapes a newline inside a string: each line ends at one.
            lines = blob.split(b"\n")[:-1]
            self._write([(i, line + b"\n") for i, line in zip(ids, lines, strict=True)])
            journal.set_meta(HIGH_WATER_KEY, str(self.written))
            self._marked = self.written
            total += len(findings)
            if len(findings) < DRAIN_BATCH:
                break
        return total

    def _lines(
        self, findings: list[Finding], ids: Iterable[int], journal_id: str | None = None
    ) -> tuple[float, bytes]:
        """The lines of ``findings``, stored with ``ids``; and the oldest one's ts."""
        if journal_id is None:
            journal_id = self._journal_id
        oldest = float("inf")
        line, millis, astuple = _Line, _MILLIS, _astuple
        second, prefix = self._second, self._prefix
        out = []
        after = _AFTER_TS
        for finding, incident in zip(findings, ids, strict=True):
            values = astuple(finding)
            ts = finding.ts
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
                    LOG_VERSION, journal_id, incident, ts,
                    prefix + millis[jd % 1000], *values[after:],
                )
            )  # fmt: skip
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
            if line.journal == journal_id and journal.holds(line.id, line.producer, line.seq):
                written = max(written, line.id)
            break
        newest = journal.newest_finding_id()
        self.written = min(written, newest)
        journal.set_meta(HIGH_WATER_KEY, str(self.written))
        self._marked = self.written
        self._journal_id = journal_id  # from now on committed() encodes what it is handed


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
    rows: list[Finding] = field(default_factory=list)
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
                result.rows.append(to_finding(_decode(line)))
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
