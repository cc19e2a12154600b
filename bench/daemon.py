"""Benchmark the kvwatch daemon: spool catch-up rate, memory, and the cost of one scrape.

    .venv/bin/python bench/daemon.py [--records 1000000] [--producers 8] [--rounds 2]

One run, figures and ratios against baselines measured in the same run:

- catch-up: the daemon's own poll loop (``Daemon.run_once``: read, check, commit to the SQLite
  journal, remove finished segments) on a backlog of spool records from several producers, in
  records/s of wall time and of CPU time (the daemon is single-threaded: CPU time is what one
  core would take on a quiet machine); baseline: decode only, every frame of the same backlog
  through ``kvspool.decode_payload`` into typed records, no journal (the floor any reader
  pays). Baseline and daemon runs alternate, ``--rounds`` times each, on hard-linked copies of
  one backlog; the best round of each is reported. Target: at least 150,000 records/s on one
  core.
- memory: the daemon process's resident set during and after the catch-up. Target: under 150 MB
  and flat.
- scrape: the time to render /metrics at the default series count, as a ratio to
  prometheus_client rendering the same families from a plain registry by itself.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import structlog
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

import kvspool
from bench._timing import best_seconds
from kvspool import catalogue
from kvwatch.config import Config
from kvwatch.daemon import Daemon
from kvwatch.expose.metrics import KvwatchCollector
from kvwatch.store.incidents_log import rotated

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
        # Recent, as a live backlog is: inside the daemon's clock window.
        base_ts = time.time() - 3600

        def frame(
            kind: str, fields: dict[str, Any], name: str = name, base_ts: float = base_ts
        ) -> bytes:
            nonlocal seq
            seq += 1
            record = {"v": 1, "type": kind, "producer": name, **fields}
            record["seq"], record["ts"] = seq, base_ts + seq / 1000
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


def decode_only(spool: Path) -> int:
    """The floor: every frame of every segment framed, checked and decoded, nothing stored."""
    count = 0
    for path in sorted(spool.glob("*.kvs")):
        for frame in kvspool.iter_frames(path.read_bytes(), final=True):
            assert frame.payload is not None
            kvspool.decode_payload(frame.payload)
            count += 1
    return count


def link_copy(source: Path, target: Path) -> None:
    target.mkdir()
    for path in source.iterdir():
        os.link(path, target / path.name)


def catch_up(
    spool: Path, journal: Path, total: int, incidents_log: str | None = None
) -> tuple[float, float, Daemon, list[float]]:
    """(wall s, CPU s, the daemon, RSS samples) for one catch-up of ``spool``. The incidents log
    is on, as by default (one per journal unless ``incidents_log`` names it, or is "off"), with
    room for every line."""
    config = Config(
        spool_dir=str(spool), journal=str(journal), nvml=False, idle_grace=0.0,
        listen="127.0.0.1:0",
        incidents_log=incidents_log or str(journal.with_suffix(".jsonl")),
        incidents_log_max_bytes=1 << 40,
    )  # fmt: skip
    daemon = Daemon(config)
    samples: list[float] = [rss_mb()]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.25):
            samples.append(rss_mb())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    gc.collect()
    started = time.perf_counter()
    cpu_started = time.process_time()
    while daemon.run_once():
        pass
    daemon.run_once()  # the last poll: finish, remove, retire
    # The incidents log drains a bounded number of batches a round: what it still owes is
    # part of the catch-up.
    log = daemon.incidents_log
    while log and log.drain(daemon.journal):
        pass
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    done.set()
    sampler.join()
    committed = int(daemon.state.daemon[(catalogue.DaemonCounter.SPOOL_RECORDS, ())])
    assert committed == total, (committed, total)
    assert not list(spool.glob("*.kvs")), "segments left behind"
    if log:  # every incident in the log, once
        incidents = daemon.journal.finding_count()
        lines = sum(1 for path in rotated(log.path) for _ in path.open("rb"))
        assert lines == incidents, (lines, incidents)
    return wall, cpu, daemon, samples


def scrape(daemon: Daemon) -> None:
    """One scrape at the default series count, against prometheus_client by itself."""
    ours = CollectorRegistry(auto_describe=False)
    ours.register(KvwatchCollector(daemon.state, daemon.nvml))
    text = generate_latest(ours)
    series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
    plain = CollectorRegistry(auto_describe=False)
    plain.register(Frozen(list(KvwatchCollector(daemon.state, daemon.nvml).collect())))
    runs_ = 200
    ours_s = best_seconds(lambda: generate_latest(ours), runs_)
    plain_s = best_seconds(lambda: generate_latest(plain), runs_)
    print(
        f"scrape: {series} series, {len(text) / 1e3:.0f} kB: {ours_s * 1e3:.2f} ms"
        f" (best of {runs_}); prometheus_client rendering the same families by itself"
        f" {plain_s * 1e3:.2f} ms; ratio {ours_s / plain_s:.2f}"
    )


def bench_args(description: str, *, records: int, rounds: int) -> argparse.Namespace:
    """The catch-up benches' flags; the daemon's log quietened (it logs a line per committed
    batch of incidents: not what is measured)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, description=description)
    parser.add_argument("--records", type=int, default=records)
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=rounds)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    return args


