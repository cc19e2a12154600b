"""A producer process for the kill -9 test: the real SpoolWriter, writing a burst of records.

Usage: python -m tests.kvwatch.producer SPOOL ROLE COUNT
Prints one JSON line at the end: the producer id, its last sequence number, events written.
"""

from __future__ import annotations

import json
import sys
import time

from tests.kvwatch.writer import spool_module


def main() -> None:
    directory, role, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    writer = spool_module().SpoolWriter(
        directory,
        engine="sglang",
        role=role,
        model="glm-5.3",
        segment_bytes=256 << 10,
        max_segments=100_000,
    )
    events = 0
    for i in range(count):
        if i % 100 == 99:
            ok = writer.write(
                "counters",
                {"counters": [["verifications", {"detector": "canary"}, i]]},
            )
        else:
            ok = writer.write(
                "event",
                {
                    "detector": "canary",
                    "kind": "unwritten_page",
                    "mode": "log",
                    "action": "logged",
                    "request_id": f"{role}-{i}",
                    "pages": [i % 4096, 7],
                    "pages_total": 2,
                    "detail": {"unwritten": 1},
                },
            )
            events += ok
        if not ok:
            raise SystemExit(f"write failed: {dict(writer.dropped)}")
        if i % 400 == 399:
            time.sleep(0.03)  # a burst, not a single write: spread it over a few seconds
    writer.close()
    print(json.dumps({"producer": writer.producer, "seq": writer.seq, "events": events}))


if __name__ == "__main__":
    main()
