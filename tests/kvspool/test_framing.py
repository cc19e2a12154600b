"""Frames: intact ones decode, damaged ones are named and skipped, the reader resynchronises."""

from __future__ import annotations

import itertools
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


# -- resync never skips an intact frame ---------------------------------------------------------

PAYLOADS = st.binary(min_size=0, max_size=80) | st.text(max_size=40).map(str.encode)
DAMAGE = st.tuples(
    st.sampled_from(["flip", "cut", "junk", "length", "magic", "crc"]),
    st.integers(0, 10_000),
    st.binary(min_size=1, max_size=24),
)


def damaged_stream(
    payloads: list[bytes], damage: list[tuple[str, int, bytes]]
) -> tuple[bytes, list[bytes]]:
    """The frames of ``payloads`` with ``damage`` applied to some of them; returns the stream
    and the payloads of the frames left intact (bytes unchanged and contiguous), in order."""
    pieces = [bytearray(encode_frame(p)) for p in payloads]
    before = [b"" for _ in payloads]  # junk inserted before a frame leaves the frame intact
    hurt = [False] * len(payloads)
    for op, at, junk in damage:
        i = at % len(pieces)
        piece = pieces[i]
        if op == "junk":
            before[i] += junk
            continue
        hurt[i] = True
        if len(piece) < 12:  # already cut inside its header
            continue
        if op == "flip":
            piece[at % len(piece)] ^= junk[0] or 1
        elif op == "cut":  # a short write: the frame's tail never came
            del piece[max(1, len(piece) - 1 - at % len(piece)) :]
        elif op == "length":  # the claimed end lands anywhere, often just inside the next frame
            struct.pack_into("<I", piece, 4, (len(piece) - 12 + at % 40) % (1 << 32))
        elif op == "magic":
            piece[at % 4] ^= junk[0] or 1
        else:
            piece[8] ^= junk[0] or 1
    stream = b"".join(bytes(b) + bytes(p) for b, p in zip(before, pieces, strict=True))
    intact = [p for p, bad in zip(payloads, hurt, strict=True) if not bad]
    return stream, intact


def is_subsequence(needles: list[bytes], haystack: list[bytes]) -> bool:
    it = iter(haystack)
    return all(any(n == h for h in it) for n in needles)


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(st.lists(PAYLOADS, min_size=1, max_size=10), st.lists(DAMAGE, max_size=4))
def test_every_intact_frame_after_damage_is_read(
    payloads: list[bytes], damage: list[tuple[str, int, bytes]]
) -> None:
    stream, intact = damaged_stream(payloads, damage)
    found = list(iter_frames(stream, final=True))
    assert found[0].offset == 0 if found else not stream
    for a, b in itertools.pairwise(found):
        assert a.end == b.offset  # every byte accounted for, once
    if found:
        assert found[-1].end == len(stream)
    read = [f.payload for f in found if f.payload is not None]
    assert is_subsequence(intact, read), (intact, read)


def read_in_pieces(stream: bytes, cuts: list[int]) -> list[bytes]:
    """Read ``stream`` as the daemon tails a growing segment: what has arrived at each cut, from
    the last frame's end, then the rest as final. Returns the intact payloads read."""
    offset, read = 0, []
    for size in [*sorted(cuts), len(stream)]:
        if size <= offset:
            continue
        end = 0
        for frame in iter_frames(stream[offset:size], final=size == len(stream)):
            if frame.payload is not None:
                read.append(frame.payload)
            end = frame.end
        offset += end
    return read


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(st.lists(PAYLOADS, min_size=2, max_size=6), st.integers(0, 5), st.integers(1, 3))
def test_a_damaged_length_into_the_next_frame_skips_nothing_across_reads(
    payloads: list[bytes], which: int, into: int
) -> None:
    """A damaged frame claims to end 1-3 bytes into the next one, and a read ends inside the
    next one's magic: resync still starts after the damaged frame's start."""
    pieces = [bytearray(encode_frame(p)) for p in payloads]
    i = which % (len(pieces) - 1)
    struct.pack_into("<I", pieces[i], 4, len(pieces[i]) - 12 + into)
    stream = b"".join(bytes(p) for p in pieces)
    start_next = sum(len(p) for p in pieces[: i + 1])
    for cut in range(start_next, start_next + 4):
        read = read_in_pieces(stream, [cut])
        assert is_subsequence(payloads[:i] + payloads[i + 1 :], read), (cut, read)
