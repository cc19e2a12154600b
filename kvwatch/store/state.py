"""The daemon's in-memory view: producers, counter totals, gauges and its own health.

The journal is the source of truth; this is a cache of it that the spool reader updates and the
metrics collector reads (under :attr:`State.lock`). After a failed journal commit the reader
reloads it from the journal, so it never runs ahead of what is durable.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

from kvspool import catalogue
from kvspool.records import SERIES_OF, CounterSeries
from kvwatch.ingest.spool.owner import Ignored

OTHER: Final = catalogue.OTHER
#: Distinct model names / engine versions / ranks kept as label values before "other".
MAX_MODELS: Final = 16
MAX_VERSIONS: Final = 16
MAX_RANKS: Final = 64
#: Rejected records' numbers a producer keeps excused from the gap count at once.
MAX_EXCUSED: Final = 4096

LabelKey = tuple[str, ...]
Totals = defaultdict[tuple[str, LabelKey], float]


def totals() -> Totals:
    return defaultdict(float)


class FirstN:
    """The first ``limit`` distinct values of an unbounded label, in the order offered; later
    ones are "other". Built afresh from the live producers for each view, so a slot held by a
    producer that is gone (junk included) is free again."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept: set[str] = set()

    def __call__(self, value: object) -> str:
        text = str(value)
        if text in self.kept:
            return text
        if len(self.kept) < self.limit:
            self.kept.add(text)
            return text
        return OTHER

    def known(self, value: object) -> str:
        """``value`` as bounded by the slots already taken, taking none."""
        text = str(value)
        return text if text in self.kept else OTHER


@dataclass(slots=True)
class Producer:
    """One engine process, as its records describe it."""

    name: str
    id: int
    engine: str = OTHER
    engine_version: str = ""
    role: str = OTHER
    model: str = ""
    rank: int = 0
    node: str = ""
    pid: int = 0
    first_seen: float = 0.0
    last_ts: float = 0.0
    last_seq: int = 0
    #: How its hooks run, from its hello: the catalogue MODE of its detectors, its scrub setting,
    #: and the settings it started with that were invalid (catalogue SETTING names).
    mode: str = ""
    scrub: str = ""
    config_errors: tuple[str, ...] = ()
    #: The latest cumulative counter snapshot, as the record carried it.
    counters: list[CounterSeries] = field(default_factory=list)
    gauges: dict[str, float] = field(default_factory=dict)
    #: True once none of its segments is left in the spool: its gauges go, its counters stay.
    retired: bool = False
    retired_at: float = 0.0
    #: Numbers above ``last_seq`` of records rejected whole (a body the schema refuses): not a
    #: gap when the next accepted record comes. In memory only; bounded (:data:`MAX_EXCUSED`).
    excused: set[int] = field(default_factory=set)

    def excuse(self, seq: int) -> None:
        if len(self.excused) >= MAX_EXCUSED:
            self.excused.discard(min(self.excused))  # the oldest is counted lost, if still missing
        self.excused.add(seq)

    def missing(self, first: int, last: int) -> list[tuple[int, int]]:
        """The runs of numbers in [first, last] neither read nor excused; forgets every excused
        number up to ``last`` (a record above them was read)."""
        inside = sorted(n for n in self.excused if first <= n <= last)
        self.excused = {n for n in self.excused if n > last}
        runs, start = [], first
        for n in inside:
            if n > start:
                runs.append((start, n - 1))
            start = n + 1
        if start <= last:
            runs.append((start, last))
        return runs


@dataclass(slots=True)
class Segment:
    """The read position in one segment file, as committed in the journal."""

    name: str
    id: int
    producer: str
    index: int
    offset: int = 0
    sealed: bool = False
    finished: bool = False  # every byte is accounted for: committed, rejected or torn
    removed: bool = False
    rejects: int = 0
    #: The last read ended inside damage (not persisted: after a restart it is counted again).
    open_damage: bool = False
    #: A record of it was stored: a hello now is not its first record, so forged or replayed
    #: (not persisted: after a restart, a position past its start counts as started).
    started: bool = False

    def __post_init__(self) -> None:
        self.started = self.started or self.offset > 0


@dataclass(slots=True)
class EngineLogView:
    """What an engine log says about one engine rank: a snapshot of its
    :class:`kvwatch.ingest.logs.parse.EngineView` (``source="log"`` on /metrics)."""

    role: str
    engine: str
    model: str
    rank: int
    gauges: dict[str, float] = field(default_factory=dict)
    version: str = ""


@dataclass
class State:
    producers: dict[str, Producer] = field(default_factory=dict)
    segments: dict[str, Segment] = field(default_factory=dict)
    #: Counters of producers pruned from the journal, folded in so totals never go down.
    base: Totals = field(default_factory=totals)
    #: The daemon's own counters, persisted with every commit: (name, labels) -> value.
    daemon: Totals = field(default_factory=totals)
    last_record_ts: float = 0.0
    lag_bytes: int = 0
    live_producers: int = 0
    #: Segments in the spool the reader leaves unread (foreign owner, unreadable), by name.
    ignored: dict[str, Ignored] = field(default_factory=dict)
    logs: dict[str, EngineLogView] = field(default_factory=dict)
    log_counts: Totals = field(default_factory=totals)
    #: collector name -> (success, duration in seconds) of its last run.
    collectors: dict[str, tuple[bool, float]] = field(default_factory=dict)
    #: What failed the last spool poll, naming the part ("the journal's disk is full ..."); ""
    #: when it succeeded. ``journal_failing``: that part is the journal (``/-/ready`` is 503).
    poll_problem: str = ""
    journal_failing: bool = False
    #: The last configuration reload (SIGHUP): whether it applied, and when one last did (the
    #: start counts as one).
    config_reload_ok: bool = True
    config_reload_ts: float = 0.0
    next_producer_id: int = 1
    next_segment_id: int = 1
    lock: threading.RLock = field(default_factory=threading.RLock)

    def replace_with(self, other: State) -> None:
        """Take ``other``'s contents (after a reload from the journal), keeping the lock."""
        with self.lock:
            for name in (
                "producers",
                "segments",
                "base",
                "daemon",
                "last_record_ts",
                "next_producer_id",
                "next_segment_id",
            ):
                setattr(self, name, getattr(other, name))

    def hook_counter_totals(self) -> Totals:
        """Every producer's latest snapshot (retired ones included) plus the pruned base."""
        out = totals()
        out.update(self.base)
        for producer in self.producers.values():
            for family, labels, value in producer_counter_series(producer):
                out[(family, labels)] += value
        return out


def producer_counter_series(producer: Producer) -> Iterator[tuple[str, LabelKey, float]]:
    """A producer's cumulative snapshot as (family, label values, value), labels bounded."""
    role = catalogue.ROLE.bound(producer.role)
    for item in producer.counters:
        series = SERIES_OF[type(item)]
        labels = item.labels
        values = tuple(
            role if label is catalogue.ROLE else label.bound(getattr(labels, label.name))
            for label in series.labels
        )
        yield series.family, values, item.value
