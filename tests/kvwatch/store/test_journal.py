from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import msgspec
import pytest

from kvspool import Source, encode_frame, encode_payload
from kvwatch.ingest.spool.reader import SpoolReader
from kvwatch.store.incident import Finding
from kvwatch.store.incidents_log import IncidentsLog
from kvwatch.store.journal import (
    RETIRED_GRACE,
    ROWS_PER_INSERT,
    Batch,
    Journal,
    JournalError,
)
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
    assert [i.request_id for i in journal.incidents(detector="page_tag")] == ["b"]
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


def incident_row(i: int, run: int = 1) -> Finding:
    """A finding whose every field tells ``i`` apart, but for the producer's labels, the same
    for ``run`` findings in a row."""
    p = i // run
    return Finding(
        None, T0 + i, f"node-{p}", f"p{p}", i + 1, "decode", "sglang", f"0.{p}", f"m{p}", p,
        f"req-{i}", None if i % 2 else f"req-{i}#1", "canary", f"k{i}", "log", "logged",
        [i], i, [], i % 3, i % 5, {"n": i},
    )  # fmt: skip


@pytest.mark.parametrize("run", [1, 7, ROWS_PER_INSERT, ROWS_PER_INSERT + 1, 1000])
@pytest.mark.parametrize(
    "count", [1, ROWS_PER_INSERT - 1, ROWS_PER_INSERT, 2 * ROWS_PER_INSERT + 5, 300]
)
def test_a_commit_writes_every_row_in_its_order(journal: Journal, count: int, run: int) -> None:
    """Rows go in chunks of ROWS_PER_INSERT per statement (an incident's producer labels bound
    once per chunk of a run of rows that repeat them) and the rest one by one: every row lands
    whole, in the batch's order (rowids follow it), whatever the count and the runs."""
    batch = Batch()
    batch.records = [(i % 3, i + 1, ("event", "counters")[i % 2], T0 + i) for i in range(count)]
    batch.findings = [incident_row(i, run) for i in range(count)]
    stored = journal.commit(batch, journal.load())
    assert stored is not None and stored.first == 1 and stored.findings == batch.findings
    records = journal.db.execute("SELECT * FROM records ORDER BY rowid").fetchall()
    assert records == batch.records
    assert journal.incidents(after_id=0) == [
        msgspec.structs.replace(f, id=k + 1) for k, f in enumerate(batch.findings)
    ]


def test_a_row_of_the_wrong_width_fails_the_whole_commit(journal: Journal) -> None:
    batch = Batch()
    batch.records = [(1, i + 1, "event", T0 + i) for i in range(2 * ROWS_PER_INSERT)]
    batch.records[5] = (1, 6, "event")  # type: ignore[assignment]
    with pytest.raises(sqlite3.ProgrammingError):
        journal.commit(batch, journal.load())
    batch = Batch()
    batch.findings = [incident_row(i, 1000) for i in range(2 * ROWS_PER_INSERT)]
    batch.findings[70].pages_total = 1 << 70  # past SQLite's INTEGER
    with pytest.raises(OverflowError):
        journal.commit(batch, journal.load())
    assert journal.scalar("SELECT count(*) FROM records") == 0
    assert journal.scalar("SELECT count(*) FROM incidents") == 0
    assert not journal.db.in_transaction


def test_an_incident_row_says_what_its_record_said(spool: Path, journal: Journal) -> None:
    """The reader builds a Finding positionally (for speed): each field must land in its own
    column, ``instance`` included, detail's keys sorted and sources most pages first. The node
    is the daemon's (its ``node`` setting: what Prometheus and the pages call it), not the
    engine's host name."""
    state = journal.load()
    reader = SpoolReader(spool, journal, state, idle_grace=3600.0, node="node-b")
    p = Producer(
        spool, "vllm-prefill-r3-7-abcd0001", role="prefill", engine="vllm", model="llama",
        version="0.33.0", rank=3, node="engine-host-7",
    )  # fmt: skip
    hello = p.hello()
    event = p.record(
        "event",
        {
            "detector": "checksum", "kind": "digest", "mode": "enforce", "action": "enforced",
            "request_id": "req-42", "instance": "req-42#2", "pages": [5, 9], "pages_total": 12,
            "detail": {"b": "x", "a": 1},
            "sources": [
                {"request_id": "req-7", "instance": "req-7#1", "pages": 9, "written_at": T0},
                {"request_id": "req-8", "pages": 3},
                {"request_id": "req-9", "pages": 10},
            ],
            "other_sources": 4, "other_source_pages": 6,
        },
    )  # fmt: skip
    p.append(hello, encode_frame(encode_payload(event)))
    reader.poll()
    [row] = journal.incidents()
    assert row == Finding(
        ts=event["ts"], node="node-b", role="prefill", engine="vllm",
        engine_version="0.33.0", model="llama", rank=3, producer=p.name, seq=2,
        request_id="req-42", instance="req-42#2", detector="checksum", kind="digest",
        mode="enforce", action="enforced", pages=[5, 9], pages_total=12,
        detail={"a": 1, "b": "x"}, other_sources=4, other_source_pages=6, id=1,
        sources=[
            Source(request_id="req-9", pages=10),
            Source(request_id="req-7", instance="req-7#1", pages=9, written_at=T0),
            Source(request_id="req-8", pages=3),
        ],
    )  # fmt: skip
    assert list(row.detail) == ["a", "b"]
    # The edges are committed with the incident: a second journal connection sees both.
    other = Journal(journal.path, readonly=True)
    assert other.incidents() == [row]
    other.close()


