from __future__ import annotations

import fcntl
import json
import os
import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvspool import MAX_RECORD_BYTES, encode_frame, encode_payload
from kvwatch.ingest.spool.reader import SpoolReader
from kvwatch.store.incidents_log import IncidentsLog
from kvwatch.store.journal import Journal
from kvwatch.store.state import State
from tests.kvwatch.spoolgen import Producer, seqs
from tests.kvwatch.writer import spool_module


def rejected(state: State) -> dict[str, float]:
    return {k[1][0]: v for k, v in state.daemon.items() if k[0] == "spool_rejected" and v}


def test_records_events_and_counters_reach_the_journal(
    spool: Path, reader: SpoolReader, journal: Journal, state: State
) -> None:
    p = Producer(spool)
    p.append(p.hello(), p.gauges(681280, 1048576), p.counters(10), p.event("req-1"))
    result = reader.poll()
    assert (result.records, result.rejected, result.lost, result.more) == (4, 0, 0, False)
    assert seqs(journal, p.name) == [1, 2, 3, 4]
    [incident] = journal.incidents()
    assert incident.request_id == "req-1"
    assert incident.node == "node-a" and incident.role == "decode"
    assert incident.pages == [1, 2, 3, 4, 5, 6, 7]
    producer = state.producers[p.name]
    assert producer.gauges["kv_pool_tokens"] == 681280
    assert state.daemon[("spool_records", ())] == 4
    # Nothing new: a second poll reads nothing and commits nothing twice.
    assert reader.poll().records == 0
    assert seqs(journal, p.name) == [1, 2, 3, 4]


def test_an_incident_takes_the_labels_its_producer_had_when_it_was_read(
    spool: Path, reader: SpoolReader, journal: Journal, state: State
) -> None:
    """Incident rows are built once per read, not per event: the next segment's hello (the
    first one whose frame is intact) read in the same poll must not relabel the events read
    before it, and the incident counter counts each under its own role."""
    p = Producer(spool)
    lost = bytearray(p.hello())
    lost[-2] ^= 0xFF  # a damaged hello: the producer has no labels yet
    p.append(bytes(lost), p.event("before"), p.seal())
    p.index += 1
    p.append(p.hello(), p.event("after"))
    assert reader.poll().records == 4
    rows = [(i.request_id, i.model, i.role, i.rank) for i in journal.incidents()]
    assert rows == [("before", "", "other", 0), ("after", "glm-5.3", "decode", 0)]
    counted = {k[1]: v for k, v in state.daemon.items() if k[0] == "findings"}
    assert counted == {
        ("canary", "other", "unwritten_page"): 1,
        ("canary", "decode", "unwritten_page"): 1,
    }


def test_resumes_from_the_committed_position_after_a_restart(spool: Path, tmp_path: Path) -> None:
    p = Producer(spool)
    p.append(p.hello(), p.event("a"), p.event("b"))
    first = Journal(tmp_path / "j.db")
    SpoolReader(spool, first, first.load(), idle_grace=3600).poll()
    first.close()
    p.append(p.event("c"))
    second = Journal(tmp_path / "j.db")
    state = second.load()
    SpoolReader(spool, second, state, idle_grace=3600).poll()
    assert seqs(second, p.name) == [1, 2, 3, 4]
    assert [i.request_id for i in second.incidents()] == ["a", "b", "c"]
    assert state.daemon[("spool_records", ())] == 4


def test_how_an_engines_hooks_run_survives_a_daemon_restart(spool: Path, tmp_path: Path) -> None:
    """The hello's mode, scrub and invalid settings are the producer's, in the journal: a daemon
    restarted after the hello still shows the engine misconfigured (its status alarm, the
    ``kvwatch_engine_config_errors`` and ``kvwatch_engine_info`` series)."""
    from kvwatch.expose.metrics import config_errors
    from kvwatch.expose.status import engine_config

    p = Producer(spool)
    p.identity.update(mode="log", scrub="on_free", config_errors=["mode", "flush_interval"])
    p.append(p.hello(), p.counters(1))
    first = Journal(tmp_path / "j.db")
    SpoolReader(spool, first, first.load(), idle_grace=3600).poll()
    first.close()
    second = Journal(tmp_path / "j.db")
    state = second.load()
    producer = state.producers[p.name]
    assert (producer.mode, producer.scrub) == ("log", "on_free")
    assert producer.config_errors == ("mode", "flush_interval")
    counts = config_errors(state)
    assert counts[("decode", "mode")] == counts[("decode", "flush_interval")] == 1
    assert counts[("decode", "scrub")] == counts[("prefill", "mode")] == 0
    check = engine_config(state)
    assert check.level == "alarm" and "mode, flush_interval" in check.line, check
    second.close()


