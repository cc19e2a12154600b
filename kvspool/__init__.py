"""kvspool: the wire format between kvwatch's engine hooks and its daemon.

The one module both sides import. Pure standard library, so that neither side pulls in the
other's dependencies: the hooks run inside an engine with torch, the daemon runs without it.
"""

from kvspool.framing import HEADER_BYTES, MAGIC, SEGMENT_SUFFIX, Frame, encode_frame, iter_frames
from kvspool.schema import (
    MAX_EVENT_PAGES,
    MAX_RECORD_BYTES,
    SCHEMA_VERSION,
    SchemaError,
    decode_payload,
    encode_payload,
    validate,
)
from kvspool.segments import SpoolContents, read_segment, read_spool

__all__ = [
    "HEADER_BYTES",
    "MAGIC",
    "MAX_EVENT_PAGES",
    "MAX_RECORD_BYTES",
    "SCHEMA_VERSION",
    "SEGMENT_SUFFIX",
    "Frame",
    "SchemaError",
    "SpoolContents",
    "decode_payload",
    "encode_frame",
    "encode_payload",
    "iter_frames",
    "read_segment",
    "read_spool",
    "validate",
]
