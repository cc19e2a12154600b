"""Frame and record checks, the reader's hot loop: every frame of a read is framed and
CRC-checked, decoded and checked (schema, producer, a segment's one hello, sequence numbers,
the clock window) and handed on: an event to the findings built per read, any other record to
the state, a rejected one to the journal's ``rejects`` with its reason.
"""

from __future__ import annotations

import os
import time
from typing import Final

from kvspool import SchemaError, decode_payload, iter_frames
from kvspool.catalogue import DaemonCounter
from kvspool.framing import MAX_FRAME_BYTES
from kvspool.records import TYPE_NAME, Event, Hello
from kvwatch.ingest.spool.apply import relabels as _relabels
from kvwatch.ingest.spool.poison import PoisonIsolation
from kvwatch.store.state import Segment

#: A record's ``ts`` outside [daemon clock - past, daemon clock + future] is stored as the
#: daemon's clock, and counted (``kvwatch_spool_clamped_records_total``): the record is kept
#: (it may be evidence), and a wild clock cannot hide it from the retention, the "hooks
#: silent" alert or the incident list. Producers share the daemon's node and clock, so the
#: future window is small; the past one covers a daemon down for weeks with a full spool.
CLOCK_PAST_SECONDS: Final = 30 * 86400.0
CLOCK_FUTURE_SECONDS: Final = 300.0


class FrameReader(PoisonIsolation):
    """A segment's bytes into checked records (see the module)."""

    clock_past: float
    clock_future: float

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
                if exc.producer == name and exc.seq is not None and exc.seq > last:
                    # A body this schema refuses (a newer writer's): counted once, as rejected,
                    # never also as a gap. Its number is only excused, never taken: a forged
                    # record must not steal the number of the intact one after it.
                    producer.excuse(exc.seq)
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
