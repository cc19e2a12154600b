"""The single gate: bytes in, a typed record (:mod:`kvspool.records`) or a :class:`SchemaError`.

The names the engine adapters use (record types, limits, each counter's label names) are
re-exported here from :mod:`kvspool.records` and :mod:`kvspool.catalogue`, where they are defined.
"""

from __future__ import annotations

from typing import Final

import msgspec

from kvspool import catalogue
from kvspool.records import (
    COUNTERS,
    EVENT,
    GAUGES,
    HELLO,
    MAX_EVENT_PAGES,
    MAX_EVENT_SOURCES,
    MAX_RECORD_BYTES,
    MAX_STRING_CHARS,
    NEXT_SEGMENT,
    RECORD_TYPES,
    SCHEMA_VERSION,
    Record,
    Seq,
    Text,
)

OTHER: Final = catalogue.OTHER
#: Counter name -> the label names its series carry in a record, in order.
COUNTER_LABELS: Final = {
    s.name: tuple(label.name for label in s.record_labels) for s in catalogue.COUNTER_SERIES
}
GAUGE_LABELS: Final = {s.name: () for s in catalogue.GAUGE_SERIES}

__all__ = [
    "COUNTERS",
    "COUNTER_LABELS",
    "EVENT",
    "GAUGES",
    "GAUGE_LABELS",
    "HELLO",
    "MAX_EVENT_PAGES",
    "MAX_EVENT_SOURCES",
    "MAX_RECORD_BYTES",
    "MAX_STRING_CHARS",
    "NEXT_SEGMENT",
    "OTHER",
    "RECORD_TYPES",
    "SCHEMA_VERSION",
    "SchemaError",
    "decode_payload",
    "encode_payload",
    "validate",
]


class SchemaError(ValueError):
    """A payload that is not a valid record; ``reason`` is a bounded label value. ``producer``
    and ``seq`` are the envelope's where it still reads (JSON with a valid producer and
    sequence number, a body this schema refuses): the record is rejected, its number is not
    lost."""

    def __init__(
        self, reason: str, message: str, producer: str | None = None, seq: int | None = None
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.producer = producer
        self.seq = seq


class _Envelope(msgspec.Struct, frozen=True, gc=False):
    """What every record carries, whatever its body: who wrote it and its number."""

    producer: Text
    seq: Seq


#: Compact JSON, as the writer writes it. NaN and infinities become ``null``, which the gate
#: rejects: a producer's bad number is a counted reject, never a stored one.
encode_payload: Final = msgspec.json.Encoder().encode
_decode: Final = msgspec.json.Decoder(Record).decode
_envelope: Final = msgspec.json.Decoder(_Envelope).decode
# Paths whose error means "not this schema" rather than "this schema, badly filled in".
_SCHEMA_PATHS: Final = ("at `$.v`", "at `$.type`")


def decode_payload(payload: bytes) -> Record:
    """Parse and check one payload; raises :class:`SchemaError`."""
    try:
        return _decode(payload)
    except msgspec.ValidationError as exc:
        message = str(exc)
        reason = "schema" if message.endswith(_SCHEMA_PATHS) else "malformed"
        try:
            envelope = _envelope(payload)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            raise SchemaError(reason, message) from None
        raise SchemaError(reason, message, envelope.producer, envelope.seq) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise SchemaError("malformed", f"payload is not JSON: {exc}") from None


def validate(record: object) -> Record:
    """The typed record a JSON-like object would decode to, else :class:`SchemaError`."""
    try:
        payload = encode_payload(record)
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise SchemaError("malformed", f"not encodable as JSON: {exc}") from None
    if len(payload) > MAX_RECORD_BYTES:
        raise SchemaError("malformed", "larger than MAX_RECORD_BYTES")
    return decode_payload(payload)
