"""The six failures found by feeding kvwatch hostile spools, each as a test.

Each of these failed on 92c2721 (the commit before kvspool's typed records): a record that
passed the gate but broke the journal stalled every producer; a counter of 10**400 or NaN, or a
timestamp in the year 33658, broke /metrics, the status page or ``kvwatch incidents`` for good;
resync lost an intact frame; and four smaller ones (a double-counted oversize frame, an abandoned
``*.kvs.new``, a quarantine on another filesystem, label slots held by junk until restart).
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from pathlib import Path

import pytest

from kvspool import MAGIC, encode_payload, read_segment
from kvwatch.ingest.spool.reader import SpoolReader
from kvwatch.store.journal import Journal
from kvwatch.store.state import MAX_MODELS, State
from tests.kvwatch.spoolgen import Producer, seqs
from tests.kvwatch.views import render_all, sample


def raw_frame(payload: bytes) -> bytes:
    return struct.pack("<4sII", MAGIC, len(payload), zlib.crc32(payload)) + payload


def event_json(p: Producer, request_id: str = "r", **override: object) -> bytes:
    record = p.record(
        "event",
        {
            "detector": "canary",
            "kind": "unwritten_page",
            "mode": "log",
            "action": "logged",
            "request_id": request_id,
            "pages": [1],
            "pages_total": 1,
        },
    )
    record.update(override)
    return encode_payload(record)


def poison(p: Producer, which: str) -> bytes:
    """Payloads that passed validate() on 92c2721 and then failed when stored or rendered."""
    if which == "surrogate_escape":
        return event_json(p, "REQ").replace(b'"REQ"', b'"\\ud800"')
    if which == "surrogate_raw":
        return event_json(p, "REQ").replace(b'"REQ"', b'"\xed\xa0\x80"')
    if which == "ts_2_63":
        return event_json(p, ts=1 << 63)
    gauges = encode_payload(p.record("gauges", {"gauges": [["kv_pool_tokens", {}, 7]]}))
    return gauges.replace(b"7]]", b"1" + b"0" * 400 + b"]]")


def reader_for(spool: Path, journal: Journal, state: State, **kwargs: object) -> SpoolReader:
    options: dict[str, object] = {"idle_grace": 3600.0} | kwargs
    return SpoolReader(spool, journal, state, **options)  # type: ignore[arg-type]


# -- 1. one record stalls every producer ---------------------------------------------------------


@pytest.mark.parametrize("which", ["surrogate_escape", "surrogate_raw", "ts_2_63", "gauge_1e400"])
def test_1_a_poison_record_stalls_no_one(spool: Path, journal: Journal, which: str) -> None:
    state = journal.load()
    reader = reader_for(spool, journal, state)
    bad = Producer(spool, "sglang-decode-r0-100-bad00001")
    good = Producer(spool, "sglang-decode-r1-101-good0001", rank=1)
    bad.append(bad.hello())
    bad.append(raw_frame(poison(bad, which)), bad.event("after-poison"))
    good.append(good.hello(), good.event("g1"), good.event("g2"))
    result = reader.poll()  # on 92c2721: raised, and every later poll raised again
    assert result.rejected == 1
    assert seqs(journal, good.name) == [1, 2, 3]
    assert seqs(journal, bad.name) == [1, 3]  # the poison's seq 2 is rejected, not lost
    assert sorted(i.request_id for i in journal.incidents()) == ["after-poison", "g1", "g2"]
    assert state.daemon[("spool_rejected", ("malformed",))] == 1
    render_all(state, journal)


# -- 2 and 3. counters that cannot be summed or alerted on ---------------------------------------


@pytest.mark.parametrize("value", [b"1" + b"0" * 400, b"NaN", b"Infinity", b"-Infinity"])
def test_2_3_counters_of_1e400_nan_or_infinity_are_rejected(
    spool: Path, journal: Journal, value: bytes
) -> None:
    state = journal.load()
    reader = reader_for(spool, journal, state)
    p = Producer(spool)
    series = b'[["mismatches",{"detector":"canary","kind":"digest"},' + value + b"]]"
    payload = encode_payload(p.record("counters", {"counters": []})).replace(b"[]", series)
    p.append(p.hello(), raw_frame(payload), p.counters(5, mismatches=1))
    reader.poll()
    assert state.daemon[("spool_rejected", ("malformed",))] == 1
    text = render_all(state, journal)  # on 92c2721: 1e400 made every scrape fail
    labels = '{detector="canary",kind="unwritten_page",role="decode"}'
    assert sample(text, "kvwatch_mismatches_total", labels) == 1.0  # not NaN: it can page


# -- 4. timestamps far from the daemon's clock ---------------------------------------------------


def test_4_far_timestamps_are_clamped_or_rejected_and_every_view_renders(
    spool: Path, journal: Journal
) -> None:
    state = journal.load()
    reader = reader_for(spool, journal, state)
    p = Producer(spool)
    now = time.time()
    p.append(
        p.hello(),
        raw_frame(event_json(p, "future", ts=now + 10 * 86400)),  # clamped to the daemon's time
        raw_frame(event_json(p, "past", ts=1.0)),  # clamped as well
        raw_frame(event_json(p, "year-33658", ts=1e12)),  # no datetime can show it: rejected
        raw_frame(event_json(p, "negative", ts=-1e12)),
        p.event("normal"),
    )
    reader.poll()
    after = time.time()
    render_all(state, journal)  # on 92c2721: "year 33658 is out of range"
    assert state.daemon[("spool_clamped_records", ())] == 2
    assert state.daemon[("spool_rejected", ("malformed",))] == 2
    times = {i.request_id: i.ts for i in journal.incidents()}
    assert set(times) == {"future", "past", "normal"}
    assert now <= times["future"] <= after and now <= times["past"] <= after
    assert state.last_record_ts <= after  # the "hooks silent" alert still sees silence
    # The prune is not stopped by a future row (on 92c2721 it stopped at the first one).
    deleted = journal.prune(state, now=after + 10, retention=1e9, records_retention=1.0)
    assert deleted == 4  # hello, future, past, normal
    assert journal.scalar("SELECT count(*) FROM records") == 0


# -- 5. resync never skips an intact frame -------------------------------------------------------


@pytest.mark.parametrize("into", [1, 2, 3])
def test_5_resync_keeps_the_frame_a_damaged_length_points_into(
    spool: Path, journal: Journal, into: int
) -> None:
    p = Producer(spool)
    hello, a, b, c = p.hello(), p.event("a"), p.event("b"), p.event("c")
    damaged = bytearray(a)
    length = struct.unpack_from("<I", damaged, 4)[0]
    struct.pack_into("<I", damaged, 4, length + into)  # a short write's claimed end, into b
    p.append(hello + bytes(damaged) + b + c)
    contents = read_segment(p.path)
    assert [r["request_id"] for r in contents.events()] == ["b", "c"]  # on 92c2721: b was lost
    state = journal.load()
    reader = reader_for(spool, journal, state, idle_grace=0.0)
    reader.poll()
    assert sorted(i.request_id for i in journal.incidents()) == ["b", "c"]
    assert state.daemon.get(("spool_lost_records", ()), 0) == 1  # a, and only a


# -- 6. the smaller ones -------------------------------------------------------------------------


def test_6a_an_oversize_frame_across_the_read_boundary_is_counted_once(
    spool: Path, journal: Journal
) -> None:
    state = journal.load()
    reader = reader_for(spool, journal, state, chunk_bytes=256 << 10)
    p = Producer(spool)
    frames = [p.hello()]
    while sum(map(len, frames)) < (256 << 10) - 1000:
        frames.append(p.event(f"before-{len(frames)}"))
    oversize = struct.pack("<4sII", MAGIC, 200_000, 0) + b"x" * 200_000
    p.seq += 1  # the oversize frame's record
    p.append(*frames, oversize, p.event("after"))
    reader.poll()
    assert state.daemon[("spool_rejected", ("oversize",))] == 1
    assert state.daemon.get(("spool_rejected", ("framing",)), 0) == 0  # 92c2721 counted both
    assert journal.incidents()[-1].request_id == "after"


def test_6b_an_abandoned_private_segment_is_removed(spool: Path, journal: Journal) -> None:
    state = journal.load()
    reader = reader_for(spool, journal, state, idle_grace=0.0)
    leftover = spool / ".sglang-decode-r0-100-aaaa0001.000000.kvs.new"
    leftover.write_bytes(b"")  # a producer killed between open() and rename()
    old = time.time() - 60
    os.utime(leftover, (old, old))
    reader.poll()
    assert not leftover.exists()  # on 92c2721 nothing removed it, ever


def test_6c_quarantine_on_another_filesystem(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    spool = Path(os.environ.get("KVWATCH_TEST_SHM", str(shm))) / f"kvwatch-q-{os.getpid()}"
    spool.mkdir()
    try:
        quarantine = tmp_path / "quarantine"
        quarantine.mkdir()
        # Without two filesystems the test would prove nothing: fail loudly, never skip.
        assert os.stat(spool).st_dev != os.stat(quarantine).st_dev, "need two filesystems"
        journal = Journal(tmp_path / "journal.db")
        state = journal.load()
        reader = SpoolReader(spool, journal, state, idle_grace=0.0, quarantine_dir=quarantine)
        p = Producer(spool)
        p.append(p.hello(), b"garbage", p.seal())
        reader.poll()  # on 92c2721: EXDEV, and the segment stayed in the spool for good
        assert not list(spool.glob("*.kvs"))
        assert [q.name for q in quarantine.iterdir()] == [p.path.name]
        journal.close()
    finally:
        for path in spool.iterdir():
            path.unlink()
        spool.rmdir()


def test_6d_junk_label_values_free_their_slots_when_their_producer_goes(
    spool: Path, journal: Journal
) -> None:
    state = journal.load()
    reader = reader_for(spool, journal, state, idle_grace=0.0)
    reader.idle_grace = 3600.0
    for i in range(MAX_MODELS + 4):
        junk = Producer(spool, f"junk-decode-r0-{i}-{i:08x}", model=f"junk-{i}")
        junk.append(junk.hello(), junk.gauges(100, 200))
    reader.poll()
    text = render_all(state, journal)  # the junk takes every slot while it is there
    assert 'model="other"' in text
    reader.idle_grace = 0.0
    reader.poll()  # the junk producers are gone (idle, unlocked: finished and removed)
    assert all(p.retired for p in state.producers.values())
    reader.idle_grace = 3600.0  # the real one stays live
    real = Producer(spool, "sglang-decode-r0-200-real0001", model="glm-5.3")
    real.append(real.hello(), real.gauges(1000, 2000))
    reader.poll()
    text = render_all(state, journal)
    labels = '{engine="sglang",model="glm-5.3",rank="0",role="decode",source="hooks"}'
    assert sample(text, "kvwatch_kv_pool_tokens", labels) == 1000.0  # on 92c2721: "other"


# -- a bug in the daemon's own code costs one record ---------------------------------------------


def test_a_daemon_bug_costs_one_record_dead_lettered(
    spool: Path, journal: Journal, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = journal.load()
    reader = reader_for(spool, journal, state)
    real = SpoolReader._incidents

    def buggy(self: SpoolReader, producer: object) -> None:
        if any(record.request_id == "boom" for record, _ in self._events):
            raise KeyError("a bug")
        real(self, producer)  # type: ignore[arg-type]

    monkeypatch.setattr(SpoolReader, "_incidents", buggy)
    a = Producer(spool, "sglang-decode-r0-100-aaaa0001")
    b = Producer(spool, "sglang-decode-r1-101-bbbb0001", rank=1)
    frames = [a.hello(), a.event("a1"), a.event("boom"), a.event("a3")]
    a.append(*frames)
    b.append(b.hello(), b.event("b1"))
    reader.poll()
    assert sorted(i.request_id for i in journal.incidents()) == ["a1", "a3", "b1"]
    assert seqs(journal, a.name) == [1, 2, 4]
    row = journal.db.execute("SELECT producer, seq, reason, offset FROM rejects").fetchall()
    offset = len(frames[0]) + len(frames[1])  # where "boom" starts
    assert row == [(a.name, 3, "internal", offset)]
    assert state.daemon[("spool_rejected", ("internal",))] == 1
    assert state.daemon.get(("spool_lost_records", ()), 0) == 0
    # Each stored incident counted once (on 072e6c2, a1 twice: once in the failed pass).
    assert state.daemon[("findings", ("canary", "decode", "unwritten_page"))] == 3
    # The next poll goes on as usual; nothing is read twice.
    a.append(a.event("a5"))
    reader.poll()
    assert seqs(journal, a.name) == [1, 2, 4, 5]
    render_all(state, journal)


def test_a_row_sqlite_refuses_inside_a_chunk_costs_only_its_record(
    spool: Path, journal: Journal, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Incident rows go to SQLite 64 to a statement: a row SQLite refuses (here a count past
    int64, as a gate that missed a limit would let through) fails its whole statement and
    transaction, and then, one record per transaction, only itself."""
    state = journal.load()
    reader = reader_for(spool, journal, state)
    real = SpoolReader._incidents

    def bad_row(self: SpoolReader, producer: object) -> None:
        first = len(self._batch.findings)
        real(self, producer)  # type: ignore[arg-type]
        rows = self._batch.findings
        for i in range(first, len(rows)):
            if rows[i].request_id == "boom":
                rows[i].pages_total = 1 << 70

    monkeypatch.setattr(SpoolReader, "_incidents", bad_row)
    a = Producer(spool, "sglang-decode-r0-100-aaaa0001")
    names = [f"a{i}" for i in range(200)]
    names[100] = "boom"
    a.append(a.hello(), *(a.event(n) for n in names))
    reader.poll()
    assert [i.request_id for i in journal.incidents()] == names[:100] + names[101:]
    assert seqs(journal, a.name) == [1, *range(2, 102), *range(103, 202)]
    row = journal.db.execute("SELECT producer, seq, reason FROM rejects").fetchall()
    assert row == [(a.name, 102, "internal")]
    assert state.daemon[("spool_rejected", ("internal",))] == 1
    render_all(state, journal)