def test_a_schema_1_journal_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema', '1');
        CREATE TABLE producers (
            id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, engine TEXT, engine_version TEXT,
            role TEXT, model TEXT, rank INTEGER, host TEXT, pid INTEGER, first_seen REAL,
            last_ts REAL, last_seq INTEGER NOT NULL, counters TEXT NOT NULL,
            gauges TEXT NOT NULL, retired INTEGER NOT NULL, retired_at REAL);
        INSERT INTO producers VALUES (1, 'p', 'sglang', '1', 'decode', 'm', 0, 'node-a', 1, 0,
            0, 5, '[["verifications",{"detector":"canary"},3]]', '{}', 0, 0);
        CREATE TABLE incidents (
            id INTEGER PRIMARY KEY, ts REAL NOT NULL, node TEXT, role TEXT, engine TEXT,
            engine_version TEXT, model TEXT, rank INTEGER, producer TEXT NOT NULL,
            seq INTEGER NOT NULL, request_id TEXT NOT NULL, detector TEXT NOT NULL,
            kind TEXT NOT NULL, mode TEXT, action TEXT, pages TEXT NOT NULL,
            pages_total INTEGER NOT NULL, detail TEXT NOT NULL);
        INSERT INTO incidents (ts, node, role, engine, engine_version, model, rank, producer,
            seq, request_id, detector, kind, mode, action, pages, pages_total, detail)
            VALUES (1.5, 'node-a', 'decode', 'sglang', '1', 'm', 0, 'p', 2, 'r', 'canary',
            'unwritten_page', 'log', 'logged', '1,2,3', 3, '{}');
        CREATE TABLE rejects (
            id INTEGER PRIMARY KEY, ts REAL NOT NULL, segment TEXT NOT NULL,
            offset INTEGER NOT NULL, length INTEGER NOT NULL, reason TEXT NOT NULL,
            message TEXT NOT NULL);
        """
    )
    db.commit()
    db.close()
    journal = Journal(path)
    [row] = journal.incidents()
    assert row.pages == [1, 2, 3] and row.instance is None and row.node == "node-a"
    state = journal.load()
    assert state.producers["p"].node == "node-a"
    assert (state.producers["p"].mode, state.producers["p"].config_errors) == ("", ())
    assert state.hook_counter_totals()[("kvwatch_verifications", ("canary", "decode"))] == 3
    assert journal.scalar("SELECT value FROM meta WHERE key = 'schema'") == "5"
    assert row.sources == [] and row.other_sources == 0
    journal.close()


def test_exposures_are_pruned_with_their_incident_and_the_log_goes_on(
    spool: Path, journal: Journal, tmp_path: Path
) -> None:
    state = journal.load()
    reader = SpoolReader(spool, journal, state, idle_grace=3600.0)
    log = IncidentsLog(tmp_path / "incidents.jsonl", max_bytes=1 << 20, keep=1)
    p = Producer(spool)
    p.append(p.hello(), p.event("a", sources=[{"request_id": "s1", "pages": 2}]))
    reader.poll()
    assert journal.scalar("SELECT count(*) FROM exposures") == 1
    assert log.drain(journal) == 1
    journal.prune(state, now=time.time() + 10 * 86400, retention=86400, records_retention=86400)
    assert journal.scalar("SELECT count(*) FROM exposures") == 0
    assert journal.incidents() == []
    restarted = IncidentsLog(log.path, max_bytes=1 << 20, keep=1)
    restarted.recover(journal)  # a daemon that starts now (the mark was 1, the log says 1)
    p.t0 = time.time()
    p.append(p.event("b", sources=[{"request_id": "s2", "pages": 1}]))
    reader.poll()
    [second] = journal.incidents()
    assert [s.request_id for s in second.sources] == ["s2"]
    # SQLite gave the new incident the pruned one's id: the log's mark must not skip it, in this
    # daemon or in the next.
    assert second.id == 1
    assert restarted.drain(journal) == 1
    assert restarted.drain(journal) == 0
    assert [json.loads(x)["request_id"] for x in log.path.read_text().splitlines()] == ["a", "b"]


def _schema_2_journal(path: Path) -> None:
    """A journal as kvwatch with schema 2 left it (its DDL, as that release wrote it)."""
    import sqlite3

    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema', '2');
        CREATE TABLE incidents (id INTEGER PRIMARY KEY, ts REAL NOT NULL, node TEXT NOT NULL,
            role TEXT NOT NULL, engine TEXT NOT NULL, engine_version TEXT NOT NULL,
            model TEXT NOT NULL, rank INTEGER NOT NULL, producer TEXT NOT NULL,
            seq INTEGER NOT NULL, request_id TEXT NOT NULL, instance TEXT,
            detector TEXT NOT NULL, kind TEXT NOT NULL, mode TEXT NOT NULL,
            action TEXT NOT NULL, pages TEXT NOT NULL, pages_total INTEGER NOT NULL,
            detail TEXT NOT NULL);
        CREATE INDEX incidents_ts ON incidents (ts);
        INSERT INTO incidents VALUES (7, 1.5, 'node-a', 'decode', 'sglang', '1', 'm', 0, 'p', 2,
            'r', 'r#1', 'canary', 'unwritten_page', 'log', 'logged', '[1,2]', 2, '{}');
        """
    )
    db.commit()
    db.close()


