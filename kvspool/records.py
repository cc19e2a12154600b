"""The record types: what a spool record may say, as typed msgspec structs with constraints.

Every record carries ``v`` (schema version), ``type``, ``producer``, ``seq`` (per producer, from
1, no gaps unless records were lost) and ``ts`` (Unix seconds). The constraints make every record
that decodes safe to store (SQLite INTEGER is int64, TEXT is valid UTF-8), to sum and render
(finite numbers well inside float64, timestamps a datetime can show) and to alert on (no NaN). No
field carries prompt text, token ids or KV bytes: only request ids, page ids, digests and counts.
The counter and gauge series are derived from :mod:`kvspool.catalogue`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, Union

import msgspec
from msgspec import Meta, Struct

from kvspool import catalogue

SCHEMA_VERSION: Final = 1
#: The largest payload a producer writes and a reader accepts.
MAX_RECORD_BYTES: Final = 64 * 1024
#: An event names at most this many pages; ``pages_total`` keeps the true count.
MAX_EVENT_PAGES: Final = 256
#: An event names at most this many source requests (the ones with most pages); the rest are
#: counted in ``other_sources`` and ``other_source_pages``.
MAX_EVENT_SOURCES: Final = 16
MAX_STRING_CHARS: Final = 256
MAX_DETAIL_ITEMS: Final = 256
MAX_SERIES: Final = 4096
#: A hello names at most this many invalid settings (a catalogue SETTING each).
MAX_CONFIG_ERRORS: Final = 32
INT64_MIN: Final = -(1 << 63)
INT64_MAX: Final = (1 << 63) - 1
#: Counter and gauge values: any count or number of seconds, and sums of millions of them stay
#: far from float64's overflow.
MAX_VALUE: Final = float(1 << 63)
#: The latest timestamp a record may carry: 9999-12-31T23:59:59Z, the last a datetime shows.
#: The daemon also clamps what lies outside a window of its own clock (see
#: kvwatch.ingest.spool.reader).
MAX_TS: Final = 253_402_300_799.0

Text = Annotated[str, Meta(max_length=MAX_STRING_CHARS)]
Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Meta(ge=0, le=INT64_MAX)]
Seq = Annotated[int, Meta(ge=1, le=INT64_MAX)]
Timestamp = Annotated[float, Meta(ge=0.0, le=MAX_TS)]
Value = Annotated[float, Meta(ge=0.0, le=MAX_VALUE)]

HELLO: Final = "hello"
COUNTERS: Final = "counters"
GAUGES: Final = "gauges"
EVENT: Final = "event"
NEXT_SEGMENT: Final = "seal"  # the wire's type string, kept


class _Record(Struct, kw_only=True, tag_field="type", frozen=True, gc=False):
    v: Literal[1]
    producer: Text
    seq: Seq
    ts: Timestamp


class Hello(_Record, tag=HELLO, frozen=True, gc=False):
    """First record of every segment: who writes it, so the daemon can label it on its own."""

    engine: Text
    engine_version: Text
    role: Text
    model: Text
    rank: Int64
    pid: Int64
    node: Text = ""
    # The engine's PD settings, as far as its adapter knows them (SGLang's ServerArgs): what an
    # operator checks first when an incident names this producer.
    disaggregation_mode: Text = ""
    transfer_backend: Text = ""
    page_size: Int64 = 0
    kv_canary: Text = ""
    kv_checksum: bool = False
    # How its hooks run (``kvwatch_engine_info{mode,scrub}``): the engine's mode (a catalogue
    # MODE value), its scrub setting, and the settings it started with that were invalid (each
    # a catalogue SETTING, run with its documented fallback).
    mode: Text = ""
    scrub: Text = ""
    config_errors: Annotated[tuple[Text, ...], Meta(max_length=MAX_CONFIG_ERRORS)] = ()


def _series_type(series: catalogue.Series) -> type[Struct]:
    """``[name, {label: value, ...}, value]``, the labels exactly the catalogue's."""
    labels = msgspec.defstruct(
        f"{series.name}_labels",
        [(label.name, Text) for label in series.record_labels],
        forbid_unknown_fields=True,
        frozen=True,
        gc=False,
    )
    return msgspec.defstruct(
        series.name,
        [("labels", labels), ("value", Value)],
        tag=series.name,
        tag_field="name",
        array_like=True,
        frozen=True,
        gc=False,
    )


