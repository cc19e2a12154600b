"""Prefill's side of a lease that expired: a sent request's blocks freed before its remote read.

Can kvwatch see whether the remote read was confirmed? Not through vLLM's connector API
(0.32 and 0.33): ``KVConnectorOutput.finished_sending``, which ``MultiConnector`` hands to every
child's ``update_connector_output``, lists a producer request both when its decode confirmed
the read (NIXL's notification) and when NIXL's lease (``kv_lease_duration``) ran out unread
(``_reap_expired_send_leases`` adds it to the same set, and the scheduler frees the blocks
either way); ``KVConnectorStats`` counts expiries (``num_kv_expired_reqs``) without naming the
request. The one per-request signal is NIXL's own warning, logged by its worker in this
process, in the same step's ``get_finished``: "Releasing expired KV blocks for request %s
which were retrieved by %d remote worker(s) before lease expired." kvwatch reads that record
(:class:`_ExpiryHandler`, on vLLM's logger, matching the message template only) to learn which
request's lease expired; a request whose read was confirmed never logs it, so clean traffic,
slow reads inside the lease and reads a heartbeat kept alive included, gives no finding.

Which requests took the blocks, and when, LeaseWatch keeps itself (:class:`~engine_hooks.takers.
Takers`): from the expiry until the finding is written, every request whose forward writes into
the expired request's blocks (:meth:`LeaseWatch.step` is given each step's writes) is a taker,
with the blocks it wrote and when it first did; decode may have read any of them. The finding
is written once per expired request, ``window_s`` after the expiry (at the first step after
that, its own writes included, or at shutdown): ``page_tag`` ``freed_before_read`` on the
expired request and
its prefill instance, with the blocks it sent and, as sources, the takers (blocks, ``written_at``
the first write). Which of them decode really read rests on times: decode's finding (which
carries this request id and instance as its peer) says when it read, and ``kvwatch incidents
--exposed`` over both nodes' journals names the takers that wrote before that. An expiry whose
blocks nobody took in the window is no finding (nothing foreign to read; vLLM counts it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from engine_hooks import KVWatch, Verdict
from engine_hooks.labels import Hook
from engine_hooks.takers import DEFAULT_FREED_WATCH_S, Takers
from engine_hooks.vllm.guard import safe

#: NIXL's expiry warning (``nixl/base_worker.py``), as its format string: the record's
#: ``args`` are (request id, remote reads).
EXPIRY_MESSAGE: Final = "Releasing expired KV blocks for request %s"
#: Sent requests remembered until their sending finishes (oldest forgotten first).
MAX_SENT: Final = 8192


@dataclass(slots=True)
class _Sent:
    instance: str
    blocks: list[int]


@dataclass(slots=True)
class _Expired:
    sent: _Sent
    remote_reads: int
    #: Every request that wrote into the sent blocks since the expiry.
    takers: Takers


#: One step's writes: (request id, instance, blocks).
Writes = Sequence[tuple[str, str, Sequence[int]]]


class LeaseWatch:
    """The sent requests of one prefill worker, the expiries NIXL logs, the findings."""

    def __init__(self, watch: KVWatch, window_s: float = DEFAULT_FREED_WATCH_S) -> None:
        self.watch = watch
        self.window_s = window_s
        self.sent: OrderedDict[str, _Sent] = OrderedDict()
        self.watching: dict[str, _Expired] = {}
        self._logged: list[tuple[str, int, float]] = []
        self._lock = threading.Lock()  # a log record may come from another thread
        self._handler: _ExpiryHandler | None = None
        self._logger = logging.getLogger("vllm")

    def attach(self, logger: logging.Logger | None = None) -> None:
        """Listen for NIXL's expiry warning (on vLLM's logger: every module's records reach it)."""
        if self._handler is None:
            self._logger = logger or self._logger
            self._handler = _ExpiryHandler(self)
            self._logger.addHandler(self._handler)

    def sealed(self, request_id: str, instance: str, blocks: list[int]) -> None:
        """Prefill sealed (and so sends) ``blocks`` for the request instance."""
        self.sent[request_id] = _Sent(instance, list(blocks))
        self.sent.move_to_end(request_id)
        while len(self.sent) > MAX_SENT:
            self.sent.popitem(last=False)

    def expired(self, request_id: str, remote_reads: int, at: float) -> None:
        with self._lock:
            self._logged.append((request_id, remote_reads, at))

    def done(self, request_ids: list[str]) -> None:
        """Their sending finished (read, or expired: an expiry was taken by :meth:`step`)."""
        for rid in request_ids:
            self.sent.pop(rid, None)

    def step(self, now: float | None = None, writes: Writes = ()) -> list[Verdict]:
        """Take the expiries logged since the last step, then this step's ``writes`` (their
        takers: NIXL logs an expiry in the step before vLLM frees its blocks, so no write into
        them comes earlier); report the windows that closed."""
        now = time.time() if now is None else now
        with self._lock:
            logged, self._logged = self._logged, []
        for rid, reads, at in logged:
            sent = self.sent.pop(rid, None)
            if sent is not None:
                takers = Takers(rid, sent.instance, sent.blocks, at)
                self.watching[rid] = _Expired(sent, reads, takers)
        for entry in self.watching.values():
            for rid, instance, blocks in writes:
                entry.takers.took(rid, instance, blocks, now)
        closed = [e for e in self.watching.values() if now - e.takers.since >= self.window_s]
        return self._report(closed)

    def close(self) -> list[Verdict]:
        if self._handler is not None:
            self._logger.removeHandler(self._handler)
            self._handler = None
        return self._report(list(self.watching.values()))

    def _report(self, closed: list[_Expired]) -> list[Verdict]:
        out = []
        for entry in closed:
            self.watching.pop(entry.takers.request_id, None)
            detail: dict[str, int | str] = {
                "expired_at_ms": int(entry.takers.since * 1000),
                "remote_reads": entry.remote_reads,
            }
            verdict = self.watch.freed_before_read(
                entry.takers.request_id,
                entry.sent.instance,
                entry.sent.blocks,
                detail,
                entry.takers.sources(),
            )
            if verdict is not None:
                out.append(verdict)
        return out


class _ExpiryHandler(logging.Handler):
    """Hands NIXL's expiry warning to :meth:`LeaseWatch.expired`; every other record passes."""

    def __init__(self, lease: LeaseWatch) -> None:
        super().__init__(logging.WARNING)
        self.lease = lease
        self.watch = lease.watch  # what counts a failure of emit (the guard's report)

    # Never into vLLM's logging: a failure is a hook failure, counted under the expiry's hook
    # (NIXL frees the request's blocks).
    @safe(Hook.FREE)
    def emit(self, record: logging.LogRecord) -> None:
        if not (isinstance(record.msg, str) and record.msg.startswith(EXPIRY_MESSAGE)):
            return
        args = record.args if isinstance(record.args, tuple) else ()
        if args:
            reads = int(str(args[1])) if len(args) > 1 else 0
            self.lease.expired(str(args[0]), reads, record.created)
