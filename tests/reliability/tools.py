"""Shared helpers for the reliability suite and bench/soak.py: an engine-like producer loop that
times every spool append, a /metrics parser, and the daemon's resident memory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.kvwatch.daemonproc import REPO, DaemonProcess
from tests.kvwatch.writer import spool_module

__all__ = [
    "REPO",
    "DaemonProcess",
    "append_latencies",
    "memory_kib",
    "metric",
    "percentiles",
    "rss_kib",
]

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def event_fields(i: int) -> dict[str, Any]:
    """A detection event like the engine hooks write (no prompt text: ids and counts only)."""
    return {
        "detector": "canary",
        "kind": "unwritten_page",
        "mode": "log",
        "action": "logged",
        "request_id": f"req-{i}",
        "pages": [i % 4096, 7],
        "pages_total": 2,
        "detail": {"unwritten": 1},
    }


class RawAppend:
    """The baseline for the writer's latency: the bare ``os.write`` of a ready-made frame of
    the same size on an ``O_APPEND`` file in the same directory. What the writer adds on top is
    its own cost; what this shows is the machine's (the system call and the VM's noise)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        path = Path(directory) / "baseline.raw"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o600)
        self.frame = b"K" * 300  # about one event record, framed
        self.dropped: dict[str, int] = {}

    def write(self, _kind: str, _fields: dict[str, Any]) -> bool:
        return os.write(self.fd, self.frame) == len(self.frame)


def append_latencies(
    spool: str | os.PathLike[str],
    count: int,
    *,
    rate: float = 0.0,
    pace: str = "busy",
    writer: Any = None,
) -> tuple[list[int], Any]:
    """Append ``count`` records, timing each ``write`` in ns; ``rate`` (records/s) paces them.

    ``pace="busy"`` keeps the thread working between appends, as an engine's scheduler thread
    does between hook calls; ``pace="sleep"`` sleeps instead, so each append also pays for the
    CPU waking up (on a VM, the vCPU halting and being rescheduled).
    """
    if writer is None:
        writer = spool_module().SpoolWriter(
            spool, engine="sglang", role="decode", model="m", max_segments=100_000
        )
    out = [0] * count
    clock = time.perf_counter_ns
    interval = int(1e9 / rate) if rate else 0
    work = list(range(2000))
    next_at = clock()
    for i in range(count):
        fields = event_fields(i)
        t0 = clock()
        writer.write("event", fields)
        out[i] = clock() - t0
        if interval:
            next_at += interval
            if pace == "sleep":
                pause = next_at - clock()
                if pause > 0:
                    time.sleep(pause / 1e9)
            else:
                while clock() < next_at:
                    sum(work)
    return out, writer


def percentiles(samples_ns: list[int]) -> dict[str, float]:
    """p50, p99, p99.9 and max of ``samples_ns``, in microseconds."""
    s = sorted(samples_ns)
    n = len(s)

    def at(q: float) -> float:
        return s[min(n - 1, int(q * n))] / 1000.0

    return {"p50_us": at(0.5), "p99_us": at(0.99), "p999_us": at(0.999), "max_us": s[-1] / 1000.0}


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in a /metrics text, or None when absent."""
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return None


def series(text: str) -> int:
    """Number of samples (series) in a /metrics text."""
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def rss_kib(pid: int) -> int:
    return memory_kib(pid)["VmRSS"]


def memory_kib(pid: int) -> dict[str, int]:
    """Resident memory of ``pid`` in KiB: the total (VmRSS) and its parts: anonymous memory
    (the heap: what a leak grows), mapped files and shared memory (SQLite's WAL index)."""
    out = dict.fromkeys(("VmRSS", "RssAnon", "RssFile", "RssShmem"), 0)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in out:
            out[key] = int(value.split()[0])
    return out


def wait_for(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def run_latency_child(
    spool: Path, count: int, rate: float, pace: str, *, raw: bool = False
) -> dict[str, Any]:
    """Run the timing loop in a fresh engine-like process; returns its percentiles. ``raw``
    times the baseline (:class:`RawAppend`) instead of the SpoolWriter."""
    code = (
        "import json,sys;from tests.reliability.tools import RawAppend,append_latencies,"
        "percentiles;w=RawAppend(sys.argv[1]+'-baseline') if sys.argv[5]=='1' else None;"
        "s,w=append_latencies(sys.argv[1],int(sys.argv[2]),rate=float(sys.argv[3]),"
        "pace=sys.argv[4],writer=w);"
        "print(json.dumps({**percentiles(s),'dropped':dict(w.dropped),'n':len(s)}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(spool), str(count), str(rate), pace, str(int(raw))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return dict(json.loads(out.stdout))


def latency_under_daemon_conditions(
    workdir: Path, count: int, rate: float, pace: str = "busy"
) -> dict[str, dict[str, Any]]:
    """Append latency with the daemon running, stopped by SIGSTOP, and killed (case 1), after
    the baseline: the bare ``os.write`` of a frame (``baseline_raw_write``)."""
    import signal

    daemon = DaemonProcess(workdir, "--no-nvml", "--idle-grace", "0.5s")
    results: dict[str, dict[str, Any]] = {}
    try:
        daemon.wait_started()
        results["baseline_raw_write"] = run_latency_child(daemon.spool, count, rate, pace, raw=True)
        results["running"] = run_latency_child(daemon.spool, count, rate, pace)
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            results["sigstop"] = run_latency_child(daemon.spool, count, rate, pace)
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        daemon.kill9()
        results["killed"] = run_latency_child(daemon.spool, count, rate, pace)
    finally:
        if daemon.proc.poll() is None:
            daemon.kill9()
    return results
