"""Poison isolation: a record that passes the checks but cannot be stored (a daemon bug, or a
limit the checks missed) costs that record alone. The poll is redone one record per
transaction (careful mode), and the one that fails is dead-lettered (a ``rejects`` row with its
producer, sequence number, offset and reason ``internal``), the read position moves past it,
and every other record commits. Errors of the journal's storage are retried, never
dead-lettered.
"""

from __future__ import annotations

import sqlite3
import time

from kvspool.catalogue import DaemonCounter
from kvspool.records import TYPE_NAME, Record
from kvwatch.ingest.spool.apply import RecordApplier
from kvwatch.ingest.spool.sink import redact
from kvwatch.store.journal import RejectRow
from kvwatch.store.state import Producer, Segment


class PoisonError(Exception):
    """A valid record could not be stored: redo the poll one record per transaction."""


class RestartError(Exception):
    """A record was dead-lettered and the state reloaded: start the pass again."""


def environmental(exc: BaseException) -> bool:
    """Errors of the journal's storage (disk, locks), not of a record: retried, never
    dead-lettered."""
    return isinstance(exc, (sqlite3.OperationalError, OSError, MemoryError)) or not isinstance(
        exc, Exception
    )


class PoisonIsolation(RecordApplier):
    """Careful mode's one-record transactions and the dead letter (see the module)."""

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
            if environmental(exc):
                raise
            self._dead_letter(segment.name, segment.producer, seq, start, end, exc)
            raise RestartError from exc

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
        message = redact(f"{type(exc).__name__}: {exc}")
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