def test_torn_last_record_waits_while_the_producer_lives_then_counts(
    spool: Path, reader: SpoolReader, journal: Journal, state: State
) -> None:
    p = Producer(spool)
    hello = p.hello()
    whole = p.event("whole")
    torn = p.event("torn")
    p.append(hello, whole, torn[: len(torn) // 2])
    holder = os.open(p.path, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # the producer is alive
    try:
        assert reader.poll().records == 2
        assert rejected(state) == {}
        assert p.path.exists()
        assert state.lag_bytes == len(torn) // 2  # the half frame, still to come
        assert state.live_producers == 1
    finally:
        os.close(holder)  # the producer dies
    reader.idle_grace = 0.0
    reader.poll()
    assert rejected(state) == {"torn": 1}
    assert [i.request_id for i in journal.incidents()] == ["whole"]
    assert not p.path.exists()  # finished, moved to quarantine
    assert (spool / "q" / p.path.name).exists()


def test_flipped_byte_is_counted_and_the_records_around_it_kept(
    spool: Path, reader: SpoolReader, journal: Journal, state: State
) -> None:
    p = Producer(spool)
    hello, before = p.hello(), p.event("before")
    bad = bytearray(p.event("flipped"))
    bad[-5] ^= 0x01
    p.append(hello, before, bytes(bad), p.event("after"))
    result = reader.poll()
    assert rejected(state) == {"crc": 1}
    assert [i.request_id for i in journal.incidents()] == ["before", "after"]
    # The flipped record's sequence number is missing: it shows as one lost record too.
    assert result.lost == 1
    assert journal.scalar("SELECT count(*) FROM rejects WHERE reason = 'crc'") == 1


def test_damaged_header_resynchronises(
    spool: Path, reader: SpoolReader, journal: Journal, state: State
) -> None:
    p = Producer(spool)
    p.append(p.hello(), b"garbage-bytes-not-a-frame", p.event("after"))
    reader.poll()
    assert rejected(state) == {"framing": 1}
    assert [i.request_id for i in journal.incidents()] == ["after"]


def test_unknown_schema_version_and_malformed_records(
    spool: Path, reader: SpoolReader, journal: Journal, state: State
) -> None:
    p = Producer(spool)
    hello = p.hello()
    future = p.record("event", {})
    future["v"] = 99
    missing = p.record("event", {"detector": "canary"})
    p.append(
        hello,
        encode_frame(encode_payload(future)),
        encode_frame(encode_payload(missing)),
        encode_frame(b"{not json"),
        p.event("ok"),
    )
    reader.poll()
    assert rejected(state) == {"schema": 1, "malformed": 2}
    assert [i.request_id for i in journal.incidents()] == ["ok"]


def test_a_rejected_record_is_rejected_not_lost(spool: Path, tmp_path: Path) -> None:
    """Three gauge records, the middle one with a label this daemon's contract does not know
    (a newer engine's hooks beside an older daemon): rejected once, never also counted lost.
    A refused body that claims the next intact record's number steals nothing, and a true gap
    is still lost."""
    p = Producer(spool)
    hello = p.hello()
    first = p.frame("gauges", {"gauges": [["kv_pool_tokens", {}, 1.0]]})
    newer = p.record("gauges", {"gauges": [["kv_pool_tokens", {"tier": "hbm"}, 1.0]]})
    third = p.frame("gauges", {"gauges": [["kv_pool_tokens", {}, 2.0]]})
    p.append(hello, first, encode_frame(encode_payload(newer)), third)
    journal = Journal(tmp_path / "j.db")
    state = journal.load()
    reader = SpoolReader(spool, journal, state, idle_grace=3600)
    assert reader.poll().lost == 0
    assert rejected(state) == {"malformed": 1}
    assert state.daemon[("spool_lost_records", ())] == 0
    # A forged body with the number the next record will carry: the intact record still lands.
    intact = p.record("gauges", {"gauges": [["kv_pool_tokens", {}, 3.0]]})
    forged = {**intact, "gauges": [["kv_pool_tokens", {"forged": "x"}, 9.0]]}
    p.append(encode_frame(encode_payload(forged)), encode_frame(encode_payload(intact)))
    p.append(p.frame("gauges", {"gauges": [["kv_pool_tokens", {}, 4.0]]}, skip=2))
    reader.poll()
    assert rejected(state) == {"malformed": 2}
    assert journal.scalar("SELECT max(seq) FROM records") == p.seq
    assert journal.scalar("SELECT count(*) FROM records") == p.seq - 3  # the refused + the gap
    assert state.daemon[("spool_lost_records", ())] == 2
    assert journal.scalar("SELECT first_seq || '-' || last_seq FROM gaps") == "6-7"
    journal.close()


def test_oversize_record_is_skipped(
    spool: Path, reader: SpoolReader, journal: Journal, state: State
) -> None:
    p = Producer(spool)
    huge = b"{" + b" " * (MAX_RECORD_BYTES + 10) + b"}"
    p.append(p.hello(), encode_frame(huge), p.event("after"))
    reader.poll()
    assert rejected(state) == {"oversize": 1}
    assert [i.request_id for i in journal.incidents()] == ["after"]


def test_sequence_gap_is_lost_records_and_a_replay_is_rejected(
    spool: Path, reader: SpoolReader, journal: Journal, state: State
) -> None:
    p = Producer(spool)
    hello = p.hello()
    first = p.event("one")
    p.append(hello, first, p.frame("event", _event_fields("three"), skip=5))
    result = reader.poll()
    assert result.lost == 5
    assert state.daemon[("spool_lost_records", ())] == 5
    assert journal.scalar("SELECT first_seq || '-' || last_seq FROM gaps") == "3-7"
    p.append(first)  # the same record again
    reader.poll()
    assert rejected(state) == {"sequence": 1}
    assert seqs(journal, p.name) == [1, 2, 8]


def test_record_naming_another_producer_is_rejected(
    spool: Path, reader: SpoolReader, state: State
) -> None:
    p = Producer(spool)
    other = Producer(spool, name="vllm-prefill-r0-7-bbbb0001")
    p.append(p.hello(), other.event("spoofed"))
    reader.poll()
    assert rejected(state) == {"producer": 1}


def test_segment_owned_by_another_user_is_ignored(
    spool: Path, journal: Journal, state: State
) -> None:
    p = Producer(spool)
    p.append(p.hello(), p.event("x"))
    # Allow only another uid: the file is then owned by a user not allowed to write the spool.
    reader = SpoolReader(spool, journal, state, allowed_uids={os.geteuid() + 4242})
    reader.poll()
    reader.poll()  # counted once per file, not per poll
    assert rejected(state) == {"owner": 1}
    assert journal.incidents() == []
    assert p.path.exists()  # not ours to remove
    assert state.lag_bytes == 0 and state.live_producers == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root; the uid check above covers it")
def test_segment_chowned_to_nobody_is_ignored(
    spool: Path, reader: SpoolReader, journal: Journal, state: State
) -> None:
    p = Producer(spool)
    p.append(p.hello(), p.event("x"))
    os.chown(p.path, 65534, 65534)
    reader.poll()
    assert rejected(state) == {"owner": 1}
    assert journal.incidents() == []


def test_fifo_symlink_and_bad_names_are_ignored(
    spool: Path, reader: SpoolReader, state: State, tmp_path: Path
) -> None:
    os.mkfifo(spool / "sglang-decode-r0-1-cccc0001.000000.kvs")
    target = tmp_path / "elsewhere.kvs"
    target.write_bytes(b"")
    (spool / "sglang-decode-r0-2-cccc0002.000000.kvs").symlink_to(target)
    (spool / "no index.kvs").write_bytes(b"")
    (spool / "README").write_text("not a segment")
    reader.poll()
    assert rejected(state) == {"not_regular": 2, "name": 1}


def test_removal_waits_for_the_producer_and_rotation_is_followed(
    spool: Path, journal: Journal, state: State
) -> None:
    writer = spool_module().SpoolWriter(
        spool, engine="sglang", role="prefill", segment_bytes=600, max_segments=100
    )
    for i in range(12):
        assert writer.write("event", _event_fields(f"r{i}"))
    reader = SpoolReader(spool, journal, state, idle_grace=0.0)
    reader.poll()
    live = sorted(spool.glob("*.kvs"))
    assert len(live) == 1  # sealed segments removed, the active one (locked) kept
    assert state.live_producers == 1
    assert [i.request_id for i in journal.incidents()] == [f"r{i}" for i in range(12)]
    writer.close()
    reader.poll()
    assert list(spool.glob("*.kvs")) == []
    assert state.producers[writer.producer].retired
    assert state.live_producers == 0
    assert sum(rejected(state).values()) == 0
    assert state.daemon[("spool_lost_records", ())] == 0
    assert journal.scalar("SELECT count(*) FROM segments WHERE removed = 0") == 0


def test_idle_unlocked_segment_is_kept_within_the_grace(spool: Path, reader: SpoolReader) -> None:
    p = Producer(spool)
    p.append(p.hello())
    reader.poll()
    assert p.path.exists()  # unlocked but fresh: a producer may be between create and flock


def test_counters_stay_monotonic_across_a_producer_restart(
    spool: Path, journal: Journal, state: State
) -> None:
    reader = SpoolReader(spool, journal, state, idle_grace=0.0)
    old = Producer(spool, name="sglang-decode-r0-100-aaaa0001")
    old.append(old.hello(), old.counters(50))
    reader.poll()
    totals = state.hook_counter_totals()
    key = ("kvwatch_verifications", ("canary", "decode"))
    assert totals[key] == 50
    assert old.path.exists() is False  # gone: the producer is dead and its records committed
    new = Producer(spool, name="sglang-decode-r0-200-aaaa0002")
    new.append(new.hello(), new.counters(3))
    reader.poll()
    assert state.hook_counter_totals()[key] == 53  # not 3: a restart is not a reset
    # ...and after a daemon restart too.
    assert journal.load().hook_counter_totals()[key] == 53


def test_journal_failure_rolls_back_and_nothing_is_lost(spool: Path, tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.db")
    state = journal.load()
    reader = SpoolReader(spool, journal, state, idle_grace=3600)
    p = Producer(spool)
    p.append(p.hello(), p.event("a"))
    # The journal cannot be written (another writer holds it): a failure of the storage, not of
    # a record, so nothing is dead-lettered and the poll fails whole.
    journal.db.execute("PRAGMA busy_timeout = 0")
    other = sqlite3.connect(tmp_path / "j.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        reader.poll()
    other.execute("ROLLBACK")
    other.close()
    assert journal.scalar("SELECT count(*) FROM records") == 0
    assert journal.scalar("SELECT count(*) FROM rejects") == 0
    assert state.daemon.get(("spool_records", ()), 0) == 0
    reader.poll()
    assert [i.request_id for i in journal.incidents()] == ["a"]
    assert seqs(journal, p.name) == [1, 2]


def test_privacy_the_journal_holds_no_prompt_text(
    spool: Path, reader: SpoolReader, journal: Journal
) -> None:
    p = Producer(spool)
    hello = p.hello()
    smuggled = p.record("event", _event_fields("x"))
    smuggled["prompt"] = "SECRET PROMPT TEXT"  # not in the schema, but JSON allows extra keys
    p.append(hello, encode_frame(encode_payload(smuggled)))
    reader.poll()
    assert [i.request_id for i in journal.incidents()] == ["x"]
    dump = "\n".join(journal.db.iterdump())
    assert "SECRET" not in dump  # only the schema's fields are stored, never extra keys


def test_privacy_sources_hold_request_ids_and_counts_only(
    spool: Path, reader: SpoolReader, journal: Journal, tmp_path: Path
) -> None:
    """The exposed sources reach the journal and the incidents log as request ids, instances,
    page counts and times: a source smuggling content is rejected whole, never stored."""
    p = Producer(spool)
    hello = p.hello()
    smuggled = p.record("event", _event_fields("x"))
    smuggled["sources"] = [{"request_id": "alice", "pages": 2, "prompt": "SECRET PROMPT"}]
    honest = p.record("event", _event_fields("y"))
    honest["sources"] = [{"request_id": "bob", "pages": 3, "instance": "bob#1"}]
    p.append(hello, *(encode_frame(encode_payload(r)) for r in (smuggled, honest)))
    reader.poll()
    assert [i.request_id for i in journal.incidents()] == ["y"]
    assert journal.scalar("SELECT reason FROM rejects") == "malformed"
    dump = "\n".join(journal.db.iterdump())
    assert "SECRET" not in dump and "alice" not in dump
    columns = [r[1] for r in journal.db.execute("PRAGMA table_info(exposures)")]
    assert columns == [
        "id", "producer", "seq", "ts", "request_id", "instance", "pages", "written_at",
    ]  # fmt: skip
    log = IncidentsLog(tmp_path / "incidents.jsonl", max_bytes=1 << 20, keep=1)
    log.drain(journal)
    [line] = [json.loads(x) for x in log.path.read_text().splitlines()]
    assert line["sources"] == [
        {"request_id": "bob", "pages": 3, "instance": "bob#1", "written_at": 0.0}
    ]
    assert "SECRET" not in log.path.read_text()


def _event_fields(request_id: str) -> dict[str, object]:
    return {
        "detector": "checksum",
        "kind": "digest",
        "mode": "log",
        "action": "logged",
        "request_id": request_id,
        "pages": [3],
        "pages_total": 1,
        "detail": {},
    }


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_single_damage_loses_only_the_damaged_record(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    """Flip, cut or splice anywhere in a segment: no crash, and every record not touched by the
    damage is committed exactly once (the touched one is counted, never silently dropped)."""
    root = tmp_path_factory.mktemp("fuzz")
    spool = root / "spool"
    spool.mkdir()
    p = Producer(spool)
    frames = [p.hello()] + [p.event(f"r{i}") for i in range(1, 12)]
    blob = bytearray(b"".join(frames))
    starts = [sum(len(f) for f in frames[:i]) for i in range(len(frames))]
    action = data.draw(st.sampled_from(["flip", "cut", "junk"]))
    at = data.draw(st.integers(0, len(blob) - 1))
    if action == "flip":
        blob[at] ^= data.draw(st.integers(1, 255))
        touched = {max(i for i, s in enumerate(starts) if s <= at)}
    elif action == "cut":
        blob = blob[:at]
        touched = {i for i, s in enumerate(starts) if s + len(frames[i]) > at}
    else:
        blob[at:at] = data.draw(st.binary(min_size=1, max_size=40))
        touched = {i for i, s in enumerate(starts) if s < at < s + len(frames[i])}
    p.append(bytes(blob))
    journal = Journal(root / "j.db")
    state = journal.load()
    reader = SpoolReader(spool, journal, state, idle_grace=0.0)
    reader.poll()
    got = seqs(journal, p.name)
    assert got == sorted(set(got))  # no duplicates, in order
    expected = [i + 1 for i in range(len(frames)) if i not in touched]
    assert got == expected, (action, at, touched)
    if touched:
        assert sum(rejected(state).values()) >= 1 or (action == "cut" and at in starts)
    journal.close()


def test_reject_messages_never_carry_record_values(
    spool: Path, reader: SpoolReader, journal: Journal, state: State
) -> None:
    p = Producer(spool)
    hello = p.hello()
    bad = p.record("event", _event_fields("x"))
    bad["type"] = "SECRET PROMPT TEXT"
    p.append(hello, encode_frame(encode_payload(bad)))
    reader.poll()
    assert rejected(state) == {"schema": 1}
    message = journal.scalar("SELECT message FROM rejects")
    assert "SECRET" not in message and "18 chars" in message
