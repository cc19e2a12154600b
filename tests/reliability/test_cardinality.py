"""Case 5: cardinality. A producer writes fresh values into every string field it controls
(events: detector, kind, mode, action, request_id, detail keys; counters: every label of every
counter; hellos: engine, engine_version, role, model, rank, each rejected after the first, as
a producer is one process; the writer refuses to write them, so they go in raw, as a broken or
hostile hook's would). The series on /metrics stay
within the fixed label sets (unknown values become "other", models/versions/ranks keep their
first N) and the daemon's resident memory grows by less than 10%.

CI writes 100,000 records of fresh values after a 20,000-record warm-up; the issue's million is
``KVWATCH_CARDINALITY_RECORDS=1000000``.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from kvspool import catalogue, encode_frame, encode_payload, schema
from tests.kvwatch.writer import spool_module
from tests.reliability.tools import DaemonProcess, metric, rss_kib, series, wait_for

RECORDS = int(os.environ.get("KVWATCH_CARDINALITY_RECORDS", "100000"))
WARMUP = 20_000
FIXED = {
    label.name: set(label.values)
    for label in (
        catalogue.ENGINE,
        catalogue.ROLE,
        catalogue.DETECTOR,
        catalogue.KIND,
        catalogue.QUEUE,
        catalogue.HOOK,
    )
} | {
    "reason": {
        *catalogue.SKIP_REASON.values,
        *catalogue.DROP_REASON.values,
        *catalogue.REJECT_REASON.values,
        *catalogue.IGNORED_REASON.values,
        *catalogue.LOG_ERROR_REASON.values,
    }
}


def fresh_records(writer: Any, start: int, count: int, *, distinct: bool) -> None:
    for i in range(start, start + count):
        v = f"v{i}" if distinct else "x"
        if i % 10 == 0:
            # Into the writer's open segment, with the number its next record takes (a hello
            # mid-segment takes none): rejected, and nothing lost.
            hello = {"v": 1, "type": "hello", "producer": writer.producer,
                     "engine": f"e-{v}", "engine_version": f"1.{v}", "role": f"r-{v}",
                     "model": f"m-{v}", "rank": i if distinct else 0, "pid": i, "node": f"h-{v}",
                     "seq": writer.seq + 1, "ts": time.time()}  # fmt: skip
            if writer._fd is None:  # its first segment opens with its first record
                writer.write("gauges", {"gauges": [["kv_pool_tokens", {}, 0.0]]})
            with writer._lock:
                os.write(writer._fd, encode_frame(encode_payload(hello)))
        elif i % 10 == 1:
            writer.write(
                "counters",
                {"counters": [
                    [name, {label: f"{label}-{v}" for label in labels}, i]
                    for name, labels in schema.COUNTER_LABELS.items()
                ]},
            )  # fmt: skip
        else:
            writer.write(
                "event",
                {"detector": f"d-{v}", "kind": f"k-{v}", "mode": f"mo-{v}", "action": f"a-{v}",
                 "request_id": f"req-{v}", "pages": [i % 1000], "pages_total": 1,
                 "detail": {f"key-{v}": f"val-{v}"}},
            )  # fmt: skip


def label_values(text: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for name, value in re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', text):
        out.setdefault(name, set()).add(value)
    return out


def test_distinct_values_keep_series_and_memory_bounded(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, "--no-nvml", "--idle-grace", "0.3s")
    try:
        daemon.wait_started()
        writer = spool_module().SpoolWriter(
            daemon.spool, engine="sglang", role="decode", max_segments=100_000
        )

        def caught_up() -> bool:
            # Committed or counted as lost: a loss must fail the test below, not hang it.
            text = daemon.scrape()
            committed = metric(text, "kvwatch_spool_records_total") or 0.0
            return (
                committed + (metric(text, "kvwatch_spool_lost_records_total") or 0.0) == writer.seq
            )

        # Warm-up: the same mix with fixed values, so caches and the journal reach steady state;
        # then as many distinct values as models/versions/ranks keep, to fill those label sets.
        fresh_records(writer, 0, WARMUP, distinct=False)
        fresh_records(writer, WARMUP, 1000, distinct=True)
        assert wait_for(caught_up, 120, 0.2)
        before = daemon.scrape()
        rss_before = rss_kib(daemon.proc.pid)
        fresh_records(writer, WARMUP + 1000, RECORDS, distinct=True)
        assert wait_for(caught_up, max(120, RECORDS / 2000), 0.2), (writer.seq, writer.dropped)
        after = daemon.scrape()
        rss_after = rss_kib(daemon.proc.pid)
        writer.close()
    finally:
        daemon.kill9()
    print(
        f"records={RECORDS} series before={series(before)} after={series(after)}"
        f" rss_kib before={rss_before} after={rss_after}"
    )
    assert writer.dropped.total() == 0
    # A producer is one process: its later hellos, with fresh labels, are rejected and never
    # applied (test_metrics' 500 producers hold the labels a hello sets to their caps). Each is
    # counted once, as rejected; nothing is lost.
    hellos = (WARMUP + 1000 + RECORDS) // 10
    assert metric(after, "kvwatch_spool_rejected_total", reason="hello") == hellos
    assert metric(after, "kvwatch_spool_lost_records_total") == 0
    assert series(after) == series(before)  # saturated: 100,000 more values add no series
    values = label_values(after)
    for label, allowed in FIXED.items():
        assert values.get(label, set()) <= allowed | {schema.OTHER}, (label, values.get(label))
    assert len(values.get("model", ())) <= 17
    assert rss_after < rss_before * 1.10, (rss_before, rss_after)