# -- found on the way: a stale size at the idle check --------------------------------------------


def test_a_writer_that_appends_and_closes_during_a_read_loses_nothing(
    spool: Path, journal: Journal, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader stats a live segment, reads it (for seconds, on a loaded machine or a long
    backlog), and only then finds the producer's lock free: the producer has meanwhile appended
    its last records and closed. On 92c2721 the segment was finished at the size of the first
    stat, and every record written since was lost (tests/reliability/test_cardinality.py saw
    2,404 of 121,009 lost under load)."""
    import fcntl

    from kvwatch.ingest.spool import reader as spool_reader

    state = journal.load()
    reader = reader_for(spool, journal, state, idle_grace=1.0)
    p = Producer(spool)
    p.append(p.hello(), p.event("before"))
    old = time.time() - 60  # idle for a minute when the reader first looks
    os.utime(p.path, (old, old))
    real_locked = spool_reader._locked
    calls = 0

    def late_writer(fd: int) -> bool:
        nonlocal calls
        calls += 1
        if calls == 1:  # between the reader's stat and its lock check: write, then exit
            p.append(p.event("after-1"), p.event("after-2"))
        return real_locked(fd)

    writer_fd = os.open(p.path, os.O_RDONLY)
    fcntl.flock(writer_fd, fcntl.LOCK_EX)  # the producer holds its lock while alive...
    os.close(writer_fd)  # ...and it is gone by the time the reader checks
    monkeypatch.setattr(spool_reader, "_locked", late_writer)
    reader.poll()
    reader.poll()
    assert [i.request_id for i in journal.incidents()] == ["before", "after-1", "after-2"]
    assert state.daemon.get(("spool_lost_records", ()), 0) == 0
