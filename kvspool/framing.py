"""Framing of spool records in a segment file.

A segment is a sequence of frames: ``MAGIC | length (u32 LE) | crc32(payload) (u32 LE) | payload``.
A producer writes one frame per ``write()`` on an ``O_APPEND`` descriptor, so a reader sees whole
frames except for the last one of a producer killed mid-write (a torn tail). After a damaged frame
the reader resynchronises on the next ``MAGIC`` whose CRC checks out.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from kvspool.schema import MAX_RECORD_BYTES

MAGIC: Final = b"KVWR"
HEADER: Final = struct.Struct("<4sII")
HEADER_BYTES: Final = HEADER.size
SEGMENT_SUFFIX: Final = ".kvs"


def encode_frame(payload: bytes) -> bytes:
    return HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame found in a buffer: ``payload`` when intact, else ``error`` names why not."""

    offset: int
    end: int
    payload: bytes | None = None
    error: str | None = None  # "crc", "oversize", "framing"


def iter_frames(buf: bytes, offset: int = 0) -> Iterator[Frame]:
    """Yield the frames of ``buf`` from ``offset``.

    Stops before an incomplete frame at the end (the caller decides whether that is a torn tail or
    a frame still being written): the last yielded ``end`` is where to resume.
    """
    view = memoryview(buf)
    size = len(buf)
    pos = offset
    while pos + HEADER_BYTES <= size:
        magic, length, crc = HEADER.unpack_from(view, pos)
        if magic != MAGIC or length > MAX_RECORD_BYTES:
            found = buf.find(MAGIC, pos + 1)
            nxt = None if found < 0 else found
            if nxt is None:
                # Keep the last few bytes: they may be the start of a magic still being written.
                keep = max(pos + 1, size - HEADER_BYTES + 1)
                yield Frame(pos, keep, error="oversize" if magic == MAGIC else "framing")
                return
            yield Frame(pos, nxt, error="oversize" if magic == MAGIC else "framing")
            pos = nxt
            continue
        end = pos + HEADER_BYTES + length
        if end > size:
            return
        payload = bytes(view[pos + HEADER_BYTES : end])
        if zlib.crc32(payload) != crc:
            found = -1
            if end < size and not buf.startswith(MAGIC, end):
                # The damage may be in the length itself: rather than jump over frames that may
                # be intact, resynchronise on the next magic after this header.
                found = buf.find(MAGIC, pos + 1, end)
            nxt = end if found < 0 else found
            yield Frame(pos, nxt, error="crc")
            pos = nxt
            continue
        yield Frame(pos, end, payload=payload)
        pos = end
