"""Case 6: who may write. Segments owned by a user the daemon does not trust are ignored and
counted, every one of them; a symlink planted in the spool directory is not followed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvwatch.store.journal import Journal
from tests.kvwatch.spoolgen import Producer
from tests.reliability.tools import DaemonProcess, metric, wait_for

FOREIGN = 50
SYMLINKS = 10
STRANGER = 54321  # a uid the daemon is not told to trust


def segment(directory: Path, name: str, events: int) -> Path:
    p = Producer(directory, name)
    p.append(p.hello() + b"".join(p.event(f"{name}-{i}") for i in range(events)))
    return p.path


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_foreign_segments_and_symlinks_are_ignored_and_counted(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    for i in range(FOREIGN):
        os.chown(segment(spool, f"foreign-{i:04d}", 20), STRANGER, STRANGER)
    targets = []
    for i in range(SYMLINKS):
        # A valid segment outside the spool: followed, its records would be committed.
        target = segment(outside, f"planted-{i:04d}", 20)
        targets.append((target, target.read_bytes()))
        (spool / f"planted-{i:04d}.000000.kvs").symlink_to(target)
    segment(spool, "trusted-0001", 20)  # the daemon's own uid: committed as usual

    daemon = DaemonProcess(tmp_path, "--no-nvml", "--idle-grace", "0.2s")
    try:
        daemon.wait_started()

        def done() -> bool:
            return metric(daemon.scrape(), "kvwatch_spool_records_total") == 21.0

        assert wait_for(done, 30), daemon.output()[-2000:]
        assert wait_for(lambda: not (spool / "trusted-0001.000000.kvs").exists(), 30)
        metrics = daemon.scrape()
    finally:
        daemon.kill9()
    assert metric(metrics, "kvwatch_spool_rejected_total", reason="owner") == FOREIGN
    assert metric(metrics, "kvwatch_spool_rejected_total", reason="not_regular") == SYMLINKS
    journal = Journal(daemon.journal, readonly=True)
    try:
        names = {row[0] for row in journal.db.execute("SELECT name FROM producers")}
        assert names == {"trusted-0001"}
        counters = dict(journal.db.execute("SELECT name, value FROM counters WHERE labels = ''"))
        assert counters["spool_records"] == 21
    finally:
        journal.close()
    # Ignored, not consumed: the foreign segments stay, the symlink targets are untouched.
    assert len(list(spool.glob("foreign-*.kvs"))) == FOREIGN
    for target, content in targets:
        assert target.read_bytes() == content
