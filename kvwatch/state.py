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
from typing import Any, Final

from kvspool import schema

OTHER: Final = schema.OTHER
#: Distinct model names / engine versions / ranks kept as label values before "other".
MAX_MODELS: Final = 16
MAX_VERSIONS: Final = 16
MAX_RANKS: Final = 64

#: Reasons a spool frame or file is rejected (``kvwatch_spool_rejected_total{reason}``).
REJECT_REASONS: Final = (
    "crc",  # the payload's CRC32 does not match
    "framing",  # bytes that are not a frame (no magic): damage, resynchronised
    "oversize",  # a frame longer than kvspool.MAX_RECORD_BYTES
    "torn",  # an incomplete last frame of a segment whose producer is gone
    "malformed",  # not JSON, or a field missing / of the wrong type
    "schema",  # an unknown schema version or record type
    "producer",  # a record naming another producer than its segment
    "sequence",  # a sequence number not above the last one seen (duplicate, replay)
    "owner",  # a segment file owned by a user not allowed to write the spool (fstat)
    "not_regular",  # a segment name that is a FIFO, device, directory or symlink
    "name",  # a *.kvs file whose name is not <producer>.<index>.kvs
)

#: Hook counter name -> (metric family, label names in the family, labels taken from the producer).
HOOK_COUNTERS: Final[dict[str, tuple[str, tuple[str, ...]]]] = {
    "verifications": ("kvwatch_verifications", ("detector", "role")),
    "verifications_skipped": ("kvwatch_verifications_skipped", ("detector", "role", "reason")),
    "mismatches": ("kvwatch_mismatches", ("detector", "role", "kind")),
    "aborted_admissions": ("kvwatch_aborted_admissions", ("queue", "role")),
    "hook_seconds": ("kvwatch_hook_seconds", ("hook", "role")),
    "hook_errors": ("kvwatch_hook_errors", ("hook", "role")),
    "spool_dropped": ("kvwatch_spool_dropped_records", ("reason",)),
}

#: The value set of each label in the families above, "other" included.
LABEL_SETS: Final[dict[str, tuple[str, ...]]] = {
    "detector": tuple(sorted(schema.DETECTORS | {OTHER})),
    "role": tuple(sorted(schema.ROLES)),
    "kind": tuple(sorted(schema.KINDS)),
    "queue": tuple(sorted(schema.QUEUES)),
    "hook": tuple(sorted(schema.HOOKS | {OTHER})),
    "engine": tuple(sorted(schema.ENGINES)),
}
SKIP_REASONS: Final = tuple(sorted(schema.SKIP_REASONS))
DROP_REASONS: Final = tuple(sorted(schema.DROP_REASONS | {OTHER}))

LabelKey = tuple[str, ...]
Totals = defaultdict[tuple[str, LabelKey], float]


def totals() -> Totals:
    return defaultdict(float)


def bound(label: str, value: object) -> str:
    """``value`` if it is in ``label``'s fixed set, else "other"."""
    text = str(value)
    return text if text in LABEL_SETS[label] else OTHER


class FirstN:
    """Keeps the first ``limit`` distinct values of an unbounded label; later ones are "other"."""

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
    host: str = ""
    pid: int = 0
    first_seen: float = 0.0
    last_ts: float = 0.0
    last_seq: int = 0
    #: The latest cumulative counter snapshot, as the record carried it.
    counters: list[list[Any]] = field(default_factory=list)
    gauges: dict[str, float] = field(default_factory=dict)
    #: True once none of its segments is left in the spool: its gauges go, its counters stay.
    retired: bool = False
    retired_at: float = 0.0


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


@dataclass(slots=True)
class LogSource:
    """Pool/context values one watched engine log reported (``source="log"``)."""

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
    logs: dict[str, LogSource] = field(default_factory=dict)
    log_counts: Totals = field(default_factory=totals)
    #: collector name -> (success, duration in seconds) of its last run.
    collectors: dict[str, tuple[bool, float]] = field(default_factory=dict)
    next_producer_id: int = 1
    next_segment_id: int = 1
    lock: threading.RLock = field(default_factory=threading.RLock)
    models: FirstN = field(default_factory=lambda: FirstN(MAX_MODELS))
    versions: FirstN = field(default_factory=lambda: FirstN(MAX_VERSIONS))
    ranks: FirstN = field(default_factory=lambda: FirstN(MAX_RANKS))

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
    for item in producer.counters:
        name, labels, value = item
        spec = HOOK_COUNTERS.get(name)
        if spec is None:
            continue
        family, label_names = spec
        values: list[str] = []
        for label in label_names:
            if label == "role":
                values.append(bound("role", producer.role))
            elif label == "reason":
                allowed = DROP_REASONS if name == "spool_dropped" else SKIP_REASONS
                text = str(labels.get("reason", OTHER))
                values.append(text if text in allowed else OTHER)
            else:
                values.append(bound(label, labels.get(label, OTHER)))
        yield family, tuple(values), float(value)
