"""Fuzz for meaning: hostile mutations of real segments lose no intact record.

The real ``SpoolWriter`` writes each producer's segments (small segments, so that a producer
has several, each starting with its ``hello``); then each producer's frames are mutated: bytes
flipped, frames cut short, lengths changed (often to end 1-3 bytes into the next frame), magics
and CRCs broken, junk inserted, frames replayed, ``hello`` records forged in the middle of a
segment (stealing the next record's sequence number, or far ahead of it, under another
identity, also right after a damaged real ``hello``), and the last frame torn as a ``kill -9``
leaves it; each test draws from one family of these (FAMILIES: one per way evidence was lost,
and all mixed). The real reader ingests the spool into a real SQLite journal, either whole or as
live writers leave it (each producer's segments one after the other, the live one locked, bytes
arriving in pieces cut anywhere and near frame starts between polls, read chunks from 64 bytes
to 256 KiB standing in for the boundaries of 256 KiB reads in 8 MiB segments, daemon restarts).

After each batch, per producer: every intact record is in the journal exactly once, every
intact event is an incident with its producer's own labels (never a forged hello's), rejects
are counted by reason (each forged or replayed ``hello`` a ``hello`` reject, each replay a
``sequence`` reject, each torn tail exactly one ``torn`` reject at its offset), the records
lost are exactly the damaged ones below the last intact one, and the journal, /metrics, the
status page and ``kvwatch incidents`` render. Deterministic (seeded, with the writer's names and
clock fixed); ``KVWATCH_FUZZ_EXAMPLES=N`` runs N batches of 24 producers per family from a
fresh seed, which a failure names (``KVWATCH_FUZZ_SEED`` replays it; docs/reliability.md).
"""

from __future__ import annotations

import fcntl
import itertools
import os
import random
import struct
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import structlog

import kvspool
import kvspool.writer
from kvspool import MAGIC, SpoolWriter, decode_payload, encode_frame, encode_payload, iter_frames
from kvspool.records import TYPE_NAME
from kvwatch.ingest.spool.reader import SpoolReader
from kvwatch.store.journal import Journal
from tests.kvwatch.views import render_all, sample

LONG = int(os.environ.get("KVWATCH_FUZZ_EXAMPLES", "0"))
#: Batches per mutation family (FAMILIES) in the normal suite: 2,160 producers in all.
BATCHES = {"hello": 15, "into_next": 15, "sequence": 20, "torn": 15, "all": 25}
PRODUCERS_PER_BATCH = 24
#: ``KVWATCH_FUZZ_SEED`` replays the seed a failure named.
SEED = int(
    os.environ.get("KVWATCH_FUZZ_SEED")
    or (20261201 if not LONG else random.SystemRandom().randrange(1 << 32))
)

DAMAGE = ("flip", "cut", "length", "into_next", "magic", "crc")


@dataclass
class Piece:
    data: bytearray
    #: The record this piece is, intact (None: junk, a forged or a replayed frame).
    seq: int | None = None
    damage: str | None = None  # how it was damaged (then it is not intact)
    inserted: str | None = None  # "junk", "forged_hello", "replay", "replay_hello"
    torn_tail: bool = False
    #: Its length is to end 1-3 bytes into the next piece.
    into_next: bool = False
    #: Replayed, or the producer's first hello: kept intact.
    protected: bool = False
    offset: int = 0


@dataclass
class Case:
    producer: str
    #: The labels of its hello, as incident rows carry them.
    labels: dict[str, Any]
    segments: dict[str, list[Piece]]
    #: seq -> (record type, request id of an event)
    records: dict[int, tuple[str, str | None]]
    ops: list[str] = field(default_factory=list)

    def intact(self) -> dict[int, tuple[str, str | None]]:
        ok = {
            p.seq
            for pieces in self.segments.values()
            for p in pieces
            if p.seq is not None and p.damage is None and not p.torn_tail
        }
        return {s: self.records[s] for s in ok}

    def inserted(self, kind: str) -> int:
        return sum(p.inserted == kind for ps in self.segments.values() for p in ps)

    def blob(self, name: str) -> bytes:
        out = bytearray()
        for piece in self.segments[name]:
            piece.offset = len(out)
            out += piece.data
        return bytes(out)


