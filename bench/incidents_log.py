"""What the incidents log costs the daemon: catch-up CPU with the log on against the log off.

The backlog is bench/daemon.py's (8 producers, 80% detection events: a leak storm, where the log
writes a line for most records). Rounds alternate off and on over hard-linked copies of one
backlog, in one process; "on" runs until the log holds every incident, so the figure is the
whole cost of writing it. Prints the best CPU seconds of each and their ratio.

    .venv/bin/python bench/incidents_log.py --records 300000 --rounds 3
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from bench.daemon import bench_args, catch_up, link_copy, workspace, write_backlog


def main() -> None:
    args = bench_args(__doc__.splitlines()[0], records=300_000, rounds=3)
    with workspace() as (work, disk):
        source = work / "backlog"
        source.mkdir()
        total = write_backlog(source, args.records, args.producers)
        cpu: dict[str, list[float]] = {"off": [], "on": []}
        run = 0
        for _ in range(args.rounds):
            for mode in ("off", "on"):
                run += 1
                spool = work / f"spool-{run}"
                link_copy(source, spool)
                (disk / f"log-{run}").mkdir()
                log = "off" if mode == "off" else str(disk / f"log-{run}" / "incidents.jsonl")
                _, seconds, daemon, _ = catch_up(spool, disk / f"journal-{run}.db", total, log)
                daemon.close()
                cpu[mode].append(seconds)
                shutil.rmtree(disk / f"log-{run}")
        off, on = min(cpu["off"]), min(cpu["on"])
        print(
            f"{total:,} records (80% events), best of {args.rounds}: log off {off:.2f} CPU s"
            f" ({total / off:,.0f} records/s), log on {on:.2f} CPU s ({total / on:,.0f}"
            f" records/s, every incident written); on/off = {on / off:.2f}"
        )


if __name__ == "__main__":
    main()
