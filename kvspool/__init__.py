"""kvspool: the contract between kvwatch's engine hooks and its daemon.

The one package both sides import: the typed records and the gate every record passes
(:mod:`kvspool.records`, :mod:`kvspool.schema`), the catalogue of every detector, kind, reason,
counter and gauge (:mod:`kvspool.catalogue`), the framing, and the torch-free spool writer. It
depends on the standard library and msgspec only, so that neither side pulls in the other's
dependencies: the hooks run inside an engine with torch, the daemon runs without it.
"""

from kvspool.framing import HEADER_BYTES, MAGIC, SEGMENT_SUFFIX, Frame, encode_frame, iter_frames
from kvspool.records import (
    MAX_EVENT_PAGES,
    MAX_EVENT_SOURCES,
    MAX_RECORD_BYTES,
    SCHEMA_VERSION,
    Counters,
    Event,
    Gauges,
    Hello,
    NextSegment,
    Record,
    Source,
)
from kvspool.schema import SchemaError, decode_payload, encode_payload, validate
from kvspool.segments import SpoolContents, read_segment, read_spool
from kvspool.writer import DEFAULT_SPOOL_DIR, SpoolWriter

__all__ = [
    "DEFAULT_SPOOL_DIR",
    "HEADER_BYTES",
    "MAGIC",
    "MAX_EVENT_PAGES",
    "MAX_EVENT_SOURCES",
    "MAX_RECORD_BYTES",
    "SCHEMA_VERSION",
    "SEGMENT_SUFFIX",
    "Counters",
    "Event",
    "Frame",
    "Gauges",
    "Hello",
    "NextSegment",
    "Record",
    "SchemaError",
    "Source",
    "SpoolContents",
    "SpoolWriter",
    "decode_payload",
    "encode_frame",
    "encode_payload",
    "iter_frames",
    "read_segment",
    "read_spool",
    "validate",
]
