"""Applying accepted records to the state: producers (their hello, counters and gauges), the
findings built from events (one :class:`~kvwatch.store.incident.Finding` each, in one call per
read) and the daemon's counters of them (incidents, affected and exposed requests, transfer
mismatches by peer, lost records), with the bounded memory that counts each once.
"""

from __future__ import annotations

import time
from collections import Counter
from operator import attrgetter
from typing import Final

from kvspool import catalogue
from kvspool.catalogue import DaemonCounter
from kvspool.records import (
    SERIES_OF,
    Counters,
    Event,
    Gauges,
    Hello,
    NextSegment,
    Record,
    stopped_before_read,
)
from kvwatch.ingest.spool.directory import SpoolDirectory
from kvwatch.store.incident import (
    FINDING_FIELDS,
    NOT_READS,
    Finding,
    Joiner,
    sorted_detail,
    sorted_sources,
)
from kvwatch.store.journal import Batch
from kvwatch.store.state import Producer, Segment

_DETECTOR, _ROLE, _KIND = catalogue.DETECTOR.bound, catalogue.ROLE.bound, catalogue.KIND.bound
#: Incidents the reader remembers to count each once (``kvwatch_affected_requests_total``):
#: more than join in any minute but a storm; a later finding of one forgotten counts it again.
#: Its memory: docs/performance.md (test_cardinality holds the daemon's memory flat, fresh ids).
_JOINED_MAX: Final = 1024
#: Exposed requests the reader remembers to count each once (``kvwatch_exposed_requests_total``).
_EXPOSED_SEEN_MAX: Final = 16384
#: A finding's fields after its producer's labels: the event record's of the same names.
_EVENT_PART: Final = attrgetter(*FINDING_FIELDS[FINDING_FIELDS.index("rank") + 1 :])


class RecordApplier(SpoolDirectory):
    """Records into the state and the batch (see the module)."""

    _incident_keys: dict[tuple[str, str, str], tuple[str, tuple[str, ...]]]
    _incidents_seen: Counter[tuple[str, str, str]]  # (role, detector, kind), as join() takes
    _joiner: Joiner
    _exposed_seen: dict[tuple[str, str], None]
    _others_seen: dict[int, int]
    _events: list[tuple[Event, float]]

    def _init_applier(self) -> None:
        self._incident_keys = {}
        #: (role, detector, kind) as the records said them -> incidents not yet counted.
        self._incidents_seen = Counter()
        self._joiner, self._exposed_seen, self._others_seen = self._counted()
        #: Events read, their incident rows not yet built (see _incidents).
        self._events = []

    def _producer(self, name: str) -> Producer:
        producer = self.state.producers.get(name)
        if producer is None:
            producer = Producer(name, self.state.next_producer_id, first_seen=time.time())
            self.state.next_producer_id += 1
            self.state.producers[name] = producer
            self._batch.producers[name] = producer
        return producer

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
        producer.mode = record.mode
        producer.scrub = record.scrub
        producer.config_errors = record.config_errors

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
        seen = []  # each row's (role, detector, kind): built once for the join and the count
        event_part = _EVENT_PART
        join, affected = self._joiner.join, 0
        self._count_peers()
        opened, at = self._batch.opened, len(self._batch.findings)
        for e, ts in self._events:
            row = Finding(
                None, ts, node, name, e.seq, role, engine, version, model, rank, *event_part(e)
            )
            if len(row.sources) > 1:
                row.sources = sorted_sources(row.sources)
            if len(row.detail) > 1:
                row.detail = sorted_detail(row.detail)
            rows.append(row)
            what = (role, e.detector, e.kind)
            seen.append(what)
            key, new = join(node, e.request_id, e.instance or "", what, ts)
            affected += new
            if new:
                opened.append(at + len(rows) - 1)
            if e.sources or e.other_sources:
                self._exposures(producer, e, key)
        if affected:
            self._count(DaemonCounter.AFFECTED_REQUESTS, (_ROLE(role),), affected)
        self._events.clear()
        self._batch.findings += rows
        self._incidents_seen.update(seen)

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
        """Add the findings seen to ``kvwatch_findings_total``; returns how many."""
        keys = self._incident_keys
        total = 0
        for raw, count in self._incidents_seen.items():
            key = keys.get(raw)
            if key is None:
                if len(keys) >= 4096:  # fresh junk values: bounded memory
                    keys.clear()
                key = keys[raw] = (
                    DaemonCounter.FINDINGS,
                    (_DETECTOR(raw[1]), _ROLE(raw[0]), _KIND(raw[2])),
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
        """Numbers ``first``..``last`` were never read; those of records rejected whole are not
        lost (each was counted once, as rejected)."""
        for start, end in producer.missing(first, last):
            count = end - start + 1
            self._batch.gaps.append((time.time(), producer.name, start, end))
            self._count(DaemonCounter.SPOOL_LOST_RECORDS, (), count)
            self._polled["lost"] += count
            self.log.warning(
                "spool.records_lost",
                producer=producer.name,
                first_seq=start,
                last_seq=end,
                lost=count,
            )

    def _reload(self) -> None:
        """After a failed commit: forget everything not in the journal."""
        self._batch = Batch()
        self._to_remove = []
        self._events.clear()
        self._incidents_seen.clear()
        # What it counted may not have been committed.
        self._joiner, self._exposed_seen, self._others_seen = self._counted()
        self.state.replace_with(self.journal.load())


def relabels(producer: Producer, hello: Hello) -> bool:
    """True when ``hello`` names another process than the one ``producer``'s first hello did."""
    return producer.pid != 0 and (
        hello.engine, hello.engine_version, hello.role, hello.model, hello.rank, hello.pid,
        hello.node,
    ) != (
        producer.engine, producer.engine_version, producer.role, producer.model, producer.rank,
        producer.pid, producer.node,
    )  # fmt: skip
