from __future__ import annotations

import io
import sqlite3
import time
from pathlib import Path

import pytest

from kvwatch import incidents
from kvwatch.journal import RETIRED_GRACE, Journal, JournalError
from kvwatch.spool_reader import SpoolReader
from tests.kvwatch.spoolgen import T0, Producer


def test_wal_mode_and_schema(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.db")
    assert journal.scalar("PRAGMA journal_mode") == "wal"
    journal.close()
    readonly = Journal(tmp_path / "j.db", readonly=True)
    with pytest.raises(Exception, match=r"readonly|read-only|query_only|attempt to write"):
        readonly.db.execute("DELETE FROM records")
    readonly.close()


def test_readonly_journal_must_exist(tmp_path: Path) -> None:
    with pytest.raises(JournalError):
        Journal(tmp_path / "missing.db", readonly=True)


def test_retention_prunes_and_keeps_counters_monotonic(spool: Path, journal: Journal) -> None:
    state = journal.load()
    reader = SpoolReader(spool, journal, state, idle_grace=0.0)
    p = Producer(spool)
    p.append(p.hello(), p.counters(70), p.event("old"))
    reader.poll()
    assert state.producers[p.name].retired
    key = ("kvwatch_verifications", ("canary", "decode"))
    assert state.hook_counter_totals()[key] == 70
    later = time.time() + 10 * 86400  # everything is older than a day by then
    deleted = journal.prune(state, now=later, retention=86400, records_retention=86400)
    assert deleted > 0
    assert journal.incidents() == []
    assert journal.scalar("SELECT count(*) FROM records") == 0
    assert state.producers == {}
    assert state.hook_counter_totals()[key] == 70  # folded into the base
    assert journal.load().hook_counter_totals()[key] == 70


def test_incident_filters(spool: Path, journal: Journal) -> None:
    state = journal.load()
    reader = SpoolReader(spool, journal, state, idle_grace=3600)
    p = Producer(spool)
    p.append(p.hello(), p.event("a"), p.event("b", detector="page_tag", kind="stale_tag"))
    reader.poll()
    assert [i["request_id"] for i in journal.incidents(detector="page_tag")] == ["b"]
    assert journal.incidents(since=time.time()) == []
    assert len(journal.incidents(since=T0)) == 2


def test_memory_keeps_neither_removed_segments_nor_too_many_retired_producers(
    spool: Path, journal: Journal
) -> None:
    state = journal.load()
    reader = SpoolReader(spool, journal, state, idle_grace=0.0)
    producers = [Producer(spool, f"sglang-decode-r0-{100 + i}-aaaa0001") for i in range(12)]
    for p in producers:
        p.append(p.hello(), p.counters(10))
    reader.poll()
    # Every segment was read and removed: the journal keeps the rows, memory does not.
    assert state.segments == {}
    assert journal.scalar("SELECT count(*) FROM segments WHERE removed = 1") == 12
    assert journal.load().segments == {}
    assert all(p.retired for p in state.producers.values())
    key = ("kvwatch_verifications", ("canary", "decode"))
    assert state.hook_counter_totals()[key] == 120

    # Within the grace nothing is folded, however many there are.
    journal.prune(state, now=time.time(), retention=86400, records_retention=86400, max_retired=5)
    assert len(state.producers) == 12
    newest = max(state.producers.values(), key=lambda p: p.id)
    newest.retired_at -= 60  # retired first: folded first, and its id is the highest
    later = time.time() + RETIRED_GRACE + 1
    journal.prune(state, now=later, retention=86400, records_retention=86400, max_retired=5)
    assert newest.name not in state.producers
    assert len(state.producers) == 5  # the oldest 7 folded into the base
    assert state.hook_counter_totals()[key] == 120
    assert journal.load().hook_counter_totals()[key] == 120
    assert len(journal.load().producers) == 5
    # The folded producers' ids are on their records rows still: a restart never reuses them.
    assert journal.load().next_producer_id == 13


def test_a_replayed_removed_segment_is_rejected_by_sequence(spool: Path, journal: Journal) -> None:
    state = journal.load()
    reader = SpoolReader(spool, journal, state, idle_grace=0.0)
    p = Producer(spool)
    p.append(p.hello(), p.counters(5))
    copy = p.path.read_bytes()
    reader.poll()
    assert not p.path.exists() and state.segments == {}
    p.path.write_bytes(copy)  # the same segment again, under its old name
    reader.poll()
    assert state.daemon[("spool_rejected", ("sequence",))] == 2
    assert journal.scalar("SELECT count(*) FROM records") == 2


def test_segments_read_and_removed_in_one_poll_are_no_lag(spool: Path, journal: Journal) -> None:
    state = journal.load()
    reader = SpoolReader(spool, journal, state, idle_grace=3600)
    p = Producer(spool)
    p.append(p.hello(), p.event("a"), p.seal())
    p.index += 1
    p.append(p.hello(), p.event("b"))
    reader.poll()
    # The sealed segment was read and removed; the live one is read to its end.
    assert [s.index for s in state.segments.values()] == [1]
    assert state.lag_bytes == 0


def test_prune_deletes_only_the_records_rows_past_their_retention(journal: Journal) -> None:
    now = time.time()
    rows = [(1, i, "event", now - 100 + i) for i in range(100)]  # ts from now-100 to now-1
    journal.db.executemany("INSERT INTO records VALUES (?, ?, ?, ?)", rows)
    journal.prune(journal.load(), now=now, retention=86400, records_retention=30)
    kept = [r[0] for r in journal.db.execute("SELECT seq FROM records ORDER BY rowid")]
    assert kept == list(range(70, 100))  # ts >= now - 30


def test_incidents_keep_the_request_instance(spool: Path, journal: Journal) -> None:
    """Two requests that share a request id are two incidents, told apart by their instance."""
    reader = SpoolReader(spool, journal, journal.load(), idle_grace=3600)
    p = Producer(spool)
    p.append(p.hello(), p.event("same", instance="i-1"), p.event("same", instance="i-2"))
    p.append(p.event("older"))  # a producer that sends no instance
    reader.poll()
    rows = journal.incidents()
    assert [(r["request_id"], r["instance"]) for r in rows] == [
        ("same", "i-1"),
        ("same", "i-2"),
        ("older", ""),
    ]
    out = io.StringIO()
    incidents.render(rows, out, as_json=False)
    lines = out.getvalue().splitlines()
    assert lines[0].split()[5:7] == ["REQUEST", "INSTANCE"]
    assert [line.split()[4:6] for line in lines[1:3]] == [["same", "i-1"], ["same", "i-2"]]
    assert lines[3].split()[4:6] == ["older", "-"]


def test_a_journal_from_before_instances_gains_the_column(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE incidents (id INTEGER PRIMARY KEY, ts REAL NOT NULL, node TEXT, role TEXT,"
        " engine TEXT, engine_version TEXT, model TEXT, rank INTEGER, producer TEXT NOT NULL,"
        " seq INTEGER NOT NULL, request_id TEXT NOT NULL, detector TEXT NOT NULL,"
        " kind TEXT NOT NULL, mode TEXT, action TEXT, pages TEXT NOT NULL,"
        " pages_total INTEGER NOT NULL, detail TEXT NOT NULL);"
        " INSERT INTO incidents VALUES (1, 1.0, 'n', 'decode', 'sglang', 'v', 'm', 0, 'p', 1,"
        " 'old', 'canary', 'unwritten_page', 'log', 'logged', '1,2', 2, '{}');"
    )
    db.close()
    journal = Journal(path)
    [row] = journal.incidents()
    assert (row["request_id"], row["instance"]) == ("old", "")
    journal.close()