def write_producer(spool: Path, rng: random.Random, tag: int) -> Case:
    role = rng.choice(["prefill", "decode"])
    writer = SpoolWriter(
        spool,
        engine="sglang",
        role=role,
        model="glm",
        rank=tag % 8,
        segment_bytes=rng.choice([700, 1500, 4000]),
        max_segments=10_000,
    )
    # Names, identity and clock fixed, so that every frame's size, and so every mutation and
    # segment boundary, is the same on every machine and run.
    writer.producer = f"sglang-{role}-r{tag % 8}-{tag:06d}-{tag:08x}"
    writer.identity.update(pid=100_000 + tag, node=f"node-{tag % 3}")
    records: dict[int, tuple[str, str | None]] = {}
    for i in range(rng.randint(1, 40)):
        if rng.random() < 0.1:
            fields: dict[str, Any] = {"counters": [["verifications", {"detector": "canary"}, i]]}
            kind = "counters"
        else:
            kind = "event"
            fields = {
                "detector": rng.choice(["canary", "checksum"]),
                "kind": "unwritten_page",
                "mode": "log",
                "action": "logged",
                "request_id": f"{tag}-r{i}",
                "pages": [i, 7],
                "pages_total": 2,
                "detail": {"unwritten": 1},
            }
        assert writer.write(kind, fields)
    writer.close()
    segments: dict[str, list[Piece]] = {}
    for path in sorted(spool.glob(f"{writer.producer}.*.kvs")):
        pieces = []
        for frame in iter_frames(path.read_bytes(), final=True):
            assert frame.payload is not None
            record = decode_payload(frame.payload)
            rid = getattr(record, "request_id", None)
            records[record.seq] = (TYPE_NAME[type(record)], rid)
            pieces.append(Piece(bytearray(encode_frame(frame.payload)), seq=record.seq))
        segments[path.name] = pieces
        path.unlink()
    first = segments[min(segments)]
    first[0].protected = True  # its labels are the ones every incident must carry
    labels = {k: writer.identity[k] for k in ("role", "engine", "engine_version", "model", "rank")}
    return Case(writer.producer, labels, segments, records)


def forged_hello(case: Case, seq: int, rng: random.Random) -> bytes:
    record = {
        "v": 1,
        "type": "hello",
        "producer": case.producer,
        "engine": "vllm",
        "engine_version": "6.6.6",
        "role": "decode" if case.labels["role"] == "prefill" else "prefill",
        "model": "forged",
        "rank": 7,
        "pid": 666,
        "node": "forged-node",
        "seq": seq,
        "ts": time.time() - rng.uniform(0, 100),
    }
    return encode_frame(encode_payload(record))


def is_seal(case: Case, piece: Piece) -> bool:
    return piece.seq is not None and case.records[piece.seq][0] == "seal"


@dataclass(frozen=True)
class Family:
    """Which mutations a test draws from."""

    ops: tuple[str, ...]
    damage: tuple[str, ...] = DAMAGE
    torn: float = 0.0  # the chance that the producer was killed mid-write


FAMILIES = {
    # (a) forged and replayed hellos in the middle of segments
    "hello": Family(("forge", "forge", "replay", "junk"), torn=0.1),
    # (b) a damaged length that ends 1-3 bytes into the next frame
    "into_next": Family(("damage", "damage", "junk"), damage=("into_next",)),
    # (c) damage, replays, junk and forged records in sequence: gaps, duplicates, and the good
    # records after them, none of which may lose its number to a record before it
    "sequence": Family(("damage", "damage", "replay", "junk", "forge"), torn=0.2),
    # (d) producers killed mid-write, some with damage before their torn tail
    "torn": Family(("damage", "junk"), torn=1.0),
    "all": Family(("damage", "damage", "junk", "forge", "forge", "replay"), torn=0.3),
}


