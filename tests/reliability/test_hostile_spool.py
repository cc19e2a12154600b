"""The real daemon process on a hostile spool, beside a good producer.

A hostile producer keeps appending every kind of poison record to its live (locked) segment,
and the spool holds FIFOs, directories, zero-length files, symbolic links, badly named files and
abandoned private files. A good producer (the real SpoolWriter) writes events one at a time:
each must be committed to the journal within two poll intervals of its write, and the daemon's
spool collector must stay successful throughout.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import struct
import threading
import time
import zlib
from pathlib import Path

from kvspool import MAGIC, SpoolWriter, encode_frame, encode_payload
from tests.kvwatch.spoolgen import Producer
from tests.reliability.fuzz_junk import add_junk
from tests.reliability.tools import DaemonProcess, event_fields, metric

POLL_INTERVAL = 0.5
EVENTS = 20


def raw(payload: bytes) -> bytes:
    return struct.pack("<4sII", MAGIC, len(payload), zlib.crc32(payload)) + payload


def poison_frames(p: Producer) -> list[bytes]:
    """One of each: what passed the gate on 92c2721 and then broke the daemon, and damage."""
    event = encode_payload(p.record("event", event_fields(0)))
    gauges = encode_payload(p.record("gauges", {"gauges": [["kv_pool_tokens", {}, 7]]}))
    counters = encode_payload(
        p.record("counters", {"counters": [["verifications", {"detector": "canary"}, 7]]})
    )
    now = time.time()
    out = [
        b"\x00garbage\x00",  # framing (it follows an intact frame)
        raw(event.replace(b'"req-0"', b'"\\ud800"')),
        raw(event.replace(b'"req-0"', b'"\xed\xa0\x80"')),
        raw(encode_payload(p.record("event", event_fields(1)) | {"ts": 1 << 63})),
        raw(encode_payload(p.record("event", event_fields(2)) | {"ts": 1e12})),
        raw(encode_payload(p.record("event", event_fields(3)) | {"ts": now + 10 * 86400})),
        raw(gauges.replace(b"7]]", b"1" + b"0" * 400 + b"]]")),
        raw(counters.replace(b"7]]", b"1" + b"0" * 400 + b"]]")),
        raw(counters.replace(b"7]]", b"NaN]]")),
        raw(counters.replace(b"7]]", b"Infinity]]")),
        struct.pack("<4sII", MAGIC, 1 << 20, 0) + b"x" * 100,  # oversize
        encode_frame(b'{"v":1}')[:-1] + b"!",  # CRC
    ]
    return out


def hostile_writer(spool: Path, stop: threading.Event) -> None:
    """A producer that holds its segment's lock and writes poison until stopped."""
    p = Producer(spool, "evil-decode-r0-666-deadbeef")
    fd = os.open(p.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, p.hello())
        while not stop.is_set():
            for frame in poison_frames(p):
                os.write(fd, frame)
            os.write(fd, p.event("evil-but-valid"))
            stop.wait(0.02)
    finally:
        os.close(fd)


def committed(journal: Path, request_id: str) -> bool:
    db = sqlite3.connect(f"file:{journal}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT 1 FROM incidents WHERE request_id = ?", (request_id,))
        return row.fetchone() is not None
    except sqlite3.OperationalError:  # no table yet
        return False
    finally:
        db.close()


def test_a_hostile_spool_delays_a_good_producer_by_at_most_two_poll_intervals(
    tmp_path: Path,
) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    add_junk(spool, ["fifo", "dir", "empty", "badname", "symlink", "private"])
    daemon = DaemonProcess(
        tmp_path, "--no-nvml", "--poll-interval", f"{POLL_INTERVAL}s", "--idle-grace", "0.5s"
    )
    stop = threading.Event()
    hostile = threading.Thread(target=hostile_writer, args=(spool, stop), daemon=True)
    latencies: list[float] = []
    try:
        daemon.wait_started()
        hostile.start()
        time.sleep(3 * POLL_INTERVAL)  # the daemon has met every kind of poison by now
        writer = SpoolWriter(spool, engine="sglang", role="decode", model="m")
        for i in range(EVENTS):
            fields = event_fields(i) | {"request_id": f"good-{i}"}
            assert writer.write("event", fields)
            written = time.monotonic()
            while not committed(daemon.journal, f"good-{i}"):
                assert time.monotonic() - written < 30, daemon.output()[-2000:]
                time.sleep(0.01)
            latencies.append(time.monotonic() - written)
            time.sleep(0.05 * (i % 7))  # land at different points of the poll cycle
        text = daemon.scrape()
        writer.close()
    finally:
        stop.set()
        hostile.join(5)
        daemon.kill9()
    print(f"latencies: max {max(latencies):.3f} s, poll interval {POLL_INTERVAL} s")
    assert metric(text, "kvwatch_collector_success", collector="spool") == 1.0
    for reason in ("malformed", "oversize", "crc", "framing", "not_regular", "name"):
        assert (metric(text, "kvwatch_spool_rejected_total", reason=reason) or 0) > 0, reason
    assert (metric(text, "kvwatch_spool_clamped_records_total") or 0) > 0
    assert max(latencies) <= 2 * POLL_INTERVAL, latencies
