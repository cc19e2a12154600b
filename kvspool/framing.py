"""Framing of spool records in a segment file.

A segment is a sequence of frames: ``MAGIC | length (u32 LE) | crc32(payload) (u32 LE) | payload``.
A producer writes one frame per ``write()`` on an ``O_APPEND`` descriptor, so a reader sees whole
frames except for the last one of a producer killed mid-write (a torn tail). After a damaged frame
the reader resynchronises on the next ``MAGIC`` after the damaged frame's start, never on the end
its (possibly damaged) length claims: every intact frame after damage is read.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from typing import Final, NamedTuple

from kvspool.records import MAX_RECORD_BYTES

MAGIC: Final = b"KVWR"
HEADER: Final = struct.Struct("<4sII")
HEADER_BYTES: Final = HEADER.size
#: The longest intact frame: a read this long holds any frame whole.
MAX_FRAME_BYTES: Final = HEADER_BYTES + MAX_RECORD_BYTES
SEGMENT_SUFFIX: Final = ".kvs"


def encode_frame(payload: bytes) -> bytes:
    return HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


class Frame(NamedTuple):
    """One frame found in a buffer: ``payload`` when intact, else ``error`` names why not.
    (A named tuple: one is made per record, and a tuple is the cheapest to make.)"""

    offset: int
    end: int
    payload: bytes | None = None
    error: str | None = None  # "crc", "oversize", "framing", "torn"
    #: Damage that runs on past the end of the buffer (no magic after it yet): the caller
    #: counts the damage once, not again when it reads on from ``end``.
    open: bool = False


_new_tuple: Final = tuple.__new__


def _magic_head(buf: bytes, start: int) -> int:
    """Where, from ``start``, the end of ``buf`` may begin a magic (``len(buf)`` if nowhere)."""
    size = len(buf)
    for at in range(start, size):
        if MAGIC.startswith(buf[at:]):
            return at
    return size


def iter_frames(buf: bytes, offset: int = 0, *, final: bool = False) -> Iterator[Frame]:
    """Yield the frames of ``buf`` from ``offset``.

    Not ``final`` (the segment may still grow): stops before an incomplete frame at the end (a
    frame still being written), and the last yielded ``end`` is where to resume. ``final`` (no
    more bytes will come): an incomplete frame is damage (``torn``) and reading resumes at the
    next magic after it, so a damaged length pointing past the end loses no frame behind it.
    """
    size = len(buf)
    pos = offset
    find = buf.find
    unpack = HEADER.unpack_from
    crc32 = zlib.crc32
    while pos + HEADER_BYTES <= size:
        magic, length, crc = unpack(buf, pos)
        if magic != MAGIC or length > MAX_RECORD_BYTES:
            error = "oversize" if magic == MAGIC else "framing"
        else:
            end = pos + HEADER_BYTES + length
            if end > size:
                if not final:
                    return
                error = "torn"
            else:
                payload = buf[pos + HEADER_BYTES : end]
                if crc32(payload) == crc:
                    # An intact frame, one per record: built without the named tuple's
                    # Python-level constructor (a third of this loop's time).
                    yield _new_tuple(Frame, (pos, end, payload, None, False))
                    pos = end
                    continue
                error = "crc"
        nxt = find(MAGIC, pos + 1)
        if nxt < 0 and error == "crc":
            # No frame can start in the rest of the buffer: resume where this one claims to end
            # (what follows may be the start of a frame still being written), unless the last
            # bytes before that end may be the head of the next frame's magic.
            head = size if final else _magic_head(buf, max(pos + 1, size - len(MAGIC) + 1))
            if end > head:
                yield Frame(pos, head, error=error, open=True)
                return
            yield Frame(pos, end, error=error)
            pos = end
            continue
        if nxt < 0:
            if final:
                yield Frame(pos, size, error=error)
                return
            # Keep the last bytes: they may be the start of a magic still being written.
            keep = max(pos + 1, size - len(MAGIC) + 1)
            yield Frame(pos, keep, error=error, open=True)
            return
        yield Frame(pos, nxt, error=error)
        pos = nxt
    if final and pos < size:
        yield Frame(pos, size, error="torn")