def mutate(case: Case, rng: random.Random, family: Family) -> None:
    names = sorted(case.segments)
    last_name = names[-1]
    if rng.random() < family.torn and case.segments[last_name]:
        # A kill -9 mid-write: the last frame is a prefix of itself.
        piece = case.segments[last_name][-1]
        piece.torn_tail = True
        del piece.data[rng.randint(1, len(piece.data) - 1) :]
        case.ops.append(f"torn_tail {last_name} seq {piece.seq}")
    for _ in range(rng.choice([0, 1, 1, 2, 3, 5])):
        name = rng.choice(names)
        pieces = case.segments[name]
        originals = [p for p in pieces if p.seq is not None and not p.torn_tail]
        targets = [p for p in originals if not p.protected]
        op = rng.choice(family.ops)
        if op == "damage" and targets:
            piece = rng.choice([p for p in targets if p.damage is None] or targets)
            how = rng.choice(family.damage)
            if how != "into_next":
                piece.damage = piece.damage or how
            data = piece.data
            if how == "flip":
                data[rng.randrange(len(data))] ^= rng.randint(1, 255)
            elif how == "cut":
                del data[rng.randint(1, len(data) - 1) :]
            elif how == "length" and len(data) >= 12:
                length = rng.randrange(0, 2 * len(data))
                if length == len(data) - 12:
                    length += 1
                struct.pack_into("<I", data, 4, length)
            elif how == "into_next":
                piece.into_next = True  # the length is set once offsets are known
            elif how == "magic":
                data[rng.randrange(min(4, len(data)))] ^= rng.randint(1, 255)
            elif len(data) >= 12:
                data[8 + rng.randrange(4)] ^= rng.randint(1, 255)
            case.ops.append(f"{how} {name} seq {piece.seq}")
            continue
        at = rng.randint(1 if pieces else 0, len(pieces))  # never before a segment's hello
        if at == len(pieces) and pieces and (pieces[-1].torn_tail or is_seal(case, pieces[-1])):
            at -= 1  # a torn tail stays the last bytes; a live writer writes nothing after its seal
        if op == "damage":
            continue
        if op == "junk":
            junk = bytearray(rng.randbytes(rng.randint(1, 40)))
            if rng.random() < 0.5:
                cut = rng.randint(1, 4)
                junk[rng.randrange(len(junk)) :] = MAGIC[:cut]
            new = Piece(junk, inserted="junk")
        elif op == "forge":
            after = [p.seq for p in pieces[at:] if p.seq is not None]
            before = [p.seq for p in pieces[:at] if p.seq is not None]
            choice = rng.random()
            if after and choice < 0.5:
                seq = after[0]  # steals the next record's number
            elif choice < 0.8:
                seq = (before[-1] if before else 0) + rng.randint(1, 1000)
            else:
                seq = max(1, (before[-1] if before else 1) - rng.randint(0, 3))
            new = Piece(bytearray(forged_hello(case, seq, rng)), inserted="forged_hello")
        else:
            earlier = [
                p for p in pieces[:at] if p.seq is not None and not (p.damage or p.into_next)
            ]
            if not earlier:
                continue
            source = rng.choice(earlier)
            kind = "replay_hello" if case.records[source.seq][0] == "hello" else "replay"
            new = Piece(bytearray(source.data), inserted=kind)
            source.protected = True
        pieces.insert(at, new)
        case.ops.append(f"{new.inserted} {name} at {at}")
    for name in names:
        pieces = case.segments[name]
        case.blob(name)  # offsets
        for i, piece in enumerate(pieces):
            if piece.into_next and len(piece.data) >= 12 and i + 1 < len(pieces):
                end = pieces[i + 1].offset + rng.randint(1, 3)
                struct.pack_into("<I", piece.data, 4, end - piece.offset - 12)
                piece.damage = piece.damage or "into_next"


