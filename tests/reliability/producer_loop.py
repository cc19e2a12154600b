"""An engine-like producer for the reliability suite: the real SpoolWriter in its own process.

Usage: python -m tests.reliability.producer_loop SPOOL ROLE DETAIL_BYTES [RATE [SECONDS [SEGMENT]]]

Writes events with a ``DETAIL_BYTES`` pad (large pads make each ``write()`` copy many pages, so
a SIGKILL can land inside one: the torn tail), and every tenth record a counters snapshot and a
gauges record, at ``RATE`` records/s (0: as fast as it can) for ``SECONDS`` (0: until
killed), in segments of ``SEGMENT`` bytes.
Prints the producer id on its first line and, when it stops by itself, a JSON line with its
last sequence number and drops.
"""

from __future__ import annotations

import json
import sys
import time

from kvspool.records import MAX_STRING_CHARS
from tests.kvwatch.writer import spool_module
from tests.reliability.tools import event_fields


def main() -> None:
    directory, role, detail_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rate = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    seconds = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    segment = int(sys.argv[6]) if len(sys.argv) > 6 else 4 << 20
    writer = spool_module().SpoolWriter(
        directory, engine="sglang", role=role, segment_bytes=segment, max_segments=100_000
    )
    print(writer.producer, flush=True)
    # The pad in detail values of at most MAX_STRING_CHARS each (the schema's bound).
    width = MAX_STRING_CHARS - 16
    pad = {f"pad{n}": "x" * width for n in range(detail_bytes // width)}
    start = time.monotonic()
    interval = 1.0 / rate if rate else 0.0
    i = 0
    while not seconds or time.monotonic() - start < seconds:
        if i % 10 == 8:
            writer.write("counters", {"counters": [["verifications", {"detector": "canary"}, i]]})
        elif i % 10 == 9:
            writer.write("gauges", {"gauges": [["kv_pool_tokens", {}, 4096.0]]})
        else:
            fields = event_fields(i)
            if pad:
                fields["detail"] = {"unwritten": 1, **pad}
            writer.write("event", fields)
        i += 1
        if interval:
            pause = start + i * interval - time.monotonic()
            if pause > 0:
                time.sleep(pause)
    writer.close()
    print(json.dumps({"producer": writer.producer, "seq": writer.seq, "dropped": writer.dropped}))


if __name__ == "__main__":
    main()
