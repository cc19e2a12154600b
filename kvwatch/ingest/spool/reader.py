"""The spool reader: tails every segment in the spool directory into the journal.

Each poll lists the directory, reads every segment of every producer in index order from its
committed position, checks each frame (framing, CRC, size) and each record (schema version,
fields, producer, sequence number), and commits accepted records, rejects and the new read
positions in one journal transaction per batch. A segment is *finished* when every byte of it is
accounted for and no more can come: it ends in a ``seal`` record, or a later segment of the same
producer exists, or no producer holds its ``flock`` and it has been idle for ``idle_grace``
seconds. A finished segment is removed (or, if it had rejects, moved to the quarantine
directory); a producer none of whose segments is left is retired (its gauges go, its counters
stay in the totals).

A record that passes the gate but cannot be stored costs that record alone (``poison``).

The reader's jobs, one module each, stacked into :class:`SpoolReader` (each class stands on
the one before and shares its state under the state's lock): ``sink`` (the batch, the daemon's
counters, the commit that hands stored findings on), ``directory`` (listing, safe opening,
ignored and quarantined segments, removal and retirement), ``apply`` (records into the state,
events into findings and their counts), ``poison`` (one record per transaction, the dead
letter), ``frames`` (the checks of every frame and record: the hot loop, one function on
purpose, docs/performance.md) and this module, the poll loop.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from kvwatch.ingest.spool.directory import SEGMENT_NAME
from kvwatch.ingest.spool.directory import locked as _locked
from kvwatch.ingest.spool.frames import CLOCK_FUTURE_SECONDS, CLOCK_PAST_SECONDS, FrameReader
from kvwatch.ingest.spool.owner import OwnerRule
from kvwatch.ingest.spool.poison import PoisonError, RestartError, environmental
from kvwatch.ingest.spool.sink import LOGGED_REJECTS
from kvwatch.store.journal import Journal, Stored
from kvwatch.store.state import Segment, State


@dataclass(frozen=True, slots=True)
class PollResult:
    records: int
    rejected: int
    lost: int
    #: True when the poll stopped at its record budget with more to read.
    more: bool


class SpoolReader(FrameReader):
    """The poll loop (see the module); its jobs are the classes it stands on."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        journal: Journal,
        state: State,
        *,
        allowed_uids: Collection[int] | None = None,
        idle_grace: float = 5.0,
        # Small reads and transactions keep the memory a backlog takes small: what a catch-up
        # allocates, the allocators keep (1 MiB reads or 16,384-record transactions let the
        # daemon's resident memory ratchet up by megabytes: docs/performance.md).
        # On a slow or loaded machine, batch_seconds bounds how long read records wait to
        # become durable.
        batch_records: int = 4096,
        batch_seconds: float = 0.1,
        poll_records: int = 32768,
        chunk_bytes: int = 256 << 10,
        quarantine_dir: str | os.PathLike[str] | None = None,
        quarantine_max: int = 32,
        node: str | None = None,
        on_stored: Callable[[Stored], None] | None = None,
    ) -> None:
        super().__init__(journal, state, on_stored)
        self.directory = Path(directory)
        #: The node every incident row names: the daemon's ``node`` setting, else the host
        #: name; the same name Prometheus's target label and the pages carry (not the engine's
        #: hello, which names its own host).
        self.node = node or socket.gethostname()
        self.allowed_uids = frozenset(allowed_uids if allowed_uids else {os.geteuid()})
        self.owner_rule = OwnerRule(self.directory, self.allowed_uids)
        self.idle_grace = idle_grace
        self.batch_records = batch_records
        self.batch_seconds = batch_seconds
        self.poll_records = poll_records
        self.chunk_bytes = chunk_bytes
        self.quarantine_dir = Path(quarantine_dir) if quarantine_dir else None
        self.quarantine_max = quarantine_max
        self._init_applier()
        self.clock_past = CLOCK_PAST_SECONDS
        self.clock_future = CLOCK_FUTURE_SECONDS

    # -- the poll -----------------------------------------------------------------------------

    def poll(self) -> PollResult:
        """Read what is new in the spool and commit it. Raises only on a journal failure."""
        gc_was_on = gc.isenabled()
        gc.disable()  # a poll allocates many short-lived objects and no cycles
        try:
            try:
                return self._poll()
            except PoisonError:
                self.log.warning("spool.poison_isolation", note="one record per transaction")
            self._careful = True
            try:
                while True:
                    with contextlib.suppress(RestartError):
                        return self._poll()
            finally:
                self._careful = False
        finally:
            if gc_was_on:
                gc.enable()

    def _poll(self) -> PollResult:
        self._budget = self.poll_records
        self._polled = Counter()
        self._to_remove = []
        groups, sizes = self._list()
        with self.state.lock:  # an ignored segment counts while it is in the spool
            self.state.ignored = {n: i for n, i in self.state.ignored.items() if n in sizes}
        more = False
        live: set[str] = set()
        try:
            for producer in sorted(groups):
                segments = sorted(groups[producer])
                for position, (_index, name) in enumerate(segments):
                    later = position < len(segments) - 1
                    with self.state.lock:
                        finished = self._read_segment(name, producer, _index, later)
                    if not finished:
                        live.add(producer)
                        break
                    if self._budget <= 0:
                        more = True
                        break
                if self._budget <= 0:
                    more = True
                    live.update(groups)  # not all visited: do not retire anyone this time
                    break
            with self.state.lock:
                self._commit()
                self._remove_finished()
                if not more:
                    present = {n for g in groups.values() for _, n in g}
                    present -= {s.name for s in self._to_remove if s.removed}
                    producers = {SEGMENT_NAME.match(n).group(1) for n in present}  # type: ignore[union-attr]
                    self._retire(producers, present)
                self._commit()
                self.state.lag_bytes = self._lag(sizes)  # before a removed name is forgotten
                self._forget_removed()
                self.state.live_producers = len(live)
        except RestartError:
            raise
        except BaseException as exc:
            self._reload()
            if environmental(exc) or isinstance(exc, PoisonError):
                raise
            raise PoisonError from exc
        if self._polled["rejected"] > LOGGED_REJECTS:
            self.log.warning(
                "spool.rejects_not_logged",
                count=self._polled["rejected"] - LOGGED_REJECTS,
                note="kvwatch_spool_rejected_total and the journal's rejects table hold them all",
            )
        return PollResult(
            self._polled["records"], self._polled["rejected"], self._polled["lost"], more
        )

    def _read_segment(self, name: str, producer: str, index: int, later: bool) -> bool:
        """Read what is new in one segment; True when it is finished (or to be skipped)."""
        state = self.state
        segment = state.segments.get(name)
        if segment is not None and segment.finished:
            if not segment.removed:
                self._to_remove.append(segment)
            return True
        fd = self._open(name)
        if isinstance(fd, bool):
            return fd
        try:
            info = os.fstat(fd)
            if not self._trusted(name, fd, info):
                return True
            if state.ignored.pop(name, None) is not None:
                self._flagged.discard(name)  # its owner is trusted now (joined the group)
            if segment is None:
                segment = Segment(name, state.next_segment_id, producer, index)
                state.next_segment_id += 1
                state.segments[name] = segment
                self._batch.segments[name] = segment
            size = info.st_size
            if not self._read_until(fd, segment, size, final=False):
                return False  # stopped at the budget
            done = segment.sealed or later
            if not done and not _locked(fd):
                # Look again now that the lock is free: the writer may have appended (and then
                # closed) since the fstat above, which a long read can leave seconds behind.
                # Finishing at the old size lost every record written since.
                info = os.fstat(fd)
                if info.st_size != size:
                    return False  # read the rest first, next poll
                done = time.time() - info.st_mtime >= self.idle_grace
            if not done:
                return False
            # No more bytes will come: an incomplete frame is torn, and what follows a damaged
            # length that points past the end is read.
            if not self._read_until(fd, segment, size, final=True):
                return False
            segment.finished = True
            self._batch.segments[name] = segment
            self._to_remove.append(segment)
            return True
        finally:
            os.close(fd)
