"""kill -9 the daemon at random moments during a burst: every record lands exactly once."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

from kvwatch.store.journal import Journal
from tests.kvwatch.daemonproc import REPO, DaemonProcess

PRODUCERS = (("prefill", 26_000), ("decode", 26_000), ("prefill", 26_000), ("decode", 26_000))
MIN_KILLS = 5
MAX_KILLS = 25


def journal_counts(path: Path) -> tuple[int, int]:
    """(records committed, segments not yet removed) as the journal says."""
    if not path.exists():
        return 0, -1
    journal = Journal(path, readonly=True)
    try:
        records = journal.scalar("SELECT count(*) FROM records")
        pending = journal.scalar("SELECT count(*) FROM segments WHERE removed = 0")
        return int(records), int(pending)
    finally:
        journal.close()


def test_kill9_during_a_burst_loses_and_repeats_nothing(tmp_path: Path) -> None:
    rng = random.Random(20260909)
    spool = tmp_path / "spool"
    spool.mkdir()
    journal_path = tmp_path / "journal.db"
    producers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.kvwatch.producer", str(spool), role, str(count)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        for role, count in PRODUCERS
    ]
    kills = 0
    kill_records: list[int] = []
    in_flight = 0  # kills that landed while records were flowing
    daemon = DaemonProcess(tmp_path, "--no-nvml", "--idle-grace", "0.5s", journal=journal_path)
    try:
        # Kill at random moments while the producers write and on through the catch-up, until
        # at least MIN_KILLS kills landed mid-stream (records committed, more still to come).
        while kills < MAX_KILLS:
            daemon.wait_started()
            time.sleep(rng.uniform(0.05, 0.4))
            daemon.kill9()
            kills += 1
            committed = journal_counts(journal_path)[0]
            writing = any(p.poll() is None for p in producers)
            pending = writing or any(spool.glob("*.kvs"))
            if pending and committed > (kill_records[-1] if kill_records else 0):
                in_flight += 1
            kill_records.append(committed)
            daemon = DaemonProcess(
                tmp_path, "--no-nvml", "--idle-grace", "0.5s", journal=journal_path
            )
            if in_flight >= MIN_KILLS or not pending:
                break
        reports = [json.loads(p.communicate(timeout=120)[0]) for p in producers]
        assert all(p.returncode == 0 for p in producers)
        expected = sum(r["seq"] for r in reports)
        assert expected >= 100_000
        daemon.wait_started()
        deadline = time.monotonic() + 120
        while journal_counts(journal_path) != (expected, 0) and time.monotonic() < deadline:
            time.sleep(0.2)
        metrics = daemon.scrape()
        assert daemon.stop() == 0
    finally:
        if daemon.proc.poll() is None:
            daemon.kill9()
        for p in producers:
            if p.poll() is None:
                p.kill()
    # The kills landed while records were flowing, not only before or after.
    assert in_flight >= MIN_KILLS, (kill_records, expected)

    journal = Journal(journal_path, readonly=True)
    try:
        for report in reports:
            rows = journal.db.execute(
                "SELECT count(*), count(DISTINCT r.seq), min(r.seq), max(r.seq)"
                " FROM records r JOIN producers p ON p.id = r.producer WHERE p.name = ?",
                (report["producer"],),
            ).fetchone()
            assert rows == (report["seq"], report["seq"], 1, report["seq"]), report
            incidents = journal.scalar(
                "SELECT count(*) FROM incidents WHERE producer = ?", (report["producer"],)
            )
            assert incidents == report["events"]
        assert journal.scalar("SELECT count(*) FROM rejects") == 0
        assert journal.scalar("SELECT count(*) FROM gaps") == 0
        counters = dict(journal.db.execute("SELECT name, value FROM counters WHERE labels = ''"))
        assert counters["spool_records"] == expected
        assert counters.get("spool_lost_records", 0) == 0
    finally:
        journal.close()
    assert list(spool.glob("*.kvs")) == []  # every segment committed and removed
    assert f"kvwatch_spool_records_total {float(expected)}" in metrics
    assert "kvwatch_spool_lost_records_total 0.0" in metrics
