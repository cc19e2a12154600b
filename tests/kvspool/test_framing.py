"""Frames: intact ones decode, damaged ones are named and skipped, the reader resynchronises."""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from kvspool import MAGIC, encode_frame, iter_frames
from kvspool.schema import MAX_RECORD_BYTES


def frames(n: int) -> list[bytes]:
    return [encode_frame(f'{{"i":{i}}}'.encode()) for i in range(n)]


def test_intact_frames_decode() -> None:
    data = b"".join(frames(5))
    found = list(iter_frames(data))
    assert [f.payload for f in found] == [f'{{"i":{i}}}'.encode() for i in range(5)]
    assert found[-1].end == len(data)


def test_incomplete_tail_is_left_for_later() -> None:
    data = b"".join(frames(3))
    found = list(iter_frames(data[:-2]))
    assert len(found) == 2
    assert found[-1].end < len(data) - 2


def test_bad_crc_is_skipped() -> None:
    parts = frames(3)
    damaged = bytearray(parts[1])
    damaged[-1] ^= 1
    found = list(iter_frames(parts[0] + bytes(damaged) + parts[2]))
    assert [f.error for f in found] == [None, "crc", None]


def test_corrupt_length_resyncs_on_next_magic() -> None:
    parts = frames(3)
    bad = bytearray(parts[1])
    struct.pack_into("<I", bad, 4, MAX_RECORD_BYTES + 1)
    found = list(iter_frames(parts[0] + bytes(bad) + parts[2]))
    assert [f.error for f in found] == [None, "oversize", None]
    assert found[2].payload == b'{"i":2}'


def test_garbage_between_frames_resyncs() -> None:
    parts = frames(2)
    found = list(iter_frames(parts[0] + b"garbage!" * 3 + parts[1]))
    assert [f.error for f in found] == [None, "framing", None]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=4096), st.integers(0, 4096))
def test_any_bytes_never_raise_and_progress(noise: bytes, cut: int) -> None:
    data = b"".join(frames(3))
    data = data[: cut % (len(data) + 1)] + noise + MAGIC + data[cut % (len(data) + 1) :]
    last = 0
    for frame in iter_frames(data):
        assert frame.end > frame.offset >= last
        last = frame.end