@contextlib.contextmanager
def workspace() -> Iterator[tuple[Path, Path]]:
    """Folders for the spool (on tmpfs where there is one) and the journal (on disk)."""
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    work = Path(tempfile.mkdtemp(prefix="kvwatch-bench-", dir=shm))
    disk = Path(tempfile.mkdtemp(prefix="kvwatch-bench-journal-"))
    try:
        yield work, disk
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def main() -> None:
    args = bench_args(__doc__.splitlines()[0], records=1_000_000, rounds=2)
    with workspace() as (work, disk):
        source = work / "backlog"
        source.mkdir()
        started = time.perf_counter()
        total = write_backlog(source, args.records, args.producers)
        backlog_bytes = sum(p.stat().st_size for p in source.iterdir())
        print(
            f"backlog: {total:,} records ({EVENT_SHARE:.0%} events), {args.producers} producers,"
            f" {backlog_bytes / 1e6:.0f} MB, written in {time.perf_counter() - started:.1f} s;"
            f" load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
        )
        base_wall: list[float] = []
        base_cpu: list[float] = []
        runs: list[tuple[float, float]] = []
        daemon: Daemon | None = None
        samples: list[float] = []
        rss_before = rss_mb()
        for round_ in range(args.rounds):
            gc.collect()
            started, cpu_started = time.perf_counter(), time.process_time()
            assert decode_only(source) == total
            base_wall.append(time.perf_counter() - started)
            base_cpu.append(time.process_time() - cpu_started)
            spool = work / f"spool-{round_}"
            link_copy(source, spool)
            if daemon is not None:
                daemon.close()
            wall, cpu, daemon, samples = catch_up(spool, disk / f"journal-{round_}.db", total)
            runs.append((wall, cpu))
        assert daemon is not None
        gc.collect()
        rss_after = rss_mb()
        wall = min(w for w, _ in runs)
        cpu = min(c for _, c in runs)
        print(
            f"catch-up: {total / cpu:,.0f} records/s per CPU-second (one core to itself),"
            f" {total / wall:,.0f} records/s wall; best of {args.rounds}"
            f" (target >= 150,000/s on one core)"
        )
        print(
            f"  baseline, decode only (kvspool.iter_frames + decode_payload, no journal):"
            f" {total / min(base_cpu):,.0f} records/s per CPU-second,"
            f" {total / min(base_wall):,.0f} wall;"
            f" daemon/baseline = {min(base_cpu) / cpu:.2f} (CPU)"
        )
        quarter = samples[len(samples) // 4 :] or samples
        print(
            f"memory: RSS {rss_before:.0f} MB before, peak {max(samples):.0f} MB during the last"
            f" round, {rss_after:.0f} MB after (target < 150 MB, flat);"
            f" last 3/4 of the round {min(quarter):.0f}..{max(quarter):.0f} MB"
        )
        journal_mb = (disk / f"journal-{args.rounds - 1}.db").stat().st_size / 1e6
        print(f"journal: {journal_mb:.0f} MB for {total:,} records")

        scrape(daemon)
        daemon.close()


if __name__ == "__main__":
    main()
