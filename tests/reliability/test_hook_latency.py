"""Case 1: the hook never waits. Spool append latency in an engine-like process with the daemon
running, stopped by SIGSTOP, and killed. CI asserts generous bounds on short runs; the figures
in docs/reliability.md come from ``bench/soak.py latency`` (longer runs)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from tests.reliability.tools import latency_under_daemon_conditions

APPENDS = 20_000
RATE = 8_000.0  # records/s: 2.5 s per condition


def test_append_latency_normal_stopped_killed(tmp_path: Path) -> None:
    # The spool lives on tmpfs (docs/architecture.md); /dev/shm is one on any Linux machine.
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else tmp_path) as spool_root:
        results = latency_under_daemon_conditions(Path(spool_root), APPENDS, RATE)
    print(results)
    for condition, r in results.items():
        assert r["n"] == APPENDS
        assert r["dropped"] == {}, (condition, r)  # nothing dropped: the spool has room
        assert r["p99_us"] < 1_000, (condition, r)
        assert r["max_us"] < 100_000, (condition, r)  # CI machines stall; the doc has the figure