def test_a_schema_2_journal_reads_and_migrates(tmp_path: Path) -> None:
    path = tmp_path / "v2.db"
    _schema_2_journal(path)
    # Read only (kvwatch incidents on a copy from a node not upgraded yet): no sources.
    readonly = Journal(path, readonly=True)
    [old] = readonly.incidents()
    assert old.sources == [] and old.other_sources == 0 and old.pages == [1, 2]
    readonly.close()
    journal = Journal(path)
    assert journal.meta("schema") == "5"
    assert journal.incidents() == [old]
    journal.close()
    # Migrated in place to schema 4: acknowledgements can be stored and read back.
    from kvwatch.store.journal import AckRow, acknowledge

    acknowledge(path, AckRow(2.0, "alice", 7, incident=7))
    readonly = Journal(path, readonly=True)
    assert readonly.acks() == [AckRow(2.0, "alice", 7, 7, None, None)]
    readonly.close()


def test_a_journal_older_than_a_finding_field_reads_it_and_gains_its_column(
    spool: Path, journal: Journal
) -> None:
    """A field added to Finding is a column a journal that predates it lacks: read only, the
    field reads as its type's zero; opened by the daemon, the column is added."""
    reader = SpoolReader(spool, journal, journal.load(), idle_grace=3600.0)
    p = Producer(spool)
    p.append(p.hello(), p.event("a", other_sources=2, other_source_pages=5))
    reader.poll()
    journal.db.execute("ALTER TABLE incidents DROP COLUMN other_source_pages")
    journal.close()
    older = Journal(journal.path, readonly=True)
    [row] = older.incidents()
    assert (row.request_id, row.other_sources, row.other_source_pages) == ("a", 2, 0)
    older.close()
    reopened = Journal(journal.path)
    assert reopened.incidents()[0].other_source_pages == 0
    assert "other_source_pages" in {
        r[1] for r in reopened.db.execute("PRAGMA table_info(incidents)")
    }
    reopened.close()


def test_a_schema_4_journals_finding_counts_keep_their_totals_under_the_new_name(
    tmp_path: Path,
) -> None:
    """Schema 5 names the finding counter ``findings`` (it was ``incidents``, and counted
    findings): a schema-4 journal's counts move to it, so kvwatch_findings_total starts where
    kvwatch_incidents_total was, never at 0."""
    import sqlite3

    from kvwatch.store.journal.writes import _labels_text

    path = tmp_path / "v4.db"
    Journal(path).close()
    db = sqlite3.connect(path)
    labels = _labels_text(("canary", "decode", "unwritten_page"))
    db.execute("UPDATE meta SET value = '4' WHERE key = 'schema'")
    db.execute("INSERT INTO counters VALUES ('incidents', ?, 5)", (labels,))
    db.commit()
    db.close()
    journal = Journal(path)
    state = journal.load()
    assert state.daemon[("findings", ("canary", "decode", "unwritten_page"))] == 5
    assert ("incidents", ("canary", "decode", "unwritten_page")) not in state.daemon
    assert journal.meta("schema") == "5"
    journal.close()
