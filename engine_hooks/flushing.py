"""A watch's counters to the spool: cumulative snapshots, from a thread of their own.

A snapshot (every counter, then the gauges) is written at start-up, every flush interval, at
once after a mismatch, and at close (also at interpreter exit). The engine's thread only sets
an event for the "at once": it never waits on a write.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable
from typing import Any

from engine_hooks.detectors import PoolReport, Stats
from engine_hooks.labels import Hook
from engine_hooks.spool import SpoolWriter
from kvspool import schema


class Snapshots:
    """Writes one watch's counter snapshots to its spool (none without a spool)."""

    def __init__(
        self,
        stats: Stats,
        spool: SpoolWriter | None,
        interval: float,
        pool_report: Callable[[], PoolReport | None],
    ) -> None:
        self.stats = stats
        self.spool = spool
        self.pool_report = pool_report
        self._lock = threading.Lock()  # guards the spool snapshot against the flush thread
        self._stop = threading.Event()
        #: Set by a mismatch: the flush thread writes the counters at once, not a flush interval
        #: later (the alert pages on the counter; an engine killed in between would leave an
        #: event that pages nobody).
        self.soon = threading.Event()
        self._thread: threading.Thread | None = None
        if self.spool is not None:
            self.flush()
            self._thread = threading.Thread(
                target=self._loop, args=(interval,), name="kvwatch-flush", daemon=True
            )
            self._thread.start()
            atexit.register(_close_ref, weakref.ref(self))

    def counter_series(self) -> list[list[Any]]:
        series: list[list[Any]] = []
        for (name, values), amount in list(self.stats.values.items()):
            labels = dict(zip(schema.COUNTER_LABELS[name], values, strict=True))
            series.append([name, labels, amount])
        if self.spool is not None:
            for reason, amount in self.spool.dropped.items():
                series.append(["spool_dropped", {"reason": reason}, amount])
        return series

    def write_gauges(self) -> None:
        report = self.pool_report()
        if self.spool is None or report is None:
            return
        self.spool.write(
            schema.GAUGES,
            {
                "gauges": [
                    ["kv_pool_tokens", {}, report.pool_tokens],
                    ["context_length_tokens", {}, report.context_length_tokens],
                    ["page_size_tokens", {}, report.page_size_tokens],
                ]
            },
        )

    def flush(self) -> None:
        """Write a cumulative snapshot of every counter (and the gauges) to the spool."""
        if self.spool is None:
            return
        with self._lock:
            self.spool.write(schema.COUNTERS, {"counters": self.counter_series()})
            self.write_gauges()

    def _loop(self, interval: float) -> None:
        while True:
            self.soon.wait(interval)
            self.soon.clear()
            if self._stop.is_set():
                return
            try:
                self.flush()
            except Exception:  # a snapshot lost now is taken again next interval
                self.stats.add("hook_errors", (str(Hook.FLUSH),))

    def close(self) -> None:
        """Final snapshot, stop the flush thread, close the spool. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.soon.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        self.flush()
        if self.spool is not None:
            self.spool.close()


def _close_ref(ref: weakref.ref[Snapshots]) -> None:
    snapshots = ref()
    if snapshots is not None:
        snapshots.close()
