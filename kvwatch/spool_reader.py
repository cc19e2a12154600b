"""The spool reader: tails every segment in the spool directory into the journal.

Each poll lists the directory, reads every segment of every producer in index order from its
committed position, checks each frame (framing, CRC, size) and each record (schema version,
fields, producer, sequence number), and commits accepted records, rejects and the new read
positions in one journal transaction per batch. A segment is *finished* when every byte of it is
accounted for and no more can come: it ends in a ``seal`` record, or a later segment of the same
producer exists, or no producer holds its ``flock`` and it has been idle for ``idle_grace``
seconds. A finished segment is removed (or, if it had rejects, moved to the quarantine
directory); a producer none of whose segments is left is retired (its gauges go, its counters
stay in the totals).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import json
import json.scanner
import os
import re
import stat
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import structlog

from kvspool import SchemaError, decode_payload, iter_frames, validate
from kvspool.framing import MAGIC, SEGMENT_SUFFIX
from kvwatch.journal import Batch, Journal
from kvwatch.state import Producer, Segment, State, bound

SEGMENT_NAME: Final = re.compile(
    r"^([A-Za-z0-9_-]{1,200})\.([0-9]{1,12})" + re.escape(SEGMENT_SUFFIX) + "$"
)
_OPEN_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_MAX_MESSAGE: Final = 200
#: Rejects logged one by one per poll; past that, one summary line (the counter has them all).
_LOGGED_REJECTS: Final = 10
# A quoted value in an error message that is not a short identifier came from the record itself:
# it never reaches the journal or the logs (privacy), only its length does.
_QUOTED: Final = re.compile(r"'([^']*)'|\"([^\"]*)\"")
_IDENTIFIER: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")


def _redact(message: str) -> str:
    def one(match: re.Match[str]) -> str:
        value = match.group(1) if match.group(1) is not None else match.group(2)
        if _IDENTIFIER.fullmatch(value):
            return match.group(0)
        return f"<{len(value)} chars>"

    return _QUOTED.sub(one, message)[:_MAX_MESSAGE]


@dataclass(frozen=True, slots=True)
class PollResult:
    records: int
    rejected: int
    lost: int
    #: True when the poll stopped at its record budget with more to read.
    more: bool


class SpoolReader:
    def __init__(
        self,
        directory: str | os.PathLike[str],
        journal: Journal,
        state: State,
        *,
        allowed_uids: Collection[int] | None = None,
        idle_grace: float = 5.0,
        # Small batches and reads keep the memory a backlog takes small: what a catch-up
        # allocates, the allocators keep (8,192 and 1 MiB let the daemon's resident memory
        # ratchet up by megabytes after each stall).
        batch_records: int = 2048,
        poll_records: int = 32768,
        chunk_bytes: int = 256 << 10,
        quarantine_dir: str | os.PathLike[str] | None = None,
        quarantine_max: int = 32,
    ) -> None:
        self.directory = Path(directory)
        self.journal = journal
        self.state = state
        self.allowed_uids = frozenset(allowed_uids if allowed_uids else {os.geteuid()})
        self.idle_grace = idle_grace
        self.batch_records = batch_records
        self.poll_records = poll_records
        self.chunk_bytes = chunk_bytes
        self.quarantine_dir = Path(quarantine_dir) if quarantine_dir else None
        self.quarantine_max = quarantine_max
        self.log = structlog.get_logger("kvwatch.spool")
        self._flagged: set[str] = set()  # files rejected as a whole: counted once per run
        self._warned: set[str] = set()
        self._batch = Batch()
        self._budget = 0
        self._polled = Counter[str]()
        self._to_remove: list[Segment] = []

    # -- the poll -----------------------------------------------------------------------------

    def poll(self) -> PollResult:
        """Read what is new in the spool and commit it. Raises only on a journal failure."""
        gc_was_on = gc.isenabled()
        gc.disable()  # a poll allocates many short-lived dicts and no cycles
        try:
            return self._poll()
        finally:
            if gc_was_on:
                gc.enable()

    def _poll(self) -> PollResult:
        self._budget = self.poll_records
        self._polled = Counter()
        self._to_remove = []
        groups, sizes = self._list()
        more = False
        live: set[str] = set()
        try:
            for producer in sorted(groups):
                segments = sorted(groups[producer])
                for position, (_index, name) in enumerate(segments):
                    later = position < len(segments) - 1
                    with self.state.lock:
                        finished = self._read_segment(name, producer, _index, later)
                    if not finished:
                        live.add(producer)
                        break
                    if self._budget <= 0:
                        more = True
                        break
                if self._budget <= 0:
                    more = True
                    live.update(groups)  # not all visited: do not retire anyone this time
                    break
            with self.state.lock:
                self._commit()
                self._remove_finished()
                if not more:
                    present = {n for g in groups.values() for _, n in g}
                    present -= {s.name for s in self._to_remove if s.removed}
                    producers = {SEGMENT_NAME.match(n).group(1) for n in present}  # type: ignore[union-attr]
                    self._retire(producers, present)
                self._commit()
                self.state.lag_bytes = self._lag(sizes)  # before a removed name is forgotten
                self._forget_removed()
                self.state.live_producers = len(live)
        except BaseException:
            self._reload()
            raise
        if self._polled["rejected"] > _LOGGED_REJECTS:
            self.log.warning(
                "spool.rejects_not_logged",
                count=self._polled["rejected"] - _LOGGED_REJECTS,
                note="kvwatch_spool_rejected_total and the journal's rejects table hold them all",
            )
        return PollResult(
            self._polled["records"], self._polled["rejected"], self._polled["lost"], more
        )

    def _lag(self, sizes: dict[str, int]) -> int:
        lag = 0
        for name, size in sizes.items():
            segment = self.state.segments.get(name)
            if name in self._flagged:
                continue  # ignored files (wrong owner, not regular) are not lag
            if segment is None:
                lag += size
            elif not segment.finished:
                lag += max(0, size - segment.offset)
        return lag

    def _list(self) -> tuple[dict[str, list[tuple[int, str]]], dict[str, int]]:
        groups: dict[str, list[tuple[int, str]]] = {}
        sizes: dict[str, int] = {}
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            self._warn_once("missing", "spool.directory_missing", directory=str(self.directory))
            return groups, sizes
        for entry in entries:
            name = entry.name
            if not name.endswith(SEGMENT_SUFFIX):
                continue
            match = SEGMENT_NAME.match(name)
            if match is None:
                with self.state.lock:
                    self._reject_file(name, "name", "not <producer>.<index>.kvs")
                continue
            groups.setdefault(match.group(1), []).append((int(match.group(2)), name))
            with contextlib.suppress(OSError):
                sizes[name] = entry.stat(follow_symlinks=False).st_size
        return groups, sizes

    # -- one segment --------------------------------------------------------------------------

    def _read_segment(self, name: str, producer: str, index: int, later: bool) -> bool:
        """Read what is new in one segment; True when it is finished (or to be skipped)."""
        state = self.state
        segment = state.segments.get(name)
        if segment is not None and segment.finished:
            if not segment.removed:
                self._to_remove.append(segment)
            return True
        path = self.directory / name
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                self._reject_file(name, "not_regular", "a symbolic link")
                return True
            self._warn_once("open:" + name, "spool.open_failed", segment=name, error=str(exc))
            return False
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                self._reject_file(name, "not_regular", "not a regular file")
                return True
            if info.st_uid not in self.allowed_uids:
                self._reject_file(name, "owner", f"owned by uid {info.st_uid}")
                return True
            if segment is None:
                segment = Segment(name, state.next_segment_id, producer, index)
                state.next_segment_id += 1
                state.segments[name] = segment
                self._batch.segments[name] = segment
            size = info.st_size
            waiting = False  # an incomplete frame at the end of the file
            while segment.offset < size and self._budget > 0:
                data = os.pread(fd, min(size - segment.offset, self.chunk_bytes), segment.offset)
                if not data:
                    break
                consumed = self._consume(segment, data)
                if len(self._batch.records) >= self.batch_records:
                    self._commit()
                if consumed == 0:
                    waiting = segment.offset + len(data) >= size
                    break
            if segment.offset < size and not waiting:
                return False  # stopped at the budget
            done = segment.sealed or later
            if not done and not _locked(fd):
                done = time.time() - info.st_mtime >= self.idle_grace
            if not done:
                return False
            self._finish_tail(fd, segment, size)
            segment.finished = True
            self._batch.segments[name] = segment
            self._to_remove.append(segment)
            return True
        finally:
            os.close(fd)

    def _finish_tail(self, fd: int, segment: Segment, size: int) -> None:
        """No more bytes will come: what is left is an incomplete frame, or a damaged length
        that points past the end with intact frames behind it. Count the first as torn, and
        resynchronise on the next magic to keep the second."""
        while segment.offset < size:
            data = os.pread(fd, size - segment.offset, segment.offset)
            skip = data.find(MAGIC, 1)
            if skip < 0:
                skip = len(data)
            self._reject(segment, segment.offset, skip, "torn", "incomplete or damaged frame")
            segment.offset += skip
            if skip < len(data):
                self._consume(segment, data[skip:])

    def _consume(self, segment: Segment, data: bytes) -> int:
        """Decode the frames of ``data`` (read at ``segment.offset``); returns bytes consumed."""
        state = self.state
        batch = self._batch
        base = segment.offset
        producer = self._producer(segment.producer)
        records = batch.records
        accepted = 0
        end = 0
        budget = self._budget
        newest = state.last_record_ts
        decode = _decode
        for frame in iter_frames(data):
            end = frame.end
            start = base + frame.offset
            if frame.payload is None:
                reason = frame.error or "framing"
                self._reject(segment, start, frame.end - frame.offset, reason, reason)
                continue
            try:
                record = decode(frame.payload)
            except SchemaError as exc:
                self._reject(segment, start, frame.end - frame.offset, exc.reason, str(exc))
                continue
            if record["producer"] != segment.producer:
                self._reject(segment, start, frame.end - frame.offset, "producer", "")
                continue
            seq: int = record["seq"]
            last = producer.last_seq
            if seq <= last:
                message = f"seq {seq} not above {last}"
                self._reject(segment, start, frame.end - frame.offset, "sequence", message)
                continue
            if seq != last + 1:
                self._lost(producer, last + 1, seq - 1)
            producer.last_seq = seq
            ts = float(record["ts"])
            producer.last_ts = ts
            kind = record["type"]
            if kind == "event":
                self._incident(producer, record)
            elif kind == "counters":
                producer.counters = record["counters"]
            elif kind == "gauges":
                producer.gauges = {g[0]: float(g[2]) for g in record["gauges"]}
            elif kind == "hello":
                self._hello(producer, record)
            elif kind == "seal":
                segment.sealed = True
            records.append((producer.id, seq, kind, ts))
            accepted += 1
            newest = max(newest, ts)
            budget -= 1
            if budget <= 0:
                break
        self._budget = budget
        state.last_record_ts = newest
        segment.offset = base + end
        batch.segments[segment.name] = segment
        if accepted:
            producer.retired = False
            batch.producers[producer.name] = producer
            self._count("spool_records", (), accepted)
            self._polled["records"] += accepted
        return end

    # -- record kinds -------------------------------------------------------------------------

    def _producer(self, name: str) -> Producer:
        producer = self.state.producers.get(name)
        if producer is None:
            producer = Producer(name, self.state.next_producer_id, first_seen=time.time())
            self.state.next_producer_id += 1
            self.state.producers[name] = producer
            self._batch.producers[name] = producer
        return producer

    def _hello(self, producer: Producer, record: dict[str, Any]) -> None:
        producer.engine = record["engine"]
        producer.engine_version = record["engine_version"]
        producer.role = record["role"]
        producer.model = record["model"]
        producer.rank = record["rank"]
        producer.pid = record["pid"]
        host = record.get("host", "")
        producer.host = host[:256] if isinstance(host, str) else ""

    def _incident(self, producer: Producer, record: dict[str, Any]) -> None:
        detail = record.get("detail")
        self._batch.incidents.append(
            (
                record["ts"],
                producer.host,
                producer.role,
                producer.engine,
                producer.engine_version,
                producer.model,
                producer.rank,
                producer.name,
                record["seq"],
                record["request_id"],
                record["detector"],
                record["kind"],
                record["mode"],
                record["action"],
                # Only the schema's fields: a record's extra keys never reach the journal.
                ",".join(map(str, record["pages"])),
                record["pages_total"],
                _encode_detail(detail) if detail else "{}",
                record.get("instance", ""),
            )
        )
        labels = (
            bound("detector", record["detector"]),
            bound("role", producer.role),
            bound("kind", record["kind"]),
        )
        self._count("incidents", labels)
        self._polled["incidents"] += 1

    def _lost(self, producer: Producer, first: int, last: int) -> None:
        count = last - first + 1
        self._batch.gaps.append((time.time(), producer.name, first, last))
        self._count("spool_lost_records", (), count)
        self._polled["lost"] += count
        self.log.warning(
            "spool.records_lost", producer=producer.name, first_seq=first, last_seq=last, lost=count
        )

    # -- rejects ------------------------------------------------------------------------------

    def _reject(
        self, segment: Segment, offset: int, length: int, reason: str, message: str
    ) -> None:
        segment.rejects += 1
        self._batch.segments[segment.name] = segment
        message = _redact(message)
        self._batch.rejects.append((time.time(), segment.name, offset, length, reason, message))
        self._count("spool_rejected", (reason,))
        self._polled["rejected"] += 1
        if self._polled["rejected"] > _LOGGED_REJECTS:
            return
        self.log.warning(
            "spool.record_rejected",
            segment=segment.name,
            offset=offset,
            length=length,
            reason=reason,
            error=message,
        )

    def _reject_file(self, name: str, reason: str, message: str) -> None:
        if name in self._flagged:
            return
        self._flagged.add(name)
        self._batch.rejects.append((time.time(), name, 0, 0, reason, message))
        self._count("spool_rejected", (reason,))
        self._polled["rejected"] += 1
        self.log.warning("spool.segment_ignored", segment=name, reason=reason, error=message)

    def _count(self, name: str, labels: tuple[str, ...], amount: int = 1) -> None:
        key = (name, labels)
        self.state.daemon[key] += amount
        self._batch.counters.add(key)

    def _warn_once(self, key: str, event: str, **fields: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.log.warning(event, **fields)

    # -- after reading ------------------------------------------------------------------------

    def _retire(self, present_producers: set[str], present_segments: set[str]) -> None:
        now = time.time()
        for segment in self.state.segments.values():
            if segment.name not in present_segments and not segment.removed:
                if not segment.finished:
                    self.log.warning(
                        "spool.segment_vanished", segment=segment.name, offset=segment.offset
                    )
                segment.finished = segment.removed = True
                self._batch.segments[segment.name] = segment
        for producer in self.state.producers.values():
            if not producer.retired and producer.name not in present_producers:
                producer.retired = True
                producer.retired_at = now
                self._batch.producers[producer.name] = producer
                self.log.info("spool.producer_retired", producer=producer.name)

    def _remove_finished(self) -> None:
        for segment in self._to_remove:
            path = self.directory / segment.name
            try:
                if segment.rejects and self.quarantine_dir is not None:
                    self._quarantine(path)
                else:
                    path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._warn_once(
                    "unlink:" + segment.name,
                    "spool.remove_failed",
                    segment=segment.name,
                    error=str(exc),
                )
                continue
            segment.removed = True
            self._batch.segments[segment.name] = segment

    def _forget_removed(self) -> None:
        """A removed segment stays in the journal for the retention, not in memory (which would
        grow with every segment ever read). A file that comes back under a removed name is read
        as new: its records are rejected by their producer's sequence numbers and counted."""
        segments = self.state.segments
        for name in [name for name, segment in segments.items() if segment.removed]:
            del segments[name]

    def _quarantine(self, path: Path) -> None:
        assert self.quarantine_dir is not None
        self.quarantine_dir.mkdir(mode=0o700, exist_ok=True)
        os.rename(path, self.quarantine_dir / path.name)
        self.log.warning("spool.segment_quarantined", segment=path.name)
        kept = sorted(self.quarantine_dir.iterdir(), key=lambda p: p.stat().st_mtime)
        for old in kept[: max(0, len(kept) - self.quarantine_max)]:
            with contextlib.suppress(OSError):
                old.unlink()

    def _commit(self) -> None:
        batch = self._batch
        if not batch:
            return
        self.journal.commit(batch, self.state)
        incidents = len(batch.incidents)
        self._batch = Batch()
        if incidents:
            self.log.warning("spool.incidents_recorded", count=incidents)

    def _reload(self) -> None:
        """After a failed commit: forget everything not in the journal."""
        self._batch = Batch()
        self._to_remove = []
        self.state.replace_with(self.journal.load())


_encode_detail = json.JSONEncoder(separators=(",", ":"), sort_keys=True).encode
_scan = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


def _decode(payload: bytes) -> dict[str, Any]:
    """``kvspool.decode_payload``, faster on the common case: the same JSON parser without
    ``json.loads``'s per-call overhead, then kvspool's ``validate``, the single gate. Anything the
    fast path does not take whole goes to ``decode_payload`` itself, for its exact verdict."""
    try:
        text = payload.decode()
        record, end = _scan(text, 0)
    except (ValueError, StopIteration, RecursionError):
        return decode_payload(payload)
    if end != len(text):
        return decode_payload(payload)
    return validate(record)


def _locked(fd: int) -> bool:
    """True while a producer holds the segment's exclusive flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False
