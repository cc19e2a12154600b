"""Benchmark the kvwatch daemon: spool catch-up rate, memory, and the cost of one scrape.

    .venv/bin/python bench/daemon.py [--records 1000000] [--producers 8]

One run, figures and ratios against baselines measured in the same run:

- catch-up: the daemon's own poll loop (``Daemon.run_once``: read, check, commit to the SQLite
  journal, remove finished segments) on a backlog of spool records from several producers, in
  records/s; baseline: ``kvspool.read_spool`` decoding and validating the same records with no
  journal (the floor any reader pays). Target: at least 100,000 records/s on one core.
- memory: the daemon process's resident set during and after the catch-up. Target: under 150 MB
  and flat.
- scrape: the time to render /metrics at the default series count, as a ratio to
  prometheus_client rendering the same families from a plain registry by itself.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

import kvspool
from kvwatch.config import Config
from kvwatch.daemon import Daemon
from kvwatch.metrics import KvwatchCollector

EVENT_SHARE = 0.8  # the rest are counter snapshots (a leak storm: mostly detection events)


def rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        pages = int(handle.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e6


def write_backlog(spool: Path, records: int, producers: int) -> int:
    """Write ``records`` records as ``producers`` SpoolWriter-style producers would."""
    total = 0
    per = records // producers
    counters = [
        ["verifications", {"detector": d}, 0] for d in ("canary", "checksum", "page_tag")
    ] + [["hook_seconds", {"hook": h}, 0.0] for h in ("alloc", "free", "reserve", "verify")]
    for p in range(producers):
        role = "prefill" if p % 2 else "decode"
        name = f"sglang-{role}-r{p}-{1000 + p}-bench{p:03d}"
        index, seq, size = 0, 0, 0
        handle = open(spool / f"{name}.{index:06d}.kvs", "wb")  # noqa: SIM115

        def frame(kind: str, fields: dict[str, Any], name: str = name) -> bytes:
            nonlocal seq
            seq += 1
            record = {"v": 1, "type": kind, "producer": name, **fields}
            record["seq"], record["ts"] = seq, 1_790_000_000.0 + seq / 1000
            return kvspool.encode_frame(kvspool.encode_payload(record))

        hello = {
            "engine": "sglang",
            "engine_version": "0.5.23",
            "role": role,
            "model": "glm-5.3",
            "rank": p,
            "pid": 1000 + p,
            "node": "bench",
        }
        handle.write(frame("hello", hello))
        written = 1
        while written < per:
            if written % 5 == 0:
                for item in counters:
                    item[2] = written
                data = frame("counters", {"counters": counters})
            else:
                data = frame(
                    "event",
                    {
                        "detector": "canary",
                        "kind": "unwritten_page",
                        "mode": "log",
                        "action": "logged",
                        "request_id": f"req-{p}-{written}",
                        "pages": list(range(written % 50, written % 50 + 7)),
                        "pages_total": 7,
                        "detail": {"unwritten": 7},
                    },
                )
            handle.write(data)
            size += len(data)
            written += 1
            if size > 8 << 20 and written < per - 2:  # rotate as the writer does
                handle.write(frame("seal", {"next_segment": f"{name}.{index + 1:06d}.kvs"}))
                handle.close()
                index, size = index + 1, 0
                handle = open(spool / f"{name}.{index:06d}.kvs", "wb")  # noqa: SIM115
                handle.write(frame("hello", hello))
                written += 2
        handle.close()
        total += seq
    return total


class Frozen(Collector):
    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        return self.families


def best_of(runs: int, fn: Any) -> float:
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--producers", type=int, default=8)
    args = parser.parse_args()
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    work = Path(tempfile.mkdtemp(prefix="kvwatch-bench-", dir=shm))
    disk = Path(tempfile.mkdtemp(prefix="kvwatch-bench-journal-"))
    try:
        spool = work / "spool"
        spool.mkdir()
        started = time.perf_counter()
        total = write_backlog(spool, args.records, args.producers)
        backlog_bytes = sum(p.stat().st_size for p in spool.iterdir())
        print(
            f"backlog: {total:,} records ({EVENT_SHARE:.0%} events), {args.producers} producers,"
            f" {backlog_bytes / 1e6:.0f} MB, written in {time.perf_counter() - started:.1f} s"
        )

        # Baseline: decode + validate every record, no journal (kvspool's reader).
        gc.collect()
        started = time.perf_counter()
        contents = kvspool.read_spool(spool)
        baseline_s = time.perf_counter() - started
        assert len(contents.records) == total and not contents.errors
        del contents
        gc.collect()
        baseline_rate = total / baseline_s

        config = Config(
            spool_dir=str(spool),
            journal=str(disk / "journal.db"),
            nvml=False,
            idle_grace=0.0,
            listen="127.0.0.1:0",
        )
        daemon = Daemon(config)
        rss_before = rss_mb()
        peak = [rss_before]
        samples: list[float] = []
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.25):
                value = rss_mb()
                samples.append(value)
                peak[0] = max(peak[0], value)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.perf_counter()
        cpu_started = time.process_time()
        while daemon.run_once():
            pass
        daemon.run_once()  # the last poll: finish, remove, retire
        catchup_s = time.perf_counter() - started
        cpu_s = time.process_time() - cpu_started
        done.set()
        sampler.join()
        committed = int(daemon.state.daemon[("spool_records", ())])
        assert committed == total, (committed, total)
        assert not list(spool.glob("*.kvs")), "segments left behind"
        gc.collect()
        rss_after = rss_mb()
        rate = total / catchup_s
        print(
            f"catch-up: {rate:,.0f} records/s wall, {total / cpu_s:,.0f} records/s per CPU-second"
            f" ({catchup_s:.1f} s; target >= 100,000/s on one core)"
        )
        print(
            f"  baseline kvspool.read_spool (decode + validate, no journal): {baseline_rate:,.0f}"
            f" records/s; daemon/baseline = {rate / baseline_rate:.2f}"
        )
        quarter = samples[len(samples) // 4 :] or [peak[0]]
        print(
            f"memory: RSS {rss_before:.0f} MB before, peak {peak[0]:.0f} MB during,"
            f" {rss_after:.0f} MB after (target < 150 MB, flat);"
            f" last 3/4 of the run {min(quarter):.0f}..{max(quarter):.0f} MB"
        )
        journal_mb = sum(p.stat().st_size for p in disk.iterdir()) / 1e6
        print(f"journal: {journal_mb:.0f} MB for {total:,} records")

        # One scrape at the default series count, against prometheus_client by itself.
        ours = CollectorRegistry(auto_describe=False)
        ours.register(KvwatchCollector(daemon.state, daemon.nvml))
        text = generate_latest(ours)
        series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
        plain = CollectorRegistry(auto_describe=False)
        plain.register(Frozen(list(KvwatchCollector(daemon.state, daemon.nvml).collect())))
        runs = 200
        ours_s = best_of(runs, lambda: generate_latest(ours))
        plain_s = best_of(runs, lambda: generate_latest(plain))
        print(
            f"scrape: {series} series, {len(text) / 1e3:.0f} kB: {ours_s * 1e3:.2f} ms"
            f" (best of {runs}); prometheus_client rendering the same families by itself"
            f" {plain_s * 1e3:.2f} ms; ratio {ours_s / plain_s:.2f}"
        )
        daemon.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    main()
