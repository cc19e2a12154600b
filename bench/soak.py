"""Long reliability runs for docs/reliability.md (the bounded versions are tests/reliability/).

    .venv/bin/python bench/soak.py soak [--minutes 30] [--rate 4000] [--producers 16]
    .venv/bin/python bench/soak.py latency [--seconds 60] [--rate 5000] [--pace busy|sleep]

``soak``: the real daemon and N real producer processes (engine_hooks' SpoolWriter) at a fixed
total record rate; reports records written and committed, lost and dropped, the daemon's
resident memory after the warm-up and at the end, its maximum lag (bytes unread, and the age of
the newest committed record) and the time to catch up at the end.

The default rate, 4,000 records/s, is ten times a busy node in a leak storm, rounded up: a node of
8 GPUs runs up to 16 engine processes (prefill and decode), each writing a counters and a gauges
record per second (32/s), and in a storm one event per request, detector and kind: about 100
requests/s across the node times up to 3 detectors (300/s). 332/s, times ten, is about 3,300/s.
In normal running (no mismatches) the node writes only the 32/s.

``latency``: spool append latency in an engine-like process (p50/p99/p99.9/max of each
``SpoolWriter.write``), paced at ``--rate`` for ``--seconds`` in each of three conditions: the
daemon running, the daemon stopped with SIGSTOP for the whole condition, the daemon killed. The
spool is on tmpfs, as deployed; between appends the thread works (``--pace busy``, like an
engine's scheduler thread) or sleeps (``--pace sleep``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.reliability.soak import soak
from tests.reliability.tools import latency_under_daemon_conditions


def latency(
    seconds: float, rate: float, pace: str, directory: str | None
) -> dict[str, dict[str, object]]:
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        results = latency_under_daemon_conditions(Path(tmp), int(seconds * rate), rate, pace)
    # Each figure against the bare system call measured in the same run (noisy, shared machines).
    base = results["baseline_raw_write"]
    for name, r in results.items():
        if name != "baseline_raw_write":
            for q in ("p50_us", "p99_us", "p999_us", "max_us"):
                r[q.replace("_us", "_vs_raw_write")] = round(float(r[q]) / float(base[q]), 2)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("soak", allow_abbrev=False)
    s.add_argument("--minutes", type=float, default=30.0)
    s.add_argument("--rate", type=float, default=4000.0, help="records/s, all producers")
    s.add_argument("--producers", type=int, default=16)
    s.add_argument("--warmup", type=float, default=60.0, help="seconds before RSS start")
    s.add_argument("--samples", type=Path, help="write the per-second samples here (JSON lines)")
    lat = sub.add_parser("latency", allow_abbrev=False)
    lat.add_argument("--seconds", type=float, default=60.0, help="per condition")
    lat.add_argument("--rate", type=float, default=5000.0, help="appends/s")
    lat.add_argument(
        "--pace",
        choices=("busy", "sleep"),
        default="busy",
        help="between appends: work, as an engine thread does (busy), or sleep",
    )
    lat.add_argument(
        "--dir",
        default="/dev/shm" if Path("/dev/shm").is_dir() else None,
        help="where the spool goes (default /dev/shm: the spool lives on tmpfs)",
    )
    args = parser.parse_args()
    if args.command == "soak":
        result = soak(
            args.minutes * 60, args.rate, args.producers, args.warmup, samples_path=args.samples
        )
        print(json.dumps(result, indent=2))
    else:
        print(json.dumps(latency(args.seconds, args.rate, args.pace, args.dir), indent=2))


if __name__ == "__main__":
    main()
