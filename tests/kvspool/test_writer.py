"""The spool writer: records round-trip; damage is detected; a full or broken spool never raises."""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from pathlib import Path

import pytest

import kvspool
from kvspool import SpoolWriter, heartbeat, read_segment, read_spool, schema
from tests.reliability.tools import event_fields as event


def writer(directory: Path, **kwargs: int) -> SpoolWriter:
    return SpoolWriter(directory, engine="minipd", role="decode", model="m", **kwargs)


def test_records_round_trip(tmp_path: Path) -> None:
    w = writer(tmp_path)
    for i in range(100):
        assert w.write(schema.EVENT, event(i))
    w.write(schema.COUNTERS, {"counters": [["verifications", {"detector": "canary"}, 5]]})
    w.close()
    contents = read_spool(tmp_path)
    assert not contents.errors
    assert contents.records[0]["type"] == "hello"
    assert contents.records[0]["role"] == "decode"
    assert [r["seq"] for r in contents.records] == list(range(1, 103))
    assert {r["producer"] for r in contents.records} == {w.producer}
    assert [e["request_id"] for e in contents.events()] == [f"req-{i}" for i in range(100)]


def test_torn_last_record_is_detected(tmp_path: Path) -> None:
    w = writer(tmp_path)
    for i in range(10):
        w.write(schema.EVENT, event(i))
    w.close()
    path = w.segment_path
    os.truncate(path, path.stat().st_size - 5)
    contents = read_segment(path)
    assert contents.errors == {"torn": 1}
    assert len(contents.events()) == 9