COUNTER_TYPES: Final = {series.name: _series_type(series) for series in catalogue.COUNTER_SERIES}
GAUGE_TYPES: Final = {series.name: _series_type(series) for series in catalogue.GAUGE_SERIES}
#: A decoded series struct's type -> its catalogue entry.
SERIES_OF: Final[dict[type, catalogue.Series]] = {
    COUNTER_TYPES[s.name]: s for s in catalogue.COUNTER_SERIES
} | {GAUGE_TYPES[s.name]: s for s in catalogue.GAUGE_SERIES}
if TYPE_CHECKING:  # unions built at run time from the catalogue: to mypy, any series struct
    CounterSeries = Any
    GaugeSeries = Any
else:
    CounterSeries = Union[tuple(COUNTER_TYPES.values())]  # noqa: UP007
    GaugeSeries = Union[tuple(GAUGE_TYPES.values())]  # noqa: UP007


class Counters(_Record, tag=COUNTERS, frozen=True, gc=False):
    """A producer's cumulative counter snapshot: the latest one replaces the ones before."""

    counters: Annotated[list[CounterSeries], Meta(max_length=MAX_SERIES)]


class Gauges(_Record, tag=GAUGES, frozen=True, gc=False):
    gauges: Annotated[list[GaugeSeries], Meta(max_length=MAX_SERIES)]


class Source(Struct, kw_only=True, frozen=True, gc=False, forbid_unknown_fields=True):
    """A request whose KV the event's reader was exposed to: it last wrote ``pages`` of the
    pages the reader had no right to read (the hooks' per-page last-writer record)."""

    request_id: Text
    pages: Count
    instance: Text | None = None
    #: When it last wrote one of those pages (Unix seconds); 0 when the hooks do not know.
    written_at: Timestamp = 0.0


class Event(_Record, tag=EVENT, frozen=True, gc=False):
    """One detection: a request read (or would read) pages it did not write."""

    detector: Text
    kind: Text
    mode: Text
    action: Text
    request_id: Text
    pages: Annotated[list[Int64], Meta(max_length=MAX_EVENT_PAGES)]
    pages_total: Count
    detail: Annotated[dict[Text, Int64 | Text], Meta(max_length=MAX_DETAIL_ITEMS)] = {}
    #: The request instance (one per admission), where the engine adapter knows it.
    instance: Text | None = None
    #: Whose data the pages held (the blast radius), most pages first; empty when the pages
    #: held nobody's data or the detector cannot tell (e.g. an admission finding).
    sources: Annotated[list[Source], Meta(max_length=MAX_EVENT_SOURCES)] = []
    #: Source requests beyond ``sources``, and their pages.
    other_sources: Count = 0
    other_source_pages: Count = 0


#: ``Event.detail`` key, value 1: enforce mode failed the request at a check the engine ran
#: before it read the pages, so the event's request read nothing of them. Its ``sources``
#: say whose KV the pages held (what it would have read); it names no reader and exposed
#: nobody. Set by the hooks only where the engine says the check precedes its read.
STOPPED_BEFORE_READ: Final = "stopped_before_read"


def stopped_before_read(detail: Mapping[str, Any] | None) -> bool:
    """Whether an event's ``detail`` says its request was stopped before it read."""
    return detail is not None and detail.get(STOPPED_BEFORE_READ) == 1


class NextSegment(_Record, tag=NEXT_SEGMENT, frozen=True, gc=False):
    """Last record of a full segment, naming the next one."""

    next_segment: Text


Record = Hello | Counters | Gauges | Event | NextSegment
#: A record struct's type -> its ``type`` on the wire.
TYPE_NAME: Final[dict[type, str]] = {
    Hello: HELLO,
    Counters: COUNTERS,
    Gauges: GAUGES,
    Event: EVENT,
    NextSegment: NEXT_SEGMENT,
}
RECORD_TYPES: Final = frozenset(TYPE_NAME.values())
