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

A record that passes the gate but cannot be stored (a daemon bug, or a limit the gate missed)
costs that record alone: the poll is redone one record per transaction, and the one that fails
is dead-lettered (a ``rejects`` row with its producer, sequence number, offset and reason
``internal``), the read position moves past it, and every other record commits.

Longer than 450 lines: one class, because the poll's directory listing, segment reads, record
checks and poison isolation share its state (the batch, the budget, the flagged files) under the
state's lock; the hot loop (``_consume``) is one function on purpose (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import os
import re
import shutil
import socket
import sqlite3
import stat
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any, Final

import structlog

from kvspool import SchemaError, catalogue, decode_payload, iter_frames
from kvspool.catalogue import DaemonCounter
from kvspool.framing import MAX_FRAME_BYTES, SEGMENT_SUFFIX
from kvspool.records import (
    SERIES_OF,
    TYPE_NAME,
    Counters,
    Event,
    Gauges,
    Hello,
    NextSegment,
    Record,
    stopped_before_read,
)
from kvspool.writer import PRIVATE_SUFFIX
from kvwatch.ingest.spool.owner import Ignored, OwnerRule, user_name
from kvwatch.store.incident import (
    FINDING_FIELDS,
    NOT_READS,
    Finding,
    Joiner,
    sorted_detail,
    sorted_sources,
)
from kvwatch.store.journal import Batch, Journal, RejectRow, Stored
from kvwatch.store.state import Producer, Segment, State

SEGMENT_NAME: Final = re.compile(
    r"^([A-Za-z0-9_-]{1,200})\.([0-9]{1,12})" + re.escape(SEGMENT_SUFFIX) + "$"
)
_OPEN_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_MAX_MESSAGE: Final = 200
#: How much of an ignored segment is read to count the findings in it (a segment is 8 MiB).
_IGNORED_SCAN_BYTES: Final = 64 << 20
#: Rejects logged one by one per poll; past that, one summary line (the counter has them all).
_LOGGED_REJECTS: Final = 10
# A quoted value in an error message that is not a short identifier came from the record itself:
# it never reaches the journal or the logs (privacy), only its length does.
_QUOTED: Final = re.compile(r"'([^']*)'|\"([^\"]*)\"")
_IDENTIFIER: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")
#: A record's ``ts`` outside [daemon clock - past, daemon clock + future] is stored as the
#: daemon's clock, and counted (``kvwatch_spool_clamped_records_total``): the record is kept
#: (it may be evidence), and a wild clock cannot hide it from the retention, the "hooks
#: silent" alert or the incident list. Producers share the daemon's node and clock, so the
#: future window is small; the past one covers a daemon down for weeks with a full spool.
CLOCK_PAST_SECONDS: Final = 30 * 86400.0
CLOCK_FUTURE_SECONDS: Final = 300.0
#: A producer's private segment name, left behind when it was killed while creating one.
_PRIVATE_NAME: Final = re.compile(
    r"^\.[A-Za-z0-9_-]{1,200}\.[0-9]{1,12}" + re.escape(SEGMENT_SUFFIX + PRIVATE_SUFFIX) + "$"
)
_DETECTOR, _ROLE, _KIND = catalogue.DETECTOR.bound, catalogue.ROLE.bound, catalogue.KIND.bound
#: Incidents the reader remembers to count each once (``kvwatch_affected_requests_total``):
#: more than join in any minute but a storm; a later finding of one forgotten counts it again.
#: Its memory: docs/performance.md (test_cardinality holds the daemon's memory flat, fresh ids).
_JOINED_MAX: Final = 1024
#: Exposed requests the reader remembers to count each once (``kvwatch_exposed_requests_total``).
_EXPOSED_SEEN_MAX: Final = 16384
#: An incident row's (detector, role, kind): the labels of ``kvwatch_incidents_total``.
_INCIDENT_LABELS: Final = attrgetter("detector", "role", "kind")
#: A finding's fields after its producer's labels: the event record's of the same names.
_EVENT_PART: Final = attrgetter(*FINDING_FIELDS[FINDING_FIELDS.index("rank") + 1 :])