def test_flipped_byte_is_detected_and_the_rest_kept(tmp_path: Path) -> None:
    w = writer(tmp_path)
    for i in range(10):
        w.write(schema.EVENT, event(i))
    w.close()
    data = bytearray(w.segment_path.read_bytes())
    data[len(data) // 2] ^= 0x40
    w.segment_path.write_bytes(bytes(data))
    contents = read_segment(w.segment_path)
    assert sum(contents.errors.values()) == 1
    assert len(contents.records) == 10  # 11 written, 1 damaged


def test_full_spool_never_raises_and_shows_as_a_gap(tmp_path: Path) -> None:
    w = writer(tmp_path, segment_bytes=4096, max_segments=2)
    for i in range(200):
        w.write(schema.EVENT, event(i))
    assert w.dropped["spool_full"] > 0
    seqs = sorted(r["seq"] for r in read_spool(tmp_path).records)
    assert len(seqs) + sum(w.dropped.values()) == w.seq  # every seq is either read or counted
    # Once the daemon removes the committed segments, writing resumes ...
    for path in tmp_path.iterdir():
        path.unlink()
    time.sleep(1.1)
    assert w.write(schema.EVENT, event(999))
    resumed = sorted(r["seq"] for r in read_spool(tmp_path).records)
    # ... and the first record after the loss is ahead of the last one kept: a gap.
    assert resumed[0] > seqs[-1] + 1


def test_removed_directory_never_raises(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    w = writer(spool)
    assert w.write(schema.EVENT, event(1))
    shutil.rmtree(spool)
    (tmp_path / "spool").write_text("not a directory")  # the path is now a file
    time.sleep(1.1)  # the writer checks its segment is still linked once a second
    for i in range(5):
        assert not w.write(schema.EVENT, event(i))
    assert w.dropped["no_spool"] == 5  # never re-created by the writer
    assert (tmp_path / "spool").is_file()
    # The directory comes back: a fresh segment, and the lost records show as a gap.
    (tmp_path / "spool").unlink()
    spool.mkdir()
    time.sleep(1.1)
    assert w.write(schema.EVENT, event(9))
    records = read_spool(spool).records
    assert records[0]["type"] == "hello"
    assert records[-1]["seq"] == w.seq


def test_read_only_directory_never_raises(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        # root ignores directory permissions; a file in the directory's place fails for all.
        spool = tmp_path / "blocked"
        spool.write_text("")
    else:
        spool = tmp_path / "ro"
        spool.mkdir(mode=0o500)
    w = writer(spool)
    assert not w.write(schema.EVENT, event(1))
    assert w.dropped["no_spool" if os.geteuid() == 0 else "write_error"] == 1


def test_oversize_record_is_dropped_and_counted(tmp_path: Path) -> None:
    w = writer(tmp_path)
    huge = event(1) | {"detail": {f"k{i}": "x" * 200 for i in range(400)}}
    assert not w.write(schema.EVENT, huge)
    assert w.dropped["oversize"] == 1
    assert w.write(schema.EVENT, event(2))


def test_live_producer_holds_a_lock_on_its_segment(tmp_path: Path) -> None:
    w = writer(tmp_path)
    w.write(schema.EVENT, event(1))
    fd = os.open(w.segment_path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        w.close()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the producer is gone: the lock is free
    finally:
        os.close(fd)


def test_rotation_seals_a_segment_and_names_the_next(tmp_path: Path) -> None:
    w = writer(tmp_path, segment_bytes=2048)
    for i in range(40):
        w.write(schema.EVENT, event(i))
    w.close()
    segments = sorted(tmp_path.glob("*.kvs"))
    assert len(segments) > 2
    first = read_segment(segments[0]).records
    assert first[0]["type"] == "hello"
    assert first[-1]["type"] == "seal"
    assert first[-1]["next_segment"] == segments[1].name
    assert read_segment(segments[1]).records[0]["type"] == "hello"
    seqs = [r["seq"] for r in read_spool(tmp_path).records]
    assert seqs == list(range(1, len(seqs) + 1))


def test_a_segment_has_its_hello_when_it_gets_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A producer killed between naming a segment and writing its hello left a headless segment
    # that no record could be read from: the hello is written while the name is still private.
    at_rename: list[list[str]] = []
    rename = os.rename

    def watching_rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        at_rename.append([r["type"] for r in read_segment(Path(src)).records])
        rename(src, dst)

    monkeypatch.setattr(os, "rename", watching_rename)
    w = writer(tmp_path, segment_bytes=2048)
    for i in range(40):
        w.write(schema.EVENT, event(i))
    w.close()
    assert len(at_rename) == len(list(tmp_path.glob("*.kvs"))) > 2
    assert at_rename == [["hello"]] * len(at_rename)
    seqs = [r["seq"] for r in read_spool(tmp_path).records]
    assert seqs == list(range(1, len(seqs) + 1))


def test_the_payload_is_the_schemas_json_and_a_non_finite_value_is_rejected(
    tmp_path: Path,
) -> None:
    w = writer(tmp_path)
    w.write(schema.GAUGES, {"gauges": [["kv_pool_tokens", {}, 4096.0]]})
    w.write(schema.GAUGES, {"gauges": [["kv_pool_tokens", {}, float("nan")]]})
    w.write(schema.EVENT, event(1))
    w.close()
    data = w.segment_path.read_bytes()
    frames = [f.payload for f in kvspool.iter_frames(data)]
    assert schema.decode_payload(frames[1] or b"").gauges[0].value == 4096.0
    # NaN cannot be JSON: it would arrive as null, which the daemon's gate refuses, so the
    # writer refuses it first (counted, no sequence number taken: nothing is lost); the
    # records around it are intact and numbered without a gap.
    assert w.dropped["invalid"] == 1
    contents = read_spool(tmp_path)
    assert contents.errors == {}
    assert [r["type"] for r in contents.records] == ["hello", "gauges", "event"]
    assert [r["seq"] for r in contents.records] == [1, 2, 3]


def test_the_writer_refuses_what_the_reader_would_reject(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A hello or seal through write() (only the writer writes those, where they belong) and a
    label the contract does not know: refused, counted ``invalid``, told once in the engine's
    log; they take no number, so the daemon sees no gap and no reject."""
    w = writer(tmp_path)
    w.write(schema.GAUGES, {"gauges": [["kv_pool_tokens", {}, 1.0]]})
    w.write("hello", dict(w.identity))
    w.write("next_segment", {"next_segment": "x.000002.kvs"})
    w.write(schema.GAUGES, {"gauges": [["kv_pool_tokens", {"tier": "hbm"}, 1.0]]})
    w.write(schema.EVENT, event(1))
    w.close()
    assert w.dropped["invalid"] == 3
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and "kvwatch_spool_dropped_records_total" in refused[0].getMessage()
    contents = read_spool(tmp_path)
    assert contents.errors == {}
    assert [(r["type"], r["seq"]) for r in contents.records] == [
        ("hello", 1),
        ("gauges", 2),
        ("event", 3),
    ]


def _unwritable(tmp_path: Path) -> Path:
    # A file where the folder should be: unwritable for every user, root included.
    (tmp_path / "blocked").write_text("")
    return tmp_path / "blocked" / "spool"


def test_an_unwritable_spool_is_one_warning_in_the_engines_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """KVWATCH_SPOOL unwritable: one warning (Python logging) per failure, however many records
    are dropped, and the drop counter counts each; the engine keeps going."""
    spool = _unwritable(tmp_path)
    w = writer(spool)
    with caplog.at_level("WARNING", logger="kvwatch.spool"):
        for i in range(300):
            assert not w.write(schema.EVENT, event(i))
            if i == 150:
                time.sleep(1.1)  # past the retry: the open fails again, still one warning
    warnings = [r for r in caplog.records if r.name == "kvwatch.spool"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert f"cannot write the spool {spool}" in message and "KVWATCH_SPOOL" in message
    assert "does not exist" in message and "never create" in message
    assert "\n" not in message
    assert w.dropped["no_spool"] == 300
    assert not spool.exists()


def test_a_full_spool_is_one_warning_and_recovery_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    heartbeat.beat(tmp_path)  # a daemon reads this spool, more slowly than the engine writes
    w = writer(tmp_path, segment_bytes=4096, max_segments=2)
    with caplog.at_level("WARNING", logger="kvwatch.spool"):
        for i in range(200):
            w.write(schema.EVENT, event(i))
        for path in tmp_path.glob("*.kvs"):
            path.unlink()  # the daemon catches up
        time.sleep(1.1)
        assert w.write(schema.EVENT, event(999))
    messages = [r.getMessage() for r in caplog.records if r.name == "kvwatch.spool"]
    assert len(messages) == 2, messages
    assert "2 segments of this process unread (is the daemon running?)" in messages[0]
    assert "is written again" in messages[1]


def test_an_unwritable_spool_warns_in_an_engine_process_without_logging_setup(
    tmp_path: Path,
) -> None:
    """An engine that configured no logging still shows the warning on stderr, once."""
    import subprocess
    import sys

    spool = _unwritable(tmp_path)
    code = (
        "from kvspool import SpoolWriter, schema\n"
        f"w = SpoolWriter({str(spool)!r}, engine='sglang', role='decode')\n"
        "for i in range(1000):\n"
        "    w.write(schema.EVENT, {'detector': 'canary', 'kind': 'unwritten_page',"
        " 'mode': 'log', 'action': 'logged', 'request_id': str(i), 'pages': [1],"
        " 'pages_total': 1, 'detail': {}})\n"
        "print(sum(w.dropped.values()))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "1000"
    assert result.stderr.count("cannot write the spool") == 1, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_the_writer_never_creates_the_spool_and_says_when_no_daemon_reads_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder the daemon's install did not make is not made (a misspelt KVWATCH_SPOOL would
    else look delivered); a folder with no daemon heartbeat, or a stale one, is one warning,
    and one more when a daemon beats there again."""
    from kvspool import writer as writer_module

    missing = tmp_path / "spoool"
    w = writer(missing)
    assert not w.write(schema.EVENT, event(1))
    assert not missing.exists() and w.dropped["no_spool"] == 1
    monkeypatch.setattr(writer_module, "_DAEMON_CHECK_SECONDS", 0.0)
    spool = tmp_path / "spool"
    spool.mkdir()
    w = writer(spool)
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvwatch.spool"):
        for i in range(3):
            assert w.write(schema.EVENT, event(i))
        heartbeat.beat(spool)
        stale = time.time() - heartbeat.STALE_SECONDS - 5
        time.sleep(1.1)  # the writer looks once a second at most (with its segment check)
        assert w.write(schema.EVENT, event(3))
        os.utime(spool / heartbeat.HEARTBEAT_NAME, (stale, stale))
        time.sleep(1.1)
        assert w.write(schema.EVENT, event(4))
    messages = [r.getMessage() for r in caplog.records if r.name == "kvwatch.spool"]
    assert len(messages) == 3, messages
    assert f"no kvwatch daemon reads the spool {spool}" in messages[0] and "never" in messages[0]
    assert "reads the spool" in messages[1] and "again" in messages[1]
    assert "no kvwatch daemon reads" in messages[2] and "s ago" in messages[2]
    assert w.dropped.total() == 0  # written all the same: a daemon that starts reads them