def ingest_whole(spool: Path, cases: list[Case], journal_path: Path, rng: random.Random) -> None:
    for case in cases:
        for name in case.segments:
            (spool / name).write_bytes(case.blob(name))
    chunk = rng.choice([300, 1000, 256 << 10])
    journal = Journal(journal_path)
    try:
        reader = SpoolReader(
            spool, journal, journal.load(), idle_grace=0.0, chunk_bytes=chunk,
            quarantine_dir=spool.parent / "quarantine", quarantine_max=10_000,
        )  # fmt: skip
        for _ in range(4):
            reader.poll()
    finally:
        journal.close()


def ingest_live(spool: Path, cases: list[Case], journal_path: Path, rng: random.Random) -> None:
    """As live writers leave it: each producer's segments one after the other, the one being
    written locked, its bytes arriving in pieces cut anywhere (not only between frames), polls
    in between, now and then a daemon restart."""
    chunk = rng.choice([64, 300, 1000, 256 << 10])
    # Per producer, the writes still to come: (segment, bytes), the segment's last one marked.
    todo: list[list[tuple[str, bytes, bool]]] = []
    for case in cases:
        writes = []
        for name in sorted(case.segments):
            blob = case.blob(name)
            # Cuts anywhere, and some within the first bytes of a piece (the head of a magic).
            starts = [p.offset for p in case.segments[name]]
            near = [rng.choice(starts) + rng.randint(0, 4) for _ in range(2)] if starts else []
            anywhere = [rng.randint(0, len(blob)) for _ in range(2)]
            cuts = sorted({0, len(blob), *(c for c in near + anywhere if c <= len(blob))})
            for i, (a, b) in enumerate(itertools.pairwise(cuts)):
                writes.append((name, blob[a:b], i == len(cuts) - 2))
            if len(cuts) == 1:
                writes.append((name, b"", True))
        todo.append(writes)

    def open_reader() -> tuple[Journal, SpoolReader]:
        journal = Journal(journal_path)
        return journal, SpoolReader(
            spool, journal, journal.load(), idle_grace=0.0, chunk_bytes=chunk,
            quarantine_dir=spool.parent / "quarantine", quarantine_max=10_000,
        )  # fmt: skip

    fds: dict[str, int] = {}
    journal, reader = open_reader()
    try:
        while any(todo):
            for writes in todo:
                for _ in range(rng.randint(0, 3)):
                    if not writes:
                        break
                    name, data, last = writes.pop(0)
                    if name not in fds:
                        fd = os.open(spool / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
                        fcntl.flock(fd, fcntl.LOCK_EX)
                        fds[name] = fd
                    os.write(fds[name], data)
                    if last and writes:  # the writer moves on to its next segment
                        os.close(fds.pop(name))
            reader.poll()
            if rng.random() < 0.2:
                journal.close()
                journal, reader = open_reader()
        for fd in fds.values():
            os.close(fd)  # the producers exit: their last segments are finished now
        for _ in range(3):
            reader.poll()
    finally:
        journal.close()


def check(case: Case, journal: Journal, rejects: list[tuple[str, int, int, str]]) -> None:
    """Every intact record of ``case`` landed once, with its producer's labels."""
    mine = [r for r in rejects if r[0].startswith(case.producer + ".")]
    hurt = {
        n: [(p.offset, len(p.data), p.seq, p.damage, p.inserted, p.torn_tail) for p in ps]
        for n, ps in case.segments.items()
        if any(p.damage or p.inserted or p.torn_tail for p in ps)
    }
    why = f"producer {case.producer}: {case.ops} rejects {sorted(mine)} pieces {hurt}"
    seqs = [
        row[0]
        for row in journal.db.execute(
            "SELECT r.seq FROM records r JOIN producers p ON p.id = r.producer WHERE p.name = ?",
            (case.producer,),
        )
    ]
    intact = case.intact()
    assert len(seqs) == len(set(seqs)), ("a record stored twice", why)
    missing, extra = sorted(set(intact) - set(seqs)), sorted(set(seqs) - set(intact))
    assert not missing and not extra, ("missing", missing, "extra", extra, why)
    events = {rid: seq for seq, (kind, rid) in intact.items() if kind == "event"}
    rows = [i for i in journal.incidents() if i.producer == case.producer]
    assert sorted(i.request_id for i in rows) == sorted(events), why
    # The labels its hello gave (not the node: an incident names the daemon's node).
    for row in rows:
        labels = {k: getattr(row, k) for k in ("role", "engine", "engine_version", "model", "rank")}
        assert labels == case.labels, (row, why)
    reasons = Counter(r[3] for r in mine)
    assert reasons["hello"] == case.inserted("forged_hello") + case.inserted("replay_hello"), (
        reasons,
        why,
    )
    assert reasons["sequence"] == case.inserted("replay"), (reasons, why)
    for name, pieces in case.segments.items():
        if pieces and pieces[-1].torn_tail:
            # Exactly one reject holds the torn tail's first byte, and it says torn.
            at = pieces[-1].offset
            holding = [r for r in mine if r[0] == name and r[1] <= at < r[1] + max(1, r[2])]
            assert [r[3] for r in holding] == ["torn"], (holding, name, at, why)
        elif any(p.damage or p.inserted == "junk" for p in pieces):
            assert any(r[0] == name for r in mine), ("damage not counted", name, why)
    top = max(intact, default=0)
    lost = {
        p.seq
        for ps in case.segments.values()
        for p in ps
        if p.seq is not None and (p.damage or p.torn_tail) and p.seq < top
    } - set(intact)
    gaps = journal.db.execute(
        "SELECT first_seq, last_seq FROM gaps WHERE producer = ?", (case.producer,)
    ).fetchall()
    counted = [s for first, last in gaps for s in range(first, last + 1)]
    assert sorted(counted) == sorted(lost), (gaps, sorted(lost), why)


class _Clock:
    """The writer's clock: one record every 10 ms from a recent round second."""

    def __init__(self) -> None:
        self.now = float(int(time.time()) - 600)

    monotonic = staticmethod(time.monotonic)

    def time(self) -> float:
        self.now += 0.01
        return round(self.now, 2)


def run_batch(family: str, batch: int) -> int:
    rng = random.Random(f"{SEED} {family} {batch}")
    with (
        tempfile.TemporaryDirectory() as tmp,
        structlog.testing.capture_logs() as logs,
        mock.patch.object(kvspool.writer, "time", _Clock()),
    ):
        spool = Path(tmp) / "spool"
        spool.mkdir()
        cases = [write_producer(spool, rng, batch * 100 + i) for i in range(PRODUCERS_PER_BATCH)]
        for case in cases:
            mutate(case, rng, FAMILIES[family])
        journal_path = Path(tmp) / "journal.db"
        live = rng.random() < 0.5
        (ingest_live if live else ingest_whole)(spool, cases, journal_path, rng)
        assert not list(spool.glob("*.kvs")), f"seed {SEED} batch {batch}: segments left"
        journal = Journal(journal_path)
        try:
            rejects = list(
                journal.db.execute("SELECT segment, offset, length, reason FROM rejects")
            )
            for case in cases:
                check(case, journal, rejects)
            state = journal.load()
            text = render_all(state, journal)
            total = len(rejects)
            counted = sum(
                sample(text, "kvwatch_spool_rejected_total", f'{{reason="{reason}"}}')
                for reason in {r[3] for r in rejects}
            )
            assert counted == total, (counted, total)
            errors = [e for e in logs if e["log_level"] in {"error", "critical"}]
            assert not errors, errors[:3]
        finally:
            journal.close()
    return len(cases)


@pytest.mark.parametrize("family", sorted(BATCHES))
def test_hostile_mutations_lose_no_intact_record(family: str) -> None:
    started = time.monotonic()
    cases = 0
    for batch in range(LONG or BATCHES[family]):
        try:
            cases += run_batch(family, batch)
        except AssertionError as exc:
            raise AssertionError(f"seed {SEED} {family} batch {batch}: {exc}") from exc
    print(f"seed {SEED} {family}: {cases} producers in {time.monotonic() - started:.1f} s")
