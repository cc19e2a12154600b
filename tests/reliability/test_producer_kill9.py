"""Case 3: kill -9 of an engine process mid-write. The torn tail is detected and counted, every
complete record is kept. (kill -9 of the daemon during a 100,000-record burst is
tests/kvwatch/store/test_kill9.py.)"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import kvspool
from kvwatch.store.journal import Journal
from tests.reliability.tools import REPO, DaemonProcess, metric, wait_for

KILLS = 5
DETAIL_BYTES = 60_000  # ~15 pages per write(): a SIGKILL can land inside the copy


def kill_one(spool: Path, rng: random.Random) -> tuple[str, int, bool]:
    """Start a producer, SIGKILL it at a random moment; (producer, intact records, torn)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.reliability.producer_loop", str(spool), "decode",
         str(DETAIL_BYTES)],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    producer = proc.stdout.readline().strip()
    # Kill it while it writes, not while a loaded machine has not yet scheduled its first write.
    first = spool / f"{producer}.000000.kvs"
    assert wait_for(lambda: first.exists() and first.stat().st_size > 2 * DETAIL_BYTES, 30)
    time.sleep(rng.uniform(0.1, 0.4))
    proc.kill()
    proc.wait()
    segments = sorted(spool.glob(f"{producer}.*.kvs"))
    assert segments
    last = segments[-1]
    contents = kvspool.read_spool(spool)
    mine = [r for r in contents.records if r["producer"] == producer]
    torn = bool(contents.errors["torn"])
    if not torn:
        # The kill landed between two writes: leave what a short write leaves, the head of a
        # frame with its tail missing, so that every run checks the detection.
        data = last.read_bytes()
        ends = [f.end for f in kvspool.iter_frames(data)]
        start = ends[-2] if len(ends) > 1 else 0
        os.truncate(last, start + (ends[-1] - start) // 2)
        mine = mine[:-1]
    return producer, len(mine), torn


def test_kill9_producer_mid_write_keeps_every_complete_record(tmp_path: Path) -> None:
    rng = random.Random(20261129)
    spool = tmp_path / "spool"
    spool.mkdir()
    results = []
    for _ in range(KILLS):
        results.append(kill_one(spool, rng))
        for p in spool.glob("*.kvs"):  # one dead producer at a time in the spool check above
            p.rename(tmp_path / p.name)
    for p in tmp_path.glob("*.kvs"):
        p.rename(spool / p.name)
    daemon = DaemonProcess(tmp_path, "--no-nvml", "--idle-grace", "0.3s")
    try:
        daemon.wait_started()
        assert wait_for(lambda: not list(spool.glob("*.kvs")), 60), daemon.output()[-2000:]
        metrics = daemon.scrape()
    finally:
        daemon.kill9()
    natural = sum(t for _, _, t in results)
    print(f"kills={KILLS} torn by the kill itself={natural} records={[n for _, n, _ in results]}")
    assert metric(metrics, "kvwatch_spool_rejected_total", reason="torn") == KILLS
    assert metric(metrics, "kvwatch_spool_lost_records_total") == 0
    journal = Journal(daemon.journal, readonly=True)
    try:
        for producer, intact, _ in results:
            row = journal.db.execute(
                "SELECT count(*), count(DISTINCT r.seq), min(r.seq), max(r.seq)"
                " FROM records r JOIN producers p ON p.id = r.producer WHERE p.name = ?",
                (producer,),
            ).fetchone()
            assert row == (intact, intact, 1, intact), (producer, row)
        torn_rows = journal.scalar("SELECT count(*) FROM rejects WHERE reason = 'torn'")
        assert torn_rows == KILLS
    finally:
        journal.close()
