from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvwatch.journal import Journal, JournalError
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
