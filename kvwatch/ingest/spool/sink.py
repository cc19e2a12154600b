"""What the spool reader hands the journal: the batch one transaction writes (records, findings,
rejects, read positions), the daemon's own counters, and the commit that hands each commit's
stored findings on (the daemon wires the incidents log there).

The reader's jobs are classes stacked on this one, each in its module: the spool directory
(``directory``), applying records to the state and building findings (``apply``), poison
isolation (``poison``), frame and record checks (``frames``) and the poll loop (``reader``).
They share this state, declared here, under the state's lock.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import structlog

from kvspool.catalogue import DaemonCounter
from kvwatch.ingest.spool.owner import OwnerRule
from kvwatch.store.journal import Batch, Journal, RejectRow, Stored
from kvwatch.store.state import Segment, State

_MAX_MESSAGE: Final = 200
#: Rejects logged one by one per poll; past that, one summary line (the counter has them all).
LOGGED_REJECTS: Final = 10
# A quoted value in an error message that is not a short identifier came from the record itself:
# it never reaches the journal or the logs (privacy), only its length does.
_QUOTED: Final = re.compile(r"'([^']*)'|\"([^\"]*)\"")
_IDENTIFIER: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")


def redact(message: str) -> str:
    def one(match: re.Match[str]) -> str:
        value = match.group(1) if match.group(1) is not None else match.group(2)
        if _IDENTIFIER.fullmatch(value):
            return match.group(0)
        return f"<{len(value)} chars>"

    return _QUOTED.sub(one, message)[:_MAX_MESSAGE]


class BatchSink:
    """The batch, the counters and the commit; every attribute the reader's jobs share."""

    journal: Journal
    state: State
    node: str
    on_stored: Callable[[Stored], None] | None
    log: Any
    directory: Path
    owner_rule: OwnerRule
    idle_grace: float
    batch_records: int
    batch_seconds: float
    chunk_bytes: int
    _batch: Batch
    _batch_started: float
    _budget: int
    _polled: Counter[str]
    _to_remove: list[Segment]
    _careful: bool
    _flagged: set[str]
    _warned: set[str]

    def __init__(
        self, journal: Journal, state: State, on_stored: Callable[[Stored], None] | None
    ) -> None:
        self.journal = journal
        self.state = state
        #: Handed each commit's stored findings (the daemon wires the incidents log here).
        self.on_stored = on_stored
        self.log = structlog.get_logger("kvwatch.spool")
        self._batch = Batch()
        self._batch_started = time.monotonic()
        self._budget = 0
        self._polled = Counter[str]()
        self._to_remove = []
        self._careful = False
        self._flagged = set()  # files rejected as a whole: counted once per run
        self._warned = set()

    def _reject(
        self, segment: Segment, offset: int, length: int, reason: str, message: str
    ) -> None:
        segment.rejects += 1
        self._batch.segments[segment.name] = segment
        message = redact(message)
        self._batch.rejects.append(
            RejectRow(time.time(), segment.name, offset, length, reason, message)
        )
        self._count(DaemonCounter.SPOOL_REJECTED, (reason,))
        self._polled["rejected"] += 1
        if self._polled["rejected"] > LOGGED_REJECTS:
            return
        self.log.warning(
            "spool.record_rejected",
            segment=segment.name,
            offset=offset,
            length=length,
            reason=reason,
            error=message,
        )

    def _reject_file(self, name: str, reason: str, message: str) -> None:
        if name in self._flagged:
            return
        self._flagged.add(name)
        self._batch.rejects.append(RejectRow(time.time(), name, 0, 0, reason, message))
        self._count(DaemonCounter.SPOOL_REJECTED, (reason,))
        self._polled["rejected"] += 1
        self.log.warning("spool.segment_ignored", segment=name, reason=reason, error=message)

    def _count(self, name: str, labels: tuple[str, ...], amount: int = 1) -> None:
        key = (name, labels)
        self.state.daemon[key] += amount
        self._batch.counters.add(key)

    def _warn_once(self, key: str, event: str, **fields: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.log.warning(event, **fields)

    def _commit(self) -> None:
        batch = self._batch
        if not batch:
            return
        stored = self.journal.commit(batch, self.state)
        self._batch = Batch()
        self._batch_started = time.monotonic()
        if stored is not None and self.on_stored is not None:
            self.on_stored(stored)
        # One line per incident (a newly affected request), as ``kvwatch incidents`` lists it;
        # its later findings join it there and are not logged again.
        first = stored.first if stored is not None else 0
        for at in batch.opened:
            f = batch.findings[at]
            self.log.warning(
                "spool.incident",
                id=first + at if first else None,
                node=f.node,
                role=f.role,
                engine=f.engine,
                request_id=f.request_id,
                instance=f.instance,
                detector=f.detector,
                kind=f.kind,
                pages=f.pages_total,
            )
        if batch.findings:
            self.log.info("spool.findings_recorded", count=len(batch.findings))
