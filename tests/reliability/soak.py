"""The soak run, shared by tests/reliability/test_soak.py (short) and bench/soak.py (long).

The real daemon and N real producer processes (engine_hooks' SpoolWriter) writing at a fixed
total record rate for a fixed time. Every second: the daemon's resident memory, its lag
(kvwatch_spool_lag_bytes) and the records it committed. At the end: nothing lost, nothing
dropped, the time to catch up, and the resident memory after the warm-up against the end.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.reliability.tools import REPO, DaemonProcess, memory_kib, metric, wait_for


def soak(
    seconds: float,
    rate: float,
    producers: int,
    warmup: float,
    workdir: Path | None = None,
    samples_path: Path | None = None,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = workdir or Path(tmp)
        daemon = DaemonProcess(root, "--no-nvml", "--idle-grace", "1s")
        procs: list[subprocess.Popen[str]] = []
        samples: list[dict[str, float]] = []
        try:
            daemon.wait_started()
            daemon.spool.mkdir(exist_ok=True)
            procs = [
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "tests.reliability.producer_loop",
                        str(daemon.spool),
                        "decode" if i % 2 else "prefill",
                        "0",
                        str(rate / producers),
                        str(seconds),
                    ],
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for i in range(producers)
            ]
            start = time.monotonic()
            while any(p.poll() is None for p in procs):
                time.sleep(1.0)
                text = daemon.scrape()
                memory = memory_kib(daemon.proc.pid)
                samples.append(
                    {
                        "t": round(time.monotonic() - start, 1),
                        "rss_kib": memory["VmRSS"],
                        "anon_kib": memory["RssAnon"],
                        "file_kib": memory["RssFile"],
                        "shmem_kib": memory["RssShmem"],
                        "lag_bytes": metric(text, "kvwatch_spool_lag_bytes") or 0.0,
                        # Records are written all the time: the newest committed one's age is
                        # how far the daemon is behind the engines (plus its poll interval).
                        "lag_seconds": time.time()
                        - (metric(text, "kvwatch_last_record_timestamp_seconds") or 0.0),
                        "records": metric(text, "kvwatch_spool_records_total") or 0.0,
                    }
                )
            reports = [json.loads(p.communicate()[0].splitlines()[-1]) for p in procs]
            written = sum(r["seq"] for r in reports)
            stopped = time.monotonic()

            def caught_up() -> bool:
                return metric(daemon.scrape(), "kvwatch_spool_records_total") == written

            assert wait_for(caught_up, 120, 0.1), "the daemon did not catch up"
            catch_up = time.monotonic() - stopped
            final = daemon.scrape()
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            daemon.kill9()
    if samples_path is not None:
        samples_path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    steady = [s for s in samples if s["t"] >= warmup] or samples
    rss_start, rss_end = steady[0]["rss_kib"], steady[-1]["rss_kib"]
    parts = ("anon_kib", "file_kib", "shmem_kib")
    return {
        "seconds": seconds,
        "rate": rate,
        "producers": producers,
        "written": written,
        "achieved_rate": round(written / seconds, 1),
        "committed": metric(final, "kvwatch_spool_records_total"),
        "lost": metric(final, "kvwatch_spool_lost_records_total"),
        "dropped": sum(sum(r["dropped"].values()) for r in reports),
        "rss_kib_start": rss_start,
        "rss_kib_end": rss_end,
        "rss_kib_max": max(s["rss_kib"] for s in steady),
        "rss_growth_pct": round(100.0 * (rss_end - rss_start) / rss_start, 2),
        # Which part grew: the heap (anonymous memory), or mapped files and shared memory.
        "rss_parts_start": {k: steady[0][k] for k in parts},
        "rss_parts_end": {k: steady[-1][k] for k in parts},
        "max_lag_bytes": max(s["lag_bytes"] for s in samples),
        "max_lag_seconds": round(max(s["lag_seconds"] for s in samples[1:] or samples), 3),
        "catch_up_seconds": round(catch_up, 2),
    }
