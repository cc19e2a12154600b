"""KVWatch: the detectors wired to an engine's hook points, reporting to the spool.

An engine (or its adapter) calls one method per hook point:

========================  ==========================================  ========================
engine event              call                                        detectors
========================  ==========================================  ========================
start-up                  ``report_pool(pool, context, page_size)``   pool vs context
pages leave free list     ``on_alloc(pages)``                         free canary, page tags
pages return to it        ``on_free(pages)``                          free canary, double free
decode reserves pages     ``ticket = on_reserve(rid, pages)``         reserved canary, tags
prefill sent the KV       ``seal = seal(rid, pages)``                 checksum
prefill wrote decode's    ``dest_pool.mark_written(pages, tags)``     page tags (writer side)
a transfer without tags   ``landed(ticket)``                          page tags (writer side)
  filled reserved pages
the engine's own forward  ``wrote(rid, pages, instance)``             page tags, blast radius
  wrote a request's pages
decode admits             ``verify_admit(ticket, seal)``              all of the above
decode step               ``check_step(ticket)``                      page tags (no sync)
admission queue           ``on_admission(rid, queue, aborted, fin)``  admission invariant
engine sync point         ``resolve()``                               deferred device checks
========================  ==========================================  ========================

Every method returns at once, never raises (a failure inside is counted under
``hook_errors{hook}`` and the detector's skip reason ``hook_error``), and on an accelerator never
synchronises except in ``seal``, ``verify_admit`` and ``resolve``, which run where engines
already do.

Blast radius (whose KV a reader was exposed to). The hooks keep, per physical page, which
request holds each of its recent generations and which last wrote it (see
:mod:`engine_hooks.pagestate`: request keys beside the page tags, no content). They learn it
from the calls above, with no new call needed: ``on_alloc(pages, request_id)`` and
``on_reserve(rid, pages, instance)`` say who owns a page's new generation; a write is known by
its tag (``mark_written`` by a remote writer with the reader's ticket tags, ``landed`` for a
transfer that carries no tags, ``extend`` and ``wrote`` for the engine's own writes,
``seal(rid, pages)`` for the writer's pages). A write into a free page is reported as its late
writer's (``detail["next_owner"]`` the allocating request), with no sources: nobody read it.
When a finding of one of :data:`~engine_hooks.detectors.EXPOSING_KINDS` is reported, its
:class:`Verdict` carries ``sources`` (:class:`kvspool.records.Source`: request id, instance,
pages, ``written_at``), most pages first, at most ``MAX_EVENT_SOURCES``, plus
``other_sources`` and ``other_source_pages``; the spool event carries the same fields. A page
never written since start-up, or scrubbed, has no source; the reader is never its own source;
pages whose writer the hooks cannot name are counted in the event's
``detail["unattributed_pages"]``. Look-ups run only when a finding is reported (at a sync
point on an accelerator); the per-token path only writes device arrays.

Stopped before the read. ``verify_admit``, ``check_batch`` and ``check_step`` take
``before_read=True`` from an engine that calls them before it reads the pages and fails a
request whose verdict ``blocks`` (minipd: at admission and before each step's attention).
Then every mismatch of a request that enforce mode fails there carries
``detail["stopped_before_read"] = 1`` (:data:`kvspool.records.STOPPED_BEFORE_READ`): its
sources say whose KV the pages held, but nobody's reached it, so the daemon names it as no
reader. Never for a check read after the read: a deferred device check read at
:meth:`KVWatch.resolve` (the step has run), or an engine that checks after its forward (the
default, ``before_read=False``, keeps a request named as a reader).

Scrub (``KVWatch(..., scrub=Scrub.ON_FREE | Scrub.ON_RESERVE)``, independent of the detector
modes): pages are zeroed in every buffer, and their tags reset to "never written", when they
return to the free list (``on_free``) or when decode reserves them for a remote write
(``on_reserve``); the canary stamps are written after the scrub, so detection works as without
it. A read of a page nobody wrote for the reader then reads zeros, not another request's KV.
On an accelerator it is one fill launch, no sync. See docs/scrub.md for what each choice
covers and costs.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import numpy as np
import torch

from engine_hooks.canary import Purpose
from engine_hooks.detectors import (
    EXPOSING_KINDS,
    Admission,
    Canary,
    Finding,
    Mode,
    PageTags,
    PoolReport,
    Seal,
    Stats,
    TransferChecksum,
    Verdict,
)
from engine_hooks.guard import never_raise
from engine_hooks.pagestate import NOBODY, UNKNOWN, Ints, page_state
from engine_hooks.pool import PagedKVPool, PageIds
from engine_hooks.spool import SpoolWriter
from kvspool import schema
from kvspool.catalogue import DETECTOR, HOOK, HOOKED_DETECTORS, SKIP_REASON
from kvspool.records import STOPPED_BEFORE_READ, Source

P = ParamSpec("P")
R = TypeVar("R")

DETECTOR_NAMES = HOOKED_DETECTORS
_HOOK_ERROR, _NO_POOL, _NO_SEAL, _UNSUPPORTED_LAYOUT = (
    SKIP_REASON.check(reason)
    for reason in ("hook_error", "no_pool", "no_seal", "unsupported_layout")
)
#: The hooks of :class:`KVWatch`, each named where it is defined (``_hook``), and the flush.
_FLUSH = HOOK.check("flush")
HOOKS: set[str] = {_FLUSH}
# Mismatches already reported, remembered so a request instance is reported once per detector
# and kind.
_REMEMBERED_REPORTS = 4096
# From this many pages on, a host-memory batch check is cheaper as tensor ops than in Python.
_VECTOR_PAGES = 96


# Requests remembered as page holders (see RequestKeys): a page whose holder was forgotten
# has an unattributed source.
_REQUEST_KEYS = 1 << 16


class Scrub(StrEnum):
    """When the hooks overwrite pages with zeros (independent of the detectors' modes)."""

    OFF = "off"
    ON_FREE = "on_free"  # when pages return to the free list
    ON_RESERVE = "on_reserve"  # when decode reserves pages for a remote write


class RequestKeys:
    """Request instances as small integer keys for the per-page holder record (no content).

    Keys count up from 1 and are never reused; the table keeps the ``limit`` most recently
    used, so a page whose holder was forgotten is unattributed, never misattributed."""

    def __init__(self, limit: int = _REQUEST_KEYS) -> None:
        self.limit = limit
        self._next = 1
        self._by_key: OrderedDict[int, tuple[str, str]] = OrderedDict()
        self._by_request: dict[tuple[str, str], int] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def key(self, request_id: str, instance: str = "") -> int:
        """The key of a request instance (``UNKNOWN`` for an anonymous one)."""
        if not request_id and not instance:
            return UNKNOWN
        ident = (request_id[:128], instance[:128])
        key = self._by_request.get(ident)
        if key is not None and key in self._by_key:
            self._by_key.move_to_end(key)
            return key
        key, self._next = self._next, self._next + 1
        self._by_key[key] = ident
        self._by_request[ident] = key
        while len(self._by_key) > self.limit:
            old, old_ident = self._by_key.popitem(last=False)
            if self._by_request.get(old_ident) == old:
                del self._by_request[old_ident]
        return key

    def get(self, key: int) -> tuple[str, str] | None:
        """(request id, instance) of a key, or None if forgotten or not a request's."""
        return self._by_key.get(key)


# Request instances: a random per-process prefix and a counter (unique without coordination).
_INSTANCE_PREFIX = secrets.token_hex(4)
_INSTANCE_COUNTER = itertools.count(1)


def new_instance() -> str:
    """A fresh request instance id: one admission of a request. A request id is not an
    identity (clients reuse them); events are keyed by the instance, the id stays a field."""
    return f"{_INSTANCE_PREFIX}-{next(_INSTANCE_COUNTER):x}"


@dataclass(slots=True)
class Ticket:
    """A request's claim on decode pages: the page ids and their generations when reserved."""

    request_id: str
    pages: Ints
    tags: Ints
    instance: str = ""
    # The same as one [2, n] tensor (page ids; tags), reused by every decode step's batch
    # check: a view of a buffer with room to grow, which ``extend`` appends to in place on
    # the host (through a numpy view) and which is rebuilt when full or on a device.
    # (Not constructor arguments: public fields may follow without shifting positions.)
    _stacked: torch.Tensor | None = field(default=None, init=False, repr=False)
    _buffer: torch.Tensor | None = field(default=None, init=False, repr=False)
    _host: np.ndarray | None = field(default=None, init=False, repr=False)
    _host_stacked: np.ndarray | None = field(default=None, init=False, repr=False)
    _count: int = field(default=0, init=False, repr=False)

    @property
    def page_count(self) -> int:
        return len(self.pages)

    def stacked(self, device: torch.device) -> torch.Tensor:
        if self._stacked is None:
            n = len(self.pages)
            buffer = torch.empty((2, n + n // 2 + 8), dtype=torch.int64, device=device)
            buffer[0, :n] = _int64(self.pages, device)
            buffer[1, :n] = _int64(self.tags, device)
            self._buffer, self._count = buffer, n
            self._host = buffer.numpy() if buffer.device.type == "cpu" else None
            self._stacked = buffer[:, :n]
            self._host_stacked = None if self._host is None else self._host[:, :n]
        return self._stacked

    def repoint(self, pages: Ints, tags: Ints) -> None:
        """The request's row now names other pages (a radix-cache dedup re-pointed it): the
        ticket follows, and its cached tensors are rebuilt at the next step."""
        self.pages, self.tags = pages, tags
        self._stacked = self._buffer = self._host = self._host_stacked = None

    def host_stacked(self) -> np.ndarray:
        """:meth:`stacked` of a host pool as a numpy view (numpy joins many small arrays in
        half the time of ``torch.cat``)."""
        if self._host_stacked is None:
            self.stacked(torch.device("cpu"))
        assert self._host_stacked is not None
        return self._host_stacked

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        stacked = self.stacked(device)
        return stacked[0], stacked[1]

    def _append(self, pages: Ints, tags: Ints) -> None:
        """``extend`` added these pages to ``self.pages`` and ``self.tags``."""
        start, end = self._count, self._count + len(pages)
        host = self._host
        if host is None or self._buffer is None or end > host.shape[1]:
            self._stacked = self._buffer = self._host = self._host_stacked = None  # rebuilt
            return
        if end == start + 1 and isinstance(pages, list) and isinstance(tags, list):
            host[0, start], host[1, start] = pages[0], tags[0]  # one decode page: no slicing
        else:
            host[0, start:end] = pages
            host[1, start:end] = tags
        self._count = end
        self._stacked = self._buffer[:, :end]
        self._host_stacked = host[:, :end]


def _owners(tickets: Sequence[Ticket]) -> list[tuple[str, int]]:
    return [(t.request_id, t.page_count) for t in tickets]


def _instances(tickets: Sequence[Ticket]) -> tuple[str, ...]:
    return tuple(t.instance for t in tickets)


def _int64(values: Ints, device: torch.device) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=torch.int64)
    # Through numpy: torch.tensor(list) costs ~0.2 us per element, numpy a few ns.
    return torch.from_numpy(np.asarray(values, dtype=np.int64)).to(device)


def _modes(mode: Mode | str | Mapping[str, Mode | str]) -> dict[str, Mode]:
    if isinstance(mode, Mapping):
        default = Mode(mode.get("default", Mode.LOG))
        return {name: Mode(mode.get(name, default)) for name in DETECTOR_NAMES}
    return {name: Mode(mode) for name in DETECTOR_NAMES}


def _hook(name: str, fallback: Callable[[], Any]) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Time a hook into ``hook_seconds{hook}`` and turn any exception into a counted no-op."""
    HOOKS.add(HOOK.check(name))

    def failed(_method: Callable[..., Any], args: tuple[Any, ...], _error: Exception) -> None:
        watch = args[0]
        watch.stats.add("hook_errors", (name,))
        for detector in watch.detectors_of(name):
            watch.stats.skipped(detector, _HOOK_ERROR)

    labels = (name,)

    def wrap(method: Callable[P, R]) -> Callable[P, R]:
        guarded = never_raise(failed, fallback)(method)

        @functools.wraps(method)
        def timed(*args: P.args, **kwargs: P.kwargs) -> R:
            watch = args[0]
            assert isinstance(watch, KVWatch)
            started = time.perf_counter()
            try:
                result: R = guarded(*args, **kwargs)
                return result
            finally:
                watch.stats.add("hook_seconds", labels, time.perf_counter() - started)

        return timed

    return wrap


#: The detectors whose verification a hook's failure skips.
_HOOK_DETECTORS = {
    HOOK.check(hook): tuple(DETECTOR.check(name) for name in detectors)
    for hook, detectors in {
        "alloc": ("canary", "page_tag"),
        "free": ("page_tag",),
        "reserve": ("canary", "page_tag"),
        "seal": ("checksum",),
        "verify": ("canary", "checksum", "page_tag"),
        "step": ("page_tag",),
        "landed": ("page_tag",),
        "wrote": ("page_tag",),
        "resolve": (),
        "admission": ("admission",),
        "startup": (),
    }.items()
}


class KVWatch:
    """kvwatch's hooks for one engine process (one role, one rank, one pool)."""

    def __init__(
        self,
        pool: PagedKVPool | None,
        *,
        role: str,
        engine: str,
        engine_version: str = "",
        model: str = "",
        rank: int = 0,
        mode: Mode | str | Mapping[str, Mode | str] = Mode.LOG,
        spool: SpoolWriter | str | Path | None = None,
        flush_interval: float = 1.0,
        scrub: Scrub | str = Scrub.OFF,
    ) -> None:
        self.pool = pool
        self.role = role
        self.modes = _modes(mode)
        self.scrub = Scrub(scrub)
        self.requests = RequestKeys()
        self.stats = Stats()
        if isinstance(spool, str | Path):
            spool = SpoolWriter(
                spool,
                engine=engine,
                role=role,
                model=model,
                engine_version=engine_version,
                rank=rank,
            )
        self.spool = spool
        self.admission = Admission(self.stats, self.modes[Admission.name])
        self.state = page_state(pool) if pool else None
        self.tags = (
            PageTags(self.state, self.stats, self.modes[PageTags.name]) if self.state else None
        )
        self.canary = (
            Canary(pool, self.state, self.stats, self.modes[Canary.name])
            if pool and self.state
            else None
        )
        self.checksum = (
            TransferChecksum(pool, self.stats, self.modes[TransferChecksum.name]) if pool else None
        )
        self.pool_report: PoolReport | None = None
        self._pending: list[Finding] = []
        self._reported: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        # Per page a seal wrote, whose KV each of its token rows holds, top down: (holder or
        # None for zeros, rows up to). Kept at seal (a sync point) for its residue only.
        self._rows: dict[int, list[tuple[tuple[str, str] | None, int]]] = {}
        self._on_device = pool is not None and not pool.is_cpu
        self._lock = threading.Lock()  # guards the spool snapshot against the flush thread
        self._stop = threading.Event()
        # Set by a mismatch: the flush thread writes the counters at once, not a flush interval
        # later (the alert pages on the counter; an engine killed in between would leave an
        # event that pages nobody). The engine's thread only sets it: it never waits on a write.
        self._flush_soon = threading.Event()
        self._thread: threading.Thread | None = None
        if self.spool is not None:
            self.flush()
            self._thread = threading.Thread(
                target=self._flush_loop, args=(flush_interval,), name="kvwatch-flush", daemon=True
            )
            self._thread.start()
            ref = weakref.ref(self)
            atexit.register(_close_ref, ref)

    # -- hook points --------------------------------------------------------------------------

    def detectors_of(self, hook: str) -> tuple[str, ...]:
        return _HOOK_DETECTORS.get(hook, ())

    @_hook("startup", lambda: None)
    def report_pool(
        self, pool_tokens: int, context_length_tokens: int, page_size: int
    ) -> PoolReport:
        """Pool versus context, at engine start: the gauges and the unsafe band."""
        self.pool_report = PoolReport(int(pool_tokens), int(context_length_tokens), int(page_size))
        self._write_gauges()
        return self.pool_report

    @_hook("alloc", list)
    def on_alloc(self, pages: PageIds, request_id: str = "", instance: str = "") -> list[Verdict]:
        """Pages leave the free list: check free canaries, bump generations (given to
        ``request_id``, when the engine knows it here)."""
        if self.state is None or self.canary is None:
            return []
        index = self.state.index(pages)
        findings: list[Finding] = []
        if self.canary.usable and self.canary.active():
            gens = self.state.generations(index)
            free = self.canary.check_free(request_id, index, gens)
            if self._on_device:  # resolved later: the late writer by the tags it left now
                free.tags = self.state.written_tags(index)
            findings.append(free)
            self.stats.verified(Canary.name)
        self.state.set_free(index, False)
        self.state.bump(index, self.requests.key(request_id, instance), time.time())
        return self._settle(findings)

    @_hook("free", list)
    def on_free(self, pages: PageIds, request_id: str = "") -> list[Verdict]:
        """Pages return to the free list: catch a double free, stamp free canaries."""
        if self.state is None or self.tags is None or self.canary is None:
            return []
        index = self.state.index(pages)
        double_free = self.tags.freed(index, request_id)
        findings = [double_free] if self.tags.active() else []
        if self.scrub is Scrub.ON_FREE:
            self.state.scrub(index)  # before the stamp: the stamp must survive it
            self._forget_rows(index, zeroed=True)
        if self.canary.usable and self.canary.mode is not Mode.OFF:
            self.state.stamp(index, self.state.generations(index), Purpose.FREE)
        return self._settle(findings)

    @_hook("reserve", lambda: None)
    def on_reserve(self, request_id: str, pages: PageIds, instance: str = "") -> Ticket | None:
        """Decode reserved destination pages for a request: stamp them, remember generations.
        The ticket carries ``instance``, or a fresh one (:func:`new_instance`)."""
        if self.state is None or self.canary is None:
            return None
        index = self.state.index(pages)
        tags = self.state.generations(index)
        instance = instance or new_instance()
        self.state.claim(index, self.requests.key(request_id, instance), time.time())
        if self.scrub is Scrub.ON_RESERVE:
            self.state.scrub(index)  # before the stamp: the stamp must survive it
            self._forget_rows(index, zeroed=True)
        if self.canary.usable and self.canary.mode is not Mode.OFF:
            self.state.stamp(index, tags, Purpose.RESERVED)
        return Ticket(request_id, index, tags, instance)

    @_hook("reserve", lambda: None)
    def extend(self, ticket: Ticket, pages: PageIds) -> None:
        """Pages allocated later to the same request that the engine writes itself (decode's
        own tokens): they join the ticket, tagged as written by their owner."""
        if self.state is None:
            return
        index = self.state.index(pages)
        self._own(index, ticket.request_id, ticket.instance)
        self._forget_rows(index)
        gens = self.state.generations(index)
        if isinstance(ticket.pages, list) and isinstance(ticket.tags, list):
            # Host lists grow in place (a copy per decode page is O(pages)); nothing else
            # holds them: host findings are resolved before their hook returns.
            ticket.pages.extend(index)
            ticket.tags.extend(gens)
        else:
            ticket.pages = self.state.concat([ticket.pages, index])
            ticket.tags = self.state.concat([ticket.tags, gens])
        ticket._append(index, gens)

    @_hook("wrote", lambda: None)
    def wrote(self, request_id: str, pages: PageIds, instance: str = "") -> None:
        """The request's own forward wrote these pages (an engine's own writes carry no tags):
        they are written for their current generation and hold its KV from now on."""
        if self.state is None or len(pages) == 0:
            return
        index = self.state.index(pages)
        self._own(index, request_id, instance)
        self._forget_rows(index)

    def _own(self, index: Ints, request_id: str, instance: str = "") -> None:
        """``request_id`` wrote the pages ``index`` itself, now."""
        assert self.state is not None
        self.state.own_writes(index, time.time(), self.requests.key(request_id, instance))

    @_hook("landed", lambda: None)
    def landed(self, ticket: Ticket) -> None:
        """A transfer that carries no page tags (SGLang's, NIXL's) completed into ``ticket``'s
        reserved pages: mark written the pages it really wrote, told by the reserved canary
        being gone (all of them where the canary cannot tell: off, or a pool it cannot stamp).
        A page it did not write keeps the tag of its last write, so a finding on it names
        whose KV it still holds, never the reader. No host sync on an accelerator."""
        state, pool, canary = self.state, self.pool, self.canary
        if state is None or pool is None or not ticket.page_count:
            return
        if canary is None or not canary.usable or canary.mode is Mode.OFF:
            pool.mark_written(ticket.pages, ticket.tags)
            return
        intact = state.intact(ticket.pages, ticket.tags, Purpose.RESERVED)
        if isinstance(intact, torch.Tensor):  # on the device: a select, no sync
            index = pool.as_index(ticket.pages)
            tags = torch.as_tensor(ticket.tags).to(device=pool.device, dtype=torch.int64)
            store = pool.tag_store
            store[index] = torch.where(intact, store.index_select(0, index), tags)
            return
        written = [
            (page, tag)
            for page, tag, unwritten in zip(ticket.pages, ticket.tags, intact, strict=True)
            if not unwritten
        ]
        if written:
            pool.mark_written([p for p, _ in written], [t for _, t in written])

    @_hook("seal", lambda: None)
    def seal(self, request_id: str, pages: PageIds, tokens: int | None = None) -> Seal | None:
        """The writer's seal over the pages it sent (prefill, after the KV is computed): also
        records that ``request_id`` wrote them (for the blast radius, in any checksum mode).
        ``tokens``, the tokens written, when the engine knows it: fewer than the pages hold
        leave the last page's tail to its previous holder, which the seal names as residue;
        with scrub on, that tail is zeroed instead (before it is sealed and sent)."""
        if self.checksum is None or self.pool is None or self.state is None:
            return None
        index = self.state.index(pages)
        residue: tuple[tuple[str, str], ...] = ()
        count, page_size = len(index), self.pool.page_size
        me = (request_id[:128], "")
        if count and tokens is not None and 0 <= tokens < count * page_size:
            last = index[count - 1 :]
            used = max(0, tokens - (count - 1) * page_size)
            if self.scrub is Scrub.OFF:
                residue = self._residue(int(last[0]), used, request_id)
            else:
                self.state.scrub_tail(int(last[0]), used)
                self._rows[int(last[0])] = [(me, used), (None, page_size)]
            full = [int(p) for p in index[: count - 1]]
        else:
            full = [int(p) for p in index]
        for page in full:
            self._rows[page] = [(me, page_size)]
        self._own(index, request_id)
        if not self.checksum.active():
            return None
        return replace(self.checksum.seal(pages), residue=residue)

    def _residue(self, page: int, used: int, writer: str) -> tuple[tuple[str, str], ...]:
        """Whose KV stays in rows ``used`` and up of ``page`` once ``writer`` wrote the rows
        before them: from the rows the page's earlier seals wrote, where known; else the page's
        holder by its tag, if those rows are not zeros (never written, or scrubbed)."""
        assert self.pool is not None
        size, me = self.pool.page_size, (writer[:128], "")
        layers = self._rows.get(page)
        if layers is None:
            holders = self._holders([page], writer) if self._tail_written(page, used) else ()
            layers = [*((h, size) for h in holders), (None, size)]
        out: list[tuple[str, str]] = []
        below = 0
        for holder, upto in layers:
            if upto > max(below, used) and holder is not None and holder[0] != writer:
                out.append(holder)
            below = max(below, upto)
        self._rows[page] = [(me, used), *((h, u) for h, u in layers if u > used)]
        return tuple(sorted(set(out)))

    def _tail_written(self, page: int, used: int) -> bool:
        """Whether any row of ``page`` from ``used`` on is not zeros, in any buffer."""
        assert self.pool is not None
        size = self.pool.page_size
        for view in self.pool.page_views:
            rows = view[page].view(size, -1)
            if bool(rows[used:].any()):
                return True
        return False

    def _forget_rows(self, pages: Ints, *, zeroed: bool = False) -> None:
        """The pages were written (or zeroed) other than by a seal: rows unknown (or zeros).

        Nothing to do while no seal has recorded rows (a decode engine, which never seals):
        a page without a record has its tail read at the seal, and a scrubbed tail reads as
        zeros there. So no hook on decode's per-step path (``extend``, ``wrote``) copies page
        ids to the host, which on an accelerator is a sync."""
        if not self._rows:
            return
        size = self.pool.page_size if self.pool is not None else 0
        for page in pages.tolist() if isinstance(pages, torch.Tensor) else pages:
            if zeroed:
                self._rows[int(page)] = [(None, size)]
            else:
                self._rows.pop(int(page), None)

    def _holders(self, pages: Ints, reader: str) -> tuple[tuple[str, str], ...]:
        """The requests (id, instance) whose data these pages hold now, other than ``reader``."""
        assert self.state is not None
        keys, _ = self.state.sources(pages)
        idents = {self.requests.get(k) for k in keys if k not in (NOBODY, UNKNOWN)}
        return tuple(sorted(i for i in idents if i is not None and i[0] != reader))

    @_hook("verify", list)
    def verify_admit(
        self,
        ticket: Ticket | None,
        seal: Seal | None,
        *,
        before_read: bool = False,
        context: Mapping[str, int | str] | None = None,
    ) -> list[Verdict]:
        """Before decode admits a request and reads its KV: every detector, in one go.

        ``before_read``: the engine calls this before anything reads the pages and fails the
        request when a verdict ``blocks`` (see :func:`_stopped`). ``context``: what the adapter
        knows of the transfer (its peer: ``peer_request_id``, ``peer_instance``, ``peer_node``,
        ``peer_engine_id``, ``transport``), added to every mismatch's ``detail``. Returns the
        mismatches (an empty list when the request is clean)."""
        if ticket is None or self.canary is None or self.tags is None or self.checksum is None:
            for name in (Canary.name, TransferChecksum.name, PageTags.name):
                self.stats.skipped(name, _NO_POOL)
            return []
        rid, instance = ticket.request_id, ticket.instance
        findings: list[Finding] = []
        residue: Sequence[tuple[str, str]] = ()
        if not self.canary.usable:
            self.stats.skipped(self.canary.name, _UNSUPPORTED_LAYOUT)
        elif self.canary.active():
            findings.append(self.canary.check_reserved(rid, ticket.pages, ticket.tags, instance))
            self.stats.verified(Canary.name)
        if self.tags.active():
            owners = [(rid, ticket.page_count)]
            findings.append(self.tags.compare(owners, ticket.pages, ticket.tags, (instance,)))
            self.stats.verified(PageTags.name)
        verdicts = self._verdicts(findings)
        if self.checksum.active():
            if seal is None:
                self.stats.skipped(self.checksum.name, _NO_SEAL)
            else:
                verdict = self.checksum.verify(rid, ticket.pages, seal)
                self.stats.verified(TransferChecksum.name)
                if not verdict.ok:
                    # Read past the sealed pages: the last one's unwritten tail is read too.
                    short = verdict.kind == TransferChecksum.PAGE_COUNT and (
                        seal.page_count < ticket.page_count
                    )
                    residue = seal.residue if short else ()
                    verdicts.append(replace(verdict, instance=instance))
        if context:
            verdicts = [replace(v, detail={**context, **v.detail}) for v in verdicts]
        return [
            self._report(v, residue if v.detector == TransferChecksum.name else ())
            for v in _stopped(verdicts, before_read)
        ]

    @_hook("free", lambda: None)
    def freed_before_read(
        self,
        request_id: str,
        instance: str,
        pages: PageIds,
        detail: Mapping[str, int | str] | None = None,
    ) -> Verdict | None:
        """The writer's side of a lease that expired: ``request_id`` (``instance``) sent
        ``pages`` to a remote reader, and they were freed before that read was confirmed. The
        finding (``page_tag`` ``freed_before_read``, logged in every mode: the writer's request
        is gone, the reader's check is what fails it) names as sources the requests that took
        the pages since, from the holder slots, with page counts and when they wrote; none
        when nobody took them (the reader reads what was sent)."""
        if self.state is None or self.tags is None or not self.tags.active() or not len(pages):
            return None
        mode = Mode.LOG if self.tags.mode is Mode.ENFORCE else self.tags.mode
        verdict = Verdict(
            PageTags.name,
            request_id,
            False,
            PageTags.FREED_BEFORE_READ,
            tuple(int(p) for p in pages),
            mode,
            dict(detail or {}),
            instance,
        )
        exposed = self._expose(verdict)
        if not exposed.sources and not exposed.other_sources:
            return None  # nobody took them (yet): nothing foreign for the reader to read
        return self._report(verdict)

    @_hook("step", list)
    def check_step(self, ticket: Ticket, *, before_read: bool = False) -> list[Verdict]:
        """Per decode step, one request: see :meth:`check_batch`."""
        return self.check_batch([ticket], before_read=before_read)

    @_hook("step", list)
    def check_batch(self, tickets: Sequence[Ticket], *, before_read: bool = False) -> list[Verdict]:
        """Per decode step, the whole running batch in one vectorised check: every page still
        holds the generation its request was given (no host sync on an accelerator).

        ``before_read``: the engine calls this before the step reads the pages and fails the
        requests whose verdicts ``block`` (see :func:`_stopped`); on an accelerator the check
        is read at :meth:`resolve`, after the step, so it never says so."""
        if self.state is None or self.tags is None or not tickets or not self.tags.active():
            return []
        self.stats.verified(PageTags.name, len(tickets))
        pages: Ints
        expected: Ints
        if self._on_device:
            assert self.pool is not None
            device = self.pool.device
            both = torch.cat([t.stacked(device) for t in tickets], dim=1)  # one copy, not two
            pages, expected = both[0], both[1]
            # Read at resolve(), after the tickets may have grown: taken now.
            owners = _owners(tickets)
            instances = _instances(tickets)
            return self._settle([self.tags.compare(owners, pages, expected, instances)])
        if len(tickets) >= _VECTOR_PAGES or sum(t.page_count for t in tickets) >= _VECTOR_PAGES:
            both = torch.from_numpy(np.concatenate([t.host_stacked() for t in tickets], axis=1))
            pages, expected = both[0], both[1]
        else:
            pages = self.state.concat([t.pages for t in tickets])
            expected = self.state.concat([t.tags for t in tickets])
        # On the host the finding is resolved before this returns: owners and instances are
        # needed only when a page is stale, so a clean step does not build them.
        owned, named = (lambda: _owners(tickets)), (lambda: _instances(tickets))
        return self._settle([self.tags.compare(owned, pages, expected, named)], before_read)

    @_hook("admission", lambda: Verdict(Admission.name, ""))
    def on_admission(
        self, request_id: str, queue: str, *, aborted: bool, finished: bool, instance: str = ""
    ) -> Verdict:
        """An admission queue is about to admit a request; ``aborted`` is ``to_finish`` set.
        Each call is one admission: without ``instance`` it gets a fresh one."""
        if not self.admission.active():
            return self.admission.clean(request_id)
        self.stats.verified(Admission.name)
        verdict = self.admission.check(request_id, queue, aborted, finished)
        if verdict.ok:
            return verdict
        return self._report(replace(verdict, instance=instance or new_instance()))

    @_hook("resolve", list)
    def resolve(self) -> list[Verdict]:
        """Read the deferred device checks; call where the engine already synchronises."""
        pending, self._pending = self._pending, []
        return self._resolved(pending)

    # -- reporting ----------------------------------------------------------------------------

    def _settle(self, findings: list[Finding], before_read: bool = False) -> list[Verdict]:
        """Verdicts now on the host; on an accelerator, later through :meth:`resolve` (after
        the engine's read: ``before_read`` no longer holds)."""
        if self._on_device:
            self._pending.extend(findings)
            return []
        return [self._report(v) for v in _stopped(self._verdicts(findings), before_read)]

    def _resolved(self, findings: list[Finding]) -> list[Verdict]:
        """The findings' verdicts, reported."""
        return [self._report(v) for v in self._verdicts(findings)]

    def _verdicts(self, findings: list[Finding]) -> list[Verdict]:
        """The findings' verdicts, not yet reported; a write into a free page as its late
        writer's."""
        out: list[Verdict] = []
        for finding in findings:
            verdicts = finding.resolve()
            if finding.kind == Canary.WRITE_TO_FREE_PAGE:
                verdicts = self._late_writers(verdicts, finding)
            out.extend(verdicts)
        return out

    def _late_writers(self, verdicts: list[Verdict], finding: Finding) -> list[Verdict]:
        """A write into a free page is the late WRITER's finding, not the allocating request's:
        that request has read nothing (its own write comes first, and were it to read the page
        unwritten, its read is a finding of its own, naming the writer as a source). The
        writer is the holder of the generation the page's tag says was written last (a late
        write carries its request's tag); one verdict per writer, the allocating request kept
        as ``detail["next_owner"]``. No sources: the finding is nobody's read. On an accelerator
        the tags are the ones taken at the allocation (``finding.tags``): by the time the
        finding is read the next owner may have written the page."""
        if self.state is None:
            return verdicts
        tags: dict[int, int] = {}
        if finding.tags is not None:
            pages = (
                finding.pages.tolist() if isinstance(finding.pages, torch.Tensor) else finding.pages
            )
            taken = (
                finding.tags.tolist() if isinstance(finding.tags, torch.Tensor) else finding.tags
            )
            tags = dict(zip(pages, taken, strict=True))
        out: list[Verdict] = []
        for verdict in verdicts:
            index = self.state.index(verdict.pages)
            then = [tags[p] for p in verdict.pages] if tags else None
            keys, _ = self.state.sources(index, then)
            writers: dict[tuple[str, str], list[int]] = {}
            for page, key in zip(verdict.pages, keys, strict=True):
                ident = self.requests.get(key) if key not in (NOBODY, UNKNOWN) else None
                writers.setdefault(ident or ("", ""), []).append(page)
            detail = dict(verdict.detail)
            if verdict.request_id:
                detail["next_owner"] = _text(verdict.request_id)
            for (rid, instance), pages in sorted(writers.items()):
                out.append(
                    replace(
                        verdict, request_id=rid, instance=instance, pages=tuple(pages),
                        detail=detail,
                    )
                )  # fmt: skip
        return out

    def _report(self, verdict: Verdict, residue: Sequence[tuple[str, str]] = ()) -> Verdict:
        """Count a mismatch and write its event record, once per request instance, detector and
        kind: a stale page found at admit is found again at every decode step of the same
        request. The instance, not the request id: two requests may share an id."""
        key = (verdict.instance, verdict.detector, verdict.kind or "other")
        if verdict.instance and key in self._reported:
            return verdict
        if verdict.instance:
            self._reported[key] = None
            if len(self._reported) > _REMEMBERED_REPORTS:
                self._reported.popitem(last=False)
        verdict = self._expose(verdict, residue)
        self.stats.mismatch(verdict.detector, verdict.kind or "other")
        if self.spool is not None:
            record: dict[str, Any] = {
                "detector": verdict.detector,
                "kind": verdict.kind or "other",
                "mode": str(verdict.mode),
                "action": "enforced" if verdict.blocks else "logged",
                "request_id": _text(verdict.request_id),
                "pages": list(verdict.pages[: schema.MAX_EVENT_PAGES]),
                "pages_total": len(verdict.pages),
                "detail": verdict.detail,
            }
            if verdict.instance:
                record["instance"] = _text(verdict.instance)
            if verdict.kind in EXPOSING_KINDS:
                record["sources"] = [_source_record(s) for s in verdict.sources]
                record["other_sources"] = verdict.other_sources
                record["other_source_pages"] = verdict.other_source_pages
            self.spool.write(schema.EVENT, record)
            self._flush_soon.set()
        return verdict

    def _expose(self, verdict: Verdict, residue: Sequence[tuple[str, str]] = ()) -> Verdict:
        """The verdict with the requests whose data its pages held (see the module docstring),
        and the ``residue`` of the writer's last page (one page each; see :class:`Seal`)."""
        if self.state is None or verdict.kind not in EXPOSING_KINDS or not verdict.pages:
            return verdict
        keys, times = self.state.sources(self.state.index(verdict.pages))
        held: dict[tuple[str, str], list[float]] = {}
        unattributed = 0
        found = [
            (self.requests.get(key) if key != UNKNOWN else None, at)
            for key, at in zip(keys, times, strict=True)
            if key != NOBODY
        ]
        for ident, at in [*found, *((r, 0.0) for r in residue)]:
            if ident is None:
                unattributed += 1
            elif not _is_reader(ident, verdict):
                entry = held.setdefault(ident, [0, 0.0])
                entry[0] += 1
                entry[1] = max(entry[1], at)
        ranked = sorted(held.items(), key=lambda item: (-item[1][0], item[0]))
        top, rest = ranked[: schema.MAX_EVENT_SOURCES], ranked[schema.MAX_EVENT_SOURCES :]
        sources = tuple(
            Source(
                request_id=rid,
                pages=int(count),
                instance=instance or None,
                written_at=max(0.0, at),
            )
            for (rid, instance), (count, at) in top
        )
        detail = verdict.detail
        if unattributed:
            detail = {**detail, "unattributed_pages": unattributed}
        return replace(
            verdict,
            sources=sources,
            other_sources=len(rest),
            other_source_pages=int(sum(count for _, (count, _) in rest)),
            detail=detail,
        )

    def counter_series(self) -> list[list[Any]]:
        series: list[list[Any]] = []
        for (name, values), amount in list(self.stats.values.items()):
            labels = dict(zip(schema.COUNTER_LABELS[name], values, strict=True))
            series.append([name, labels, amount])
        if self.spool is not None:
            for reason, amount in self.spool.dropped.items():
                series.append(["spool_dropped", {"reason": reason}, amount])
        return series

    def _write_gauges(self) -> None:
        report = self.pool_report
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
            self._write_gauges()

    def _flush_loop(self, interval: float) -> None:
        while True:
            self._flush_soon.wait(interval)
            self._flush_soon.clear()
            if self._stop.is_set():
                return
            try:
                self.flush()
            except Exception:  # a snapshot lost now is taken again next interval
                self.stats.add("hook_errors", (_FLUSH,))

    def close(self) -> None:
        """Final snapshot, stop the flush thread, close the spool. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._flush_soon.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        self.flush()
        if self.spool is not None:
            self.spool.close()


def _stopped(verdicts: list[Verdict], before_read: bool) -> list[Verdict]:
    """The verdicts, those of a request that enforce mode fails marked
    ``detail["stopped_before_read"] = 1`` where the check ran ``before_read``: the engine
    fails the request before it reads, so none of its findings there is a read (a logged
    finding of another detector in the same check included). Not for a check read after the
    engine read (a deferred device check at :meth:`KVWatch.resolve`, or an engine that checks
    after its forward): that request did read, and is named as a reader."""
    if not before_read:
        return verdicts
    failed = {v.instance or v.request_id for v in verdicts if v.blocks}
    return [
        replace(v, detail={**v.detail, STOPPED_BEFORE_READ: 1})
        if not v.ok and (v.instance or v.request_id) in failed
        else v
        for v in verdicts
    ]


def _is_reader(ident: tuple[str, str], verdict: Verdict) -> bool:
    """Whether a page holder is the verdict's reader: the same instance where both have one
    (a request id may be reused), else the same request id."""
    request_id, instance = ident
    if instance and verdict.instance:
        return instance == verdict.instance[:128]
    return request_id == verdict.request_id[:128]


def _text(value: str) -> str:
    """An id as the spool takes it: valid UTF-8 (a lone surrogate, which UTF-8 cannot hold, as
    its escape: the record would be refused whole) and at most 128 characters."""
    return value.encode("utf-8", "backslashreplace").decode("utf-8")[:128]


def _source_record(source: Source) -> dict[str, Any]:
    record: dict[str, Any] = {
        "request_id": _text(source.request_id),
        "pages": source.pages,
        "written_at": source.written_at,
    }
    if source.instance:
        record["instance"] = _text(source.instance)
    return record


def _close_ref(ref: weakref.ref[KVWatch]) -> None:
    watch = ref()
    if watch is not None:
        watch.close()