class _PoisonError(Exception):
    """A valid record could not be stored: redo the poll one record per transaction."""


class _RestartError(Exception):
    """A record was dead-lettered and the state reloaded: start the pass again."""


def _environmental(exc: BaseException) -> bool:
    """Errors of the journal's storage (disk, locks), not of a record: retried, never
    dead-lettered."""
    return isinstance(exc, (sqlite3.OperationalError, OSError, MemoryError)) or not isinstance(
        exc, Exception
    )


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
        # Small reads and transactions keep the memory a backlog takes small: what a catch-up
        # allocates, the allocators keep (1 MiB reads or 16,384-record transactions let the
        # daemon's resident memory ratchet up by megabytes: docs/performance.md).
        # On a slow or loaded machine, batch_seconds bounds how long read records wait to
        # become durable.
        batch_records: int = 4096,
        batch_seconds: float = 0.1,
        poll_records: int = 32768,
        chunk_bytes: int = 256 << 10,
        quarantine_dir: str | os.PathLike[str] | None = None,
        quarantine_max: int = 32,
        node: str | None = None,
        on_stored: Callable[[Stored], None] | None = None,
    ) -> None:
        self.directory = Path(directory)
        #: The node every incident row names: the daemon's ``node`` setting, else the host
        #: name; the same name Prometheus's target label and the pages carry (not the engine's
        #: hello, which names its own host).
        self.node = node or socket.gethostname()
        self.journal = journal
        #: Handed each commit's stored findings (the daemon wires the incidents log here).
        self.on_stored = on_stored
        self.state = state
        self.allowed_uids = frozenset(allowed_uids if allowed_uids else {os.geteuid()})
        self.owner_rule = OwnerRule(self.directory, self.allowed_uids)
        self.idle_grace = idle_grace
        self.batch_records = batch_records
        self.batch_seconds = batch_seconds
        self._batch_started = time.monotonic()
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
        self._careful = False
        self._incident_keys: dict[tuple[str, str, str], tuple[str, tuple[str, ...]]] = {}
        #: (detector, role, kind) as the records said them -> incidents not yet counted.
        self._incidents_seen = Counter[tuple[str, str, str]]()
        self._joiner, self._exposed_seen, self._others_seen = self._counted()
        #: Events read, their incident rows not yet built (see _incidents).
        self._events: list[tuple[Event, float]] = []
        self.clock_past = CLOCK_PAST_SECONDS
        self.clock_future = CLOCK_FUTURE_SECONDS

    # -- the poll -----------------------------------------------------------------------------

    def poll(self) -> PollResult:
        """Read what is new in the spool and commit it. Raises only on a journal failure."""
        gc_was_on = gc.isenabled()
        gc.disable()  # a poll allocates many short-lived objects and no cycles
        try:
            try:
                return self._poll()
            except _PoisonError:
                self.log.warning("spool.poison_isolation", note="one record per transaction")
            self._careful = True
            try:
                while True:
                    with contextlib.suppress(_RestartError):
                        return self._poll()
            finally:
                self._careful = False
        finally:
            if gc_was_on:
                gc.enable()

    def _poll(self) -> PollResult:
        self._budget = self.poll_records
        self._polled = Counter()
        self._to_remove = []
        groups, sizes = self._list()
        with self.state.lock:  # an ignored segment counts while it is in the spool
            self.state.ignored = {n: i for n, i in self.state.ignored.items() if n in sizes}
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
        except _RestartError:
            raise
        except BaseException as exc:
            self._reload()
            if _environmental(exc) or isinstance(exc, _PoisonError):
                raise
            raise _PoisonError from exc
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
            if name.endswith(PRIVATE_SUFFIX) and _PRIVATE_NAME.match(name):
                self._remove_abandoned(name)
                continue
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
        fd = self._open(name)
        if isinstance(fd, bool):
            return fd
        try:
            info = os.fstat(fd)
            if not self._trusted(name, fd, info):
                return True
            if state.ignored.pop(name, None) is not None:
                self._flagged.discard(name)  # its owner is trusted now (joined the group)
            if segment is None:
                segment = Segment(name, state.next_segment_id, producer, index)
                state.next_segment_id += 1
                state.segments[name] = segment
                self._batch.segments[name] = segment
            size = info.st_size
            if not self._read_until(fd, segment, size, final=False):
                return False  # stopped at the budget
            done = segment.sealed or later
            if not done and not _locked(fd):
                # Look again now that the lock is free: the writer may have appended (and then
                # closed) since the fstat above, which a long read can leave seconds behind.
                # Finishing at the old size lost every record written since.
                info = os.fstat(fd)
                if info.st_size != size:
                    return False  # read the rest first, next poll
                done = time.time() - info.st_mtime >= self.idle_grace
            if not done:
                return False
            # No more bytes will come: an incomplete frame is torn, and what follows a damaged
            # length that points past the end is read.
            if not self._read_until(fd, segment, size, final=True):
                return False
            segment.finished = True
            self._batch.segments[name] = segment
            self._to_remove.append(segment)
            return True
        finally:
            os.close(fd)

    def _open(self, name: str) -> int | bool:
        """The segment's descriptor; else whether it is done with (True: gone, a link, or
        unreadable, and counted; False: try again next poll)."""
        try:
            return os.open(self.directory / name, _OPEN_FLAGS)
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                self._reject_file(name, "not_regular", "a symbolic link")
                return True
            self._warn_once("open:" + name, "spool.open_failed", segment=name, error=str(exc))
            if exc.errno in (errno.EACCES, errno.EPERM):
                self._ignore(name, "unreadable", None)
                return True  # not a live producer: nothing of it is verified
            return False

    def _trusted(self, name: str, fd: int, info: os.stat_result) -> bool:
        """Whether the open segment is a regular file its owner may write; if not, it is
        rejected (once) and ignored."""
        if not stat.S_ISREG(info.st_mode):
            self._reject_file(name, "not_regular", "not a regular file")
            return False
        if not self.owner_rule(info.st_uid):
            who = f"owned by {user_name(info.st_uid)} (uid {info.st_uid}), who may not write"
            self._reject_file(name, "owner", f"{who} the spool")
            self._ignore(name, "owner", fd)
            return False
        return True

    def _read_until(self, fd: int, segment: Segment, size: int, *, final: bool) -> bool:
        """Read ``segment`` up to ``size``; False when stopped at the budget."""
        want = self.chunk_bytes
        while segment.offset < size and self._budget > 0:
            data = os.pread(fd, min(size - segment.offset, want), segment.offset)
            if not data:
                return True
            last = final and segment.offset + len(data) >= size
            consumed = self._consume(segment, data, final=last)
            if (
                len(self._batch.records) >= self.batch_records
                or time.monotonic() - self._batch_started >= self.batch_seconds
            ):
                self._commit()
            if consumed == 0:
                if segment.offset + len(data) < size and want < MAX_FRAME_BYTES:
                    # The frame (or a damaged length) runs past this read, not past the
                    # file: read again, wide enough for the longest frame.
                    want = MAX_FRAME_BYTES
                    continue
                return True  # an incomplete frame at the end: wait for the rest
            want = self.chunk_bytes
        return segment.offset >= size or self._budget > 0

    def _consume(  # noqa: C901, PLR0915 (the per-record loop: its checks inline, locals hoisted)
        self, segment: Segment, data: bytes, *, final: bool = False
    ) -> int:
        """Decode the frames of ``data`` (read at ``segment.offset``); returns bytes consumed.

        One function on purpose: it runs once per record, and a call per check (or locals
        read from ``self``) costs the catch-up measurably (docs/performance.md)."""
        state = self.state
        batch = self._batch
        base = segment.offset
        producer = self._producer(segment.producer)
        records = batch.records
        end = 0
        budget = start_budget = self._budget
        newest = state.last_record_ts
        now = time.time()
        earliest, latest = now - self.clock_past, now + self.clock_future
        clamped = 0
        careful = self._careful
        decode = decode_payload
        event = self._events.append
        name = segment.producer
        pid = producer.id
        last, last_ts = producer.last_seq, producer.last_ts
        open_damage, started = segment.open_damage, segment.started
        for offset, end, payload, error, is_open in iter_frames(data, final=final):
            if payload is None:
                # What continues the damage counted in the last read is not counted again; a
                # frame that starts with a magic (a torn tail, say) is new damage.
                if offset == 0 and open_damage and error == "framing":
                    open_damage = is_open
                    continue
                open_damage = is_open
                reason = error or "framing"
                self._reject(segment, base + offset, end - offset, reason, reason)
                continue
            open_damage = False
            try:
                record = decode(payload)
            except SchemaError as exc:
                self._reject(segment, base + offset, end - offset, exc.reason, str(exc))
                continue
            if record.producer != name:
                self._reject(segment, base + offset, end - offset, "producer", "")
                continue
            if type(record) is Hello and (started or _relabels(producer, record)):
                # Who writes a segment is said once, by its first record (the writer's hello),
                # and a producer is one process: a later hello, or one that names another
                # process than the producer's first, is forged or replayed. It is neither
                # applied nor allowed to take a sequence number from the records after it.
                message = "not its segment's first record" if started else "another identity"
                self._reject(segment, base + offset, end - offset, "hello", message)
                continue
            seq = record.seq
            if seq <= last:
                message = f"seq {seq} not above {last}"
                self._reject(segment, base + offset, end - offset, "sequence", message)
                continue
            started = True
            ts = record.ts
            if not earliest <= ts <= latest:
                ts = now
                clamped += 1
            if careful:
                producer.last_seq, producer.last_ts = last, last_ts
                self._store_alone(segment, producer, record, ts, base + end, base + offset)
                last, last_ts = producer.last_seq, producer.last_ts
            else:
                if seq != last + 1:
                    self._lost(producer, last + 1, seq - 1)
                last, last_ts = seq, ts
                if type(record) is Event:  # most records: no dispatch
                    event((record, ts))
                    records.append((pid, seq, "event", ts))
                else:
                    self._apply(segment, producer, record, ts)
                    records.append((pid, seq, TYPE_NAME[type(record)], ts))
            if ts > newest:  # noqa: PLR1730 (a call to max() per record costs more)
                newest = ts
            budget -= 1
            if budget <= 0:
                break
        if self._events:
            self._incidents(producer)
        accepted = start_budget - budget
        producer.last_seq, producer.last_ts = last, last_ts
        segment.open_damage, segment.started = open_damage, started
        self._budget = budget
        state.last_record_ts = newest
        segment.offset = base + end
        self._batch.segments[segment.name] = segment
        if clamped:
            self._count(DaemonCounter.SPOOL_CLAMPED_RECORDS, (), clamped)
        if self._incidents_seen:
            self._polled["incidents"] += self._count_incidents()
        if accepted:
            producer.retired = False
            self._batch.producers[producer.name] = producer
            if not careful:  # careful mode counts each record with its own commit
                self._count(DaemonCounter.SPOOL_RECORDS, (), accepted)
            self._polled["records"] += accepted
        return end

    def _apply(self, segment: Segment, producer: Producer, record: Record, ts: float) -> None:
        if type(record) is Event:
            self._events.append((record, ts))
            self._incidents(producer)
        elif type(record) is Counters:
            producer.counters = record.counters
        elif type(record) is Gauges:
            producer.gauges = {SERIES_OF[type(g)].name: g.value for g in record.gauges}
        elif type(record) is Hello:
            self._hello(producer, record)
        elif type(record) is NextSegment:
            segment.sealed = True

    def _store_alone(
        self,
        segment: Segment,
        producer: Producer,
        record: Record,
        ts: float,
        end: int,
        start: int,
    ) -> None:
        """Careful mode: commit this record in its own transaction, or dead-letter it."""
        self._commit()  # what came before it (rejects, positions)
        seq, last = record.seq, producer.last_seq
        try:
            if seq != last + 1:
                self._lost(producer, last + 1, seq - 1)
            producer.last_seq = seq
            producer.last_ts = ts
            self._apply(segment, producer, record, ts)
            self._batch.records.append((producer.id, seq, TYPE_NAME[type(record)], ts))
            segment.offset = end
            self._batch.segments[segment.name] = segment
            self._batch.producers[producer.name] = producer
            self._count(DaemonCounter.SPOOL_RECORDS, ())
            self._count_incidents()
            self._commit()
        except Exception as exc:
            self._incidents_seen.clear()
            self._events.clear()
            if _environmental(exc):
                raise
            self._dead_letter(segment.name, segment.producer, seq, start, end, exc)
            raise _RestartError from exc

    def _dead_letter(
        self, name: str, producer_name: str, seq: int, start: int, end: int, exc: Exception
    ) -> None:
        self._reload()
        segment = self.state.segments[name]
        producer = self._producer(producer_name)
        producer.last_seq = max(producer.last_seq, seq)
        self._batch.producers[producer.name] = producer
        segment.offset = end
        segment.rejects += 1
        self._batch.segments[name] = segment
        message = _redact(f"{type(exc).__name__}: {exc}")
        self._batch.rejects.append(
            RejectRow(
                time.time(), name, start, end - start, "internal", message, producer.name, seq
            )
        )
        self._count(DaemonCounter.SPOOL_REJECTED, ("internal",))
        self._polled["rejected"] += 1
        self._commit()
        self.log.error(
            "spool.record_dead_lettered",
            segment=name,
            producer=producer.name,
            seq=seq,
            offset=start,
            error=message,
        )

    # -- record kinds -------------------------------------------------------------------------

    def _producer(self, name: str) -> Producer:
        producer = self.state.producers.get(name)
        if producer is None:
            producer = Producer(name, self.state.next_producer_id, first_seen=time.time())
            self.state.next_producer_id += 1
            self.state.producers[name] = producer
            self._batch.producers[name] = producer
        return producer

    def _hello(self, producer: Producer, record: Hello) -> None:
        if self._events:  # their rows take the labels said before this hello
            self._incidents(producer)
        producer.engine = record.engine
        producer.engine_version = record.engine_version
        producer.role = record.role
        producer.model = record.model
        producer.rank = record.rank
        producer.pid = record.pid
        producer.node = record.node

    def _incidents(self, producer: Producer) -> None:
        """Build the incident rows of the events read (``_events``, all ``producer``'s), and
        count them by (detector, role, kind). One call per read rather than per event, with
        the producer's labels looked up once (docs/performance.md)."""
        node, role, engine = self.node, producer.role, producer.engine
        version, model, rank, name = (
            producer.engine_version,
            producer.model,
            producer.rank,
            producer.name,
        )
        rows = []
        event_part = _EVENT_PART
        join, affected = self._joiner.join, 0
        self._count_peers()
        for e, ts in self._events:
            row = Finding(
                None, ts, node, name, e.seq, role, engine, version, model, rank, *event_part(e)
            )
            if len(row.sources) > 1:
                row.sources = sorted_sources(row.sources)
            if len(row.detail) > 1:
                row.detail = sorted_detail(row.detail)
            rows.append(row)
            key, new = join(node, e.request_id, e.instance or "", (role, e.detector, e.kind), ts)
            affected += new
            if e.sources or e.other_sources:
                self._exposures(producer, e, key)
        if affected:
            self._count(DaemonCounter.AFFECTED_REQUESTS, (_ROLE(role),), affected)
        self._events.clear()
        self._batch.findings += rows
        self._incidents_seen.update(map(_INCIDENT_LABELS, rows))

    def _count_peers(self) -> None:
        """``kvwatch_transfer_mismatches_total{peer}`` for the events read that name the node
        that sent their KV; at most MAX_PEERS peers (the ones counted first), then other."""
        peers: list[str] = []
        for e, _ in self._events:
            peer = e.detail.get(catalogue.PEER_NODE) if e.detail else None
            if isinstance(peer, str) and peer and peer != catalogue.OTHER:
                peers.append(peer)
        if not peers:
            return
        known = {
            labels[0]
            for name, labels in self.state.daemon
            if name == DaemonCounter.TRANSFER_MISMATCHES
        }
        known.discard(catalogue.OTHER)
        for peer in peers:
            if peer not in known and len(known) < catalogue.MAX_PEERS:
                known.add(peer)
            self._count(
                DaemonCounter.TRANSFER_MISMATCHES, (peer if peer in known else catalogue.OTHER,)
            )

    def _count_incidents(self) -> int:
        """Add the incidents seen to ``kvwatch_incidents_total``; returns how many."""
        keys = self._incident_keys
        total = 0
        for raw, count in self._incidents_seen.items():
            key = keys.get(raw)
            if key is None:
                if len(keys) >= 4096:  # fresh junk values: bounded memory
                    keys.clear()
                key = keys[raw] = (
                    DaemonCounter.INCIDENTS,
                    (_DETECTOR(raw[0]), _ROLE(raw[1]), _KIND(raw[2])),
                )
            self._count(*key, count)
            total += count
        self._incidents_seen.clear()
        return total

    @staticmethod
    def _counted() -> tuple[Joiner, dict[tuple[str, str], None], dict[int, int]]:
        """What the affected and exposed counters remember: the incidents (the views' join
        rule), the exposed requests counted (an ordered set), each incident's unnamed sources
        counted."""
        return Joiner(limit=_JOINED_MAX), {}, {}

    def _exposures(self, producer: Producer, record: Event, incident: int) -> None:
        """The exposed requests an event counts, as :func:`kvwatch.store.incident.counts` does:
        each named source once, and an incident's sources counted only in ``other_sources``
        (the most any of its findings says). Its sources are stored with its finding."""
        named = [(source.request_id, source.instance or "") for source in record.sources]
        if record.kind in NOT_READS:  # an older producer's late write: nobody read it
            return
        if stopped_before_read(record.detail):  # enforce failed it before it read
            return
        seen, others_seen = self._exposed_seen, self._others_seen
        new = 0
        for key in named:
            if key not in seen:
                seen[key] = None
                new += 1
        counted = others_seen.get(incident, 0)
        others = max(0, record.other_sources - counted)
        others_seen[incident] = max(counted, record.other_sources)
        for table, most in ((seen, _EXPOSED_SEEN_MAX), (others_seen, _JOINED_MAX)):
            if len(table) > most:  # bounded memory: the oldest half goes
                for old in list(table)[: len(table) // 2]:
                    del table[old]  # type: ignore[arg-type]
        self._count(DaemonCounter.EXPOSED_REQUESTS, (_ROLE(producer.role),), new + others)

    def _lost(self, producer: Producer, first: int, last: int) -> None:
        count = last - first + 1
        self._batch.gaps.append((time.time(), producer.name, first, last))
        self._count(DaemonCounter.SPOOL_LOST_RECORDS, (), count)
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
        self._batch.rejects.append(
            RejectRow(time.time(), segment.name, offset, length, reason, message)
        )
        self._count(DaemonCounter.SPOOL_REJECTED, (reason,))
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

    def _ignore(self, name: str, reason: str, fd: int | None) -> None:
        """Keep ``name`` in :attr:`State.ignored` with its owner and, when the daemon can read
        it (``fd``), the detection events it holds: findings the journal does not have."""
        try:
            info = os.fstat(fd) if fd is not None else os.lstat(self.directory / name)
        except OSError:
            return
        ignored = self.state.ignored.get(name)
        if ignored is None or ignored.reason != reason:
            ignored = Ignored(reason, info.st_uid, user_name(info.st_uid))
            self.state.ignored[name] = ignored
        if fd is None or ignored.size == info.st_size:
            return
        findings = 0
        data = os.pread(fd, min(info.st_size, _IGNORED_SCAN_BYTES), 0)
        for _offset, _end, payload, _error, _open in iter_frames(data, final=True):
            if payload is not None:
                with contextlib.suppress(SchemaError):
                    findings += type(decode_payload(payload)) is Event
        ignored.findings, ignored.size = findings, info.st_size

    def _reject_file(self, name: str, reason: str, message: str) -> None:
        if name in self._flagged:
            return
        self._flagged.add(name)
        self._batch.rejects.append(RejectRow(time.time(), name, 0, 0, reason, message))
        self._count(DaemonCounter.SPOOL_REJECTED, (reason,))
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
        # shutil.move copies and removes where a rename cannot (another filesystem: EXDEV).
        shutil.move(path, self.quarantine_dir / path.name)
        self.log.warning("spool.segment_quarantined", segment=path.name)
        kept = sorted(self.quarantine_dir.iterdir(), key=lambda p: p.stat().st_mtime)
        for old in kept[: max(0, len(kept) - self.quarantine_max)]:
            with contextlib.suppress(OSError):
                old.unlink()

    def _remove_abandoned(self, name: str) -> None:
        """A producer killed while creating a segment leaves its private file: remove it once
        nobody holds its lock and it has been idle for ``idle_grace`` (never the file of a
        producer creating one right now, which holds the lock)."""
        try:
            fd = os.open(self.directory / name, _OPEN_FLAGS)
        except OSError:
            return
        try:
            info = os.fstat(fd)
            if (
                not stat.S_ISREG(info.st_mode)
                or not self.owner_rule(info.st_uid)
                or _locked(fd)
                or time.time() - info.st_mtime < self.idle_grace
            ):
                return
            with contextlib.suppress(OSError):
                os.unlink(self.directory / name)
                self.log.info("spool.abandoned_removed", file=name, bytes=info.st_size)
        finally:
            os.close(fd)

    def _commit(self) -> None:
        batch = self._batch
        if not batch:
            return
        stored = self.journal.commit(batch, self.state)
        incidents = len(batch.findings)
        self._batch = Batch()
        self._batch_started = time.monotonic()
        if stored is not None and self.on_stored is not None:
            self.on_stored(stored)
        if incidents:
            self.log.warning("spool.incidents_recorded", count=incidents)

    def _reload(self) -> None:
        """After a failed commit: forget everything not in the journal."""
        self._batch = Batch()
        self._to_remove = []
        self._events.clear()
        self._incidents_seen.clear()
        # What it counted may not have been committed.
        self._joiner, self._exposed_seen, self._others_seen = self._counted()
        self.state.replace_with(self.journal.load())


def _relabels(producer: Producer, hello: Hello) -> bool:
    """True when ``hello`` names another process than the one ``producer``'s first hello did."""
    return producer.pid != 0 and (
        hello.engine, hello.engine_version, hello.role, hello.model, hello.rank, hello.pid,
        hello.node,
    ) != (
        producer.engine, producer.engine_version, producer.role, producer.model, producer.rank,
        producer.pid, producer.node,
    )  # fmt: skip


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
