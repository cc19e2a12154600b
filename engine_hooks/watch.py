"""KVWatch: the detectors wired to an engine's hook points, reporting to the spool.

(Over 450 lines: this is the one class the engines and adapters call, every hook and door of
it, each a few lines over the modules that do the work: :mod:`~engine_hooks.tickets`,
:mod:`~engine_hooks.reporting`, :mod:`~engine_hooks.rows`, :mod:`~engine_hooks.flushing`,
:mod:`~engine_hooks.hookpoints`, :mod:`~engine_hooks.pagestate`.)

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

Blast radius (whose KV a reader was exposed to) and "stopped before the read": see
:mod:`engine_hooks.reporting`. Scrub: see :mod:`engine_hooks.scrub`.

The adapters use only this class's public methods and attributes (``pool``, ``modes``,
``role``, ``scrub``); its detectors and page state are its own. Beside the hooks, doors for
what an adapter does around them (not hooks: an adapter calls them inside its own guarded hook,
whose guard counts a failure; every label from :mod:`engine_hooks.labels`):

=================================  ===========================================================
``verify_later(ticket)``           ``verify_admit`` without a sync: read at ``resolve()``
``follow(ticket, pages)``          the request's row was re-pointed (a radix-cache dedup)
``free_list(pages)``               the whole free list is ``pages`` (start-up, a cache flush)
``seal_pages(pages)``              the checksum's seal alone (the adapter reports ``wrote``)
``skip(detector, reason)``         a verification not done, and why
``verified(detector, n)``          an engine's own detector verified ``n`` requests
``engine_finding(...)``            an engine's own detector found a mismatch: its event
``hook_failed(hook)``              an adapter's hook failed (its guard caught it)
``freed_before_read(...)``         a sent request's pages freed before its remote read
``freed_before_drain(freed)``      an aborted transfer's pages freed before its writes stopped
``counter(name, *labels)``         a counter now; ``hook_seconds()``, time in each hook
=================================  ===========================================================
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine_hooks.canary import Purpose
from engine_hooks.detectors import (
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
from engine_hooks.flushing import Snapshots
from engine_hooks.hookpoints import HOOKS
from engine_hooks.hookpoints import hook as _hook
from engine_hooks.labels import Detector, Hook, Kind, Skip
from engine_hooks.options import mode_label
from engine_hooks.pagestate import Ints, PageState, page_state
from engine_hooks.pool import PagedKVPool, PageIds
from engine_hooks.reporting import Reporter, stopped
from engine_hooks.rows import SealRows
from engine_hooks.scrub import Scrub
from engine_hooks.spool import SpoolWriter
from engine_hooks.takers import Takers
from engine_hooks.tickets import RequestKeys, Ticket, instances_of, new_instance, owners_of
from kvspool.catalogue import HOOKED_DETECTORS
from kvspool.records import MAX_CONFIG_ERRORS, Source

__all__ = ["HOOKS", "KVWatch", "RequestKeys", "Scrub", "Ticket", "new_instance"]

DETECTOR_NAMES = HOOKED_DETECTORS
# From this many pages on, a host-memory batch check is cheaper as tensor ops than in Python.
_VECTOR_PAGES = 96


def _modes(mode: Mode | str | Mapping[str, Mode | str]) -> dict[str, Mode]:
    if isinstance(mode, Mapping):
        default = Mode(mode.get("default", Mode.LOG))
        return {name: Mode(mode.get(name, default)) for name in DETECTOR_NAMES}
    return {name: Mode(mode) for name in DETECTOR_NAMES}


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
        config_errors: Sequence[str] = (),
    ) -> None:
        """``config_errors``: the engine's settings that were invalid (catalogue SETTING names,
        from :class:`engine_hooks.options.Options`), carried on every hello with the mode and
        scrub the hooks run with."""
        self.pool = pool
        self.role = role
        self.modes = _modes(mode)
        self.scrub = Scrub(scrub)
        self._requests = RequestKeys()
        self._stats = Stats()
        if isinstance(spool, str | Path):
            spool = SpoolWriter(
                spool,
                engine=engine,
                role=role,
                model=model,
                engine_version=engine_version,
                rank=rank,
            )
        if spool is not None:
            spool.identity.update(
                mode=mode_label(self.modes.values()),
                scrub=self.scrub.value,
                config_errors=list(config_errors)[:MAX_CONFIG_ERRORS],
            )
        self.spool = spool
        self._admission = Admission(self._stats, self.modes[Admission.name])
        self._state = page_state(pool) if pool else None
        self._tags = (
            PageTags(self._state, self._stats, self.modes[PageTags.name]) if self._state else None
        )
        self._canary = (
            Canary(pool, self._state, self._stats, self.modes[Canary.name])
            if pool and self._state
            else None
        )
        self._checksum = (
            TransferChecksum(pool, self._stats, self.modes[TransferChecksum.name]) if pool else None
        )
        self.pool_report: PoolReport | None = None
        self._pending: list[Finding] = []
        self._rows = SealRows(pool, self._state, self._requests) if pool and self._state else None
        self._on_device = pool is not None and not pool.is_cpu
        self._snapshots = Snapshots(self._stats, spool, flush_interval, lambda: self.pool_report)
        self._reporter = Reporter(
            self._state, self._requests, self._stats, self.spool, self._snapshots.soon
        )

    def _use_state(self, state: PageState) -> None:
        """Run on another page-state backend (tests: the device backend on a CPU pool)."""
        self._state = state
        for user in (self._tags, self._canary, self._reporter, self._rows):
            if user is not None:
                user.state = state

    # -- hook points --------------------------------------------------------------------------

    @_hook(Hook.STARTUP, lambda: None)
    def report_pool(
        self, pool_tokens: int, context_length_tokens: int, page_size: int
    ) -> PoolReport:
        """Pool versus context, at engine start: the gauges and the unsafe band."""
        self.pool_report = PoolReport(int(pool_tokens), int(context_length_tokens), int(page_size))
        self._snapshots.write_gauges()
        return self.pool_report

    @_hook(Hook.ALLOC, list)
    def on_alloc(self, pages: PageIds, request_id: str = "", instance: str = "") -> list[Verdict]:
        """Pages leave the free list: check free canaries, bump generations (given to
        ``request_id``, when the engine knows it here)."""
        if self._state is None or self._canary is None:
            return []
        index = self._state.index(pages)
        findings: list[Finding] = []
        if self._canary.usable and self._canary.active():
            gens = self._state.generations(index)
            free = self._canary.check_free(request_id, index, gens)
            if self._on_device:  # resolved later: the late writer by the tags it left now
                free.tags = self._state.written_tags(index)
            findings.append(free)
            self._stats.verified(Canary.name)
        self._state.set_free(index, False)
        self._state.bump(index, self._requests.key(request_id, instance), time.time())
        return self._settle(findings)

    @_hook(Hook.FREE, list)
    def on_free(self, pages: PageIds, request_id: str = "") -> list[Verdict]:
        """Pages return to the free list: catch a double free, stamp free canaries."""
        if self._state is None or self._tags is None or self._canary is None:
            return []
        index = self._state.index(pages)
        double_free = self._tags.freed(index, request_id)
        findings = [double_free] if self._tags.active() else []
        if self.scrub is Scrub.ON_FREE:
            self._state.scrub(index)  # before the stamp: the stamp must survive it
            self._forget(index, zeroed=True)
        if self._canary.usable and self._canary.mode is not Mode.OFF:
            self._state.stamp(index, self._state.generations(index), Purpose.FREE)
        return self._settle(findings)

    @_hook(Hook.RESERVE, lambda: None)
    def on_reserve(self, request_id: str, pages: PageIds, instance: str = "") -> Ticket | None:
        """Decode reserved destination pages for a request: stamp them, remember generations.
        The ticket carries ``instance``, or a fresh one (:func:`new_instance`)."""
        if self._state is None or self._canary is None:
            return None
        index = self._state.index(pages)
        tags = self._state.generations(index)
        instance = instance or new_instance()
        self._state.claim(index, self._requests.key(request_id, instance), time.time())
        if self.scrub is Scrub.ON_RESERVE:
            self._state.scrub(index)  # before the stamp: the stamp must survive it
            self._forget(index, zeroed=True)
        if self._canary.usable and self._canary.mode is not Mode.OFF:
            self._state.stamp(index, tags, Purpose.RESERVED)
        return Ticket(request_id, index, tags, instance)

    @_hook(Hook.RESERVE, lambda: None)
    def extend(self, ticket: Ticket, pages: PageIds) -> None:
        """Pages allocated later to the same request that the engine writes itself (decode's
        own tokens): they join the ticket, tagged as written by their owner."""
        if self._state is None:
            return
        index = self._state.index(pages)
        self._own(index, ticket.request_id, ticket.instance)
        self._forget(index)
        gens = self._state.generations(index)
        if isinstance(ticket.pages, list) and isinstance(ticket.tags, list):
            # Host lists grow in place (a copy per decode page is O(pages)); nothing else
            # holds them: host findings are resolved before their hook returns.
            ticket.pages.extend(index)
            ticket.tags.extend(gens)
        else:
            ticket.pages = self._state.concat([ticket.pages, index])
            ticket.tags = self._state.concat([ticket.tags, gens])
        ticket._append(index, gens)

    @_hook(Hook.RESERVE, lambda: None)
    def extend_each(self, tickets: Sequence[Ticket], pages: PageIds) -> None:
        """:meth:`extend` by one page for each of ``tickets`` (``pages[k]`` joins
        ``tickets[k]``): a decode step that starts a page for many requests at once, as every
        step does at page size 1. One index, one generation read and one write record for the
        step, not one of each per request."""
        if self._state is None or not tickets:
            return
        index = self._state.index(pages)
        if len(index) != len(tickets):
            raise ValueError(f"{len(index)} pages for {len(tickets)} tickets")
        key = self._requests.key
        self._state.own_writes(index, time.time(), [key(t.request_id, t.instance) for t in tickets])
        self._forget(index)
        gens = self._state.generations(index)
        for k, ticket in enumerate(tickets):
            one, tag = index[k : k + 1], gens[k : k + 1]
            if isinstance(ticket.pages, list) and isinstance(ticket.tags, list):
                ticket.pages += one  # as extend: host lists grow in place
                ticket.tags += tag
            else:
                ticket.pages = self._state.concat([ticket.pages, one])
                ticket.tags = self._state.concat([ticket.tags, tag])
            ticket._append(one, tag)

    @_hook(Hook.WROTE, lambda: None)
    def wrote(self, request_id: str, pages: PageIds, instance: str = "") -> None:
        """The request's own forward wrote these pages (an engine's own writes carry no tags):
        they are written for their current generation and hold its KV from now on."""
        if self._state is None or len(pages) == 0:
            return
        index = self._state.index(pages)
        self._own(index, request_id, instance)
        self._forget(index)

    def _forget(self, pages: Ints, *, zeroed: bool = False) -> None:
        """The pages were written (or zeroed) other than by a seal: see :mod:`engine_hooks.rows`."""
        if self._rows is not None:
            self._rows.forget(pages, zeroed=zeroed)

    def _own(self, index: Ints, request_id: str, instance: str = "") -> None:
        """``request_id`` wrote the pages ``index`` itself, now."""
        assert self._state is not None
        self._state.own_writes(index, time.time(), self._requests.key(request_id, instance))

    @_hook(Hook.LANDED, lambda: None)
    def landed(self, ticket: Ticket) -> None:
        """A transfer that carries no page tags (SGLang's, NIXL's) completed into ``ticket``'s
        reserved pages: mark written the pages it really wrote, told by the reserved canary
        being gone (all of them where the canary cannot tell: off, or a pool it cannot stamp).
        A page it did not write keeps the tag of its last write, so a finding on it names
        whose KV it still holds, never the reader. No host sync on an accelerator."""
        state, canary = self._state, self._canary
        if state is None or self.pool is None or not ticket.page_count:
            return
        if canary is None or not canary.usable or canary.mode is Mode.OFF:
            state.land(ticket.pages, ticket.tags)
            return
        # On the device a select, no sync.
        state.land(
            ticket.pages, ticket.tags, state.intact(ticket.pages, ticket.tags, Purpose.RESERVED)
        )

    @_hook(Hook.SEAL, lambda: None)
    def seal(self, request_id: str, pages: PageIds, tokens: int | None = None) -> Seal | None:
        """The writer's seal over the pages it sent (prefill, after the KV is computed): also
        records that ``request_id`` wrote them (for the blast radius, in any checksum mode).
        ``tokens``, the tokens written, when the engine knows it: fewer than the pages hold
        leave the last page's tail to its previous holder, which the seal names as residue;
        with scrub on, that tail is zeroed instead (before it is sealed and sent)."""
        if self._checksum is None or self._rows is None or self._state is None:
            return None
        index = self._state.index(pages)
        residue = self._rows.sealed(index, request_id, tokens, scrub=self.scrub is not Scrub.OFF)
        self._own(index, request_id)
        if not self._checksum.active():
            return None
        return replace(self._checksum.seal(pages), residue=residue)

    @_hook(Hook.VERIFY, list)
    def verify_admit(
        self,
        ticket: Ticket | None,
        seal: Seal | None,
        *,
        before_read: bool = False,
        context: Mapping[str, int | str] | None = None,
        layout: Mapping[str, int | str] | None = None,
        skip: Skip | None = None,
    ) -> list[Verdict]:
        """Before decode admits a request and reads its KV: every detector, in one go.

        ``layout``: what the adapter found to differ between the seal's layout signature and its
        own pages (non-empty): the checksum's verdict is then a ``layout_mismatch`` with that
        detail, in place of the digest comparison (the bytes would be read wrongly, whatever
        their digest). ``skip``: why the adapter could not use the transfer's seal (its writer
        holds another shard of the heads), counted in place of ``no_seal``.

        ``before_read``: the engine calls this before anything reads the pages and fails the
        request when a verdict ``blocks`` (see :func:`_stopped`). ``context``: what the adapter
        knows of the transfer (its peer: ``peer_request_id``, ``peer_instance``, ``peer_node``,
        ``peer_engine_id``, ``transport``), added to every mismatch's ``detail``. Returns the
        mismatches (an empty list when the request is clean)."""
        if ticket is None or self._canary is None or self._tags is None or self._checksum is None:
            for name in (Canary.name, TransferChecksum.name, PageTags.name):
                self._stats.skipped(name, Skip.NO_POOL)
            return []
        rid, instance = ticket.request_id, ticket.instance
        residue: Sequence[tuple[str, str]] = ()
        verdicts = self._verdicts(self._admit_findings(ticket))
        if self._checksum.active() and layout:
            verdict = self._checksum.layout_mismatch(rid, ticket.pages, layout)
            self._stats.verified(TransferChecksum.name)
            verdicts.append(replace(verdict, instance=instance))
        elif self._checksum.active():
            if seal is None:
                self._stats.skipped(self._checksum.name, skip or Skip.NO_SEAL)
            else:
                verdict = self._checksum.verify(rid, ticket.pages, seal)
                self._stats.verified(TransferChecksum.name)
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
            self._reporter.report(v, residue if v.detector == TransferChecksum.name else ())
            for v in stopped(verdicts, before_read)
        ]

    def _admit_findings(self, ticket: Ticket) -> list[Finding]:
        """The canary's and the page tags' findings on a ticket at admission, counted."""
        assert self._canary is not None and self._tags is not None
        rid, instance = ticket.request_id, ticket.instance
        findings: list[Finding] = []
        if not self._canary.usable:
            self._stats.skipped(self._canary.name, Skip.UNSUPPORTED_LAYOUT)
        elif self._canary.active():
            findings.append(self._canary.check_reserved(rid, ticket.pages, ticket.tags, instance))
            self._stats.verified(Canary.name)
        if self._tags.active():
            owners = [(rid, ticket.page_count)]
            findings.append(self._tags.compare(owners, ticket.pages, ticket.tags, (instance,)))
            self._stats.verified(PageTags.name)
        return findings

    @_hook(Hook.FREE, lambda: None)
    def freed_before_read(
        self,
        request_id: str,
        instance: str,
        pages: PageIds,
        detail: Mapping[str, int | str] | None = None,
        takers: Sequence[Source] | None = None,
    ) -> Verdict | None:
        """The writer's side of a lease that expired: ``request_id`` (``instance``) sent
        ``pages`` to a remote reader, and they were freed before that read was confirmed. The
        finding (``page_tag`` ``freed_before_read``, logged in every mode: the writer's request
        is gone, the reader's check is what fails it) names as sources the requests that took
        the pages since: ``takers`` where the caller kept every one (pages, first write), else
        the pages' holders now, from the holder slots; none when nobody took them (the reader
        reads what was sent)."""
        if self._state is None or self._tags is None or not self._tags.active() or not len(pages):
            return None
        mode = Mode.LOG if self._tags.mode is Mode.ENFORCE else self._tags.mode
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
        if takers is None:
            exposed = self._reporter.expose(verdict)
        else:
            exposed = self._reporter.named(verdict, takers)
        if not exposed.sources and not exposed.other_sources:
            return None  # nobody took them (yet): nothing foreign for the reader to read
        return self._reporter.report(exposed, exposed=takers is not None)

    @_hook(Hook.FREE, list)
    def freed_before_drain(
        self, freed: Takers, detail: Mapping[str, int | str] | None = None
    ) -> list[Verdict]:
        """The reader's side of an aborted transfer released on a timeout: ``freed``'s request
        had its pages freed before its writer confirmed that its writes into them had stopped,
        and ``freed.takers`` took them since. One finding per taker (``page_tag``
        ``freed_before_drain``, the taker the reader: a late write puts the aborted request's
        KV in its pages), with the aborted request as its source; logged in every mode
        (nothing shows whether a late write came: the taker is named, not failed)."""
        if self._tags is None or not self._tags.active():
            return []
        mode = Mode.LOG if self._tags.mode is Mode.ENFORCE else self._tags.mode
        common = {**(detail or {}), "freed_at_ms": int(freed.since * 1000)}
        out = []
        for (rid, instance), taker in freed.takers.items():
            pages = tuple(sorted(taker.pages))
            detail = {**common, "taken_at_ms": int(taker.first_at * 1000)}
            verdict = Verdict(
                PageTags.name, rid, False, PageTags.FREED_BEFORE_DRAIN, pages, mode, detail,
                instance,
            )  # fmt: skip
            source = Source(
                request_id=freed.request_id, pages=len(pages), instance=freed.instance or None
            )
            out.append(self._reporter.report(self._reporter.named(verdict, [source]), exposed=True))
        return out

    @_hook(Hook.STEP, list)
    def check_step(self, ticket: Ticket, *, before_read: bool = False) -> list[Verdict]:
        """Per decode step, one request: see :meth:`check_batch`."""
        return self.check_batch([ticket], before_read=before_read)

    @_hook(Hook.STEP, list)
    def check_batch(self, tickets: Sequence[Ticket], *, before_read: bool = False) -> list[Verdict]:
        """Per decode step, the whole running batch in one vectorised check: every page still
        holds the generation its request was given (no host sync on an accelerator).

        ``before_read``: the engine calls this before the step reads the pages and fails the
        requests whose verdicts ``block`` (see :func:`_stopped`); on an accelerator the check
        is read at :meth:`resolve`, after the step, so it never says so."""
        if self._state is None or self._tags is None or not tickets or not self._tags.active():
            return []
        self._stats.verified(PageTags.name, len(tickets))
        pages: Ints
        expected: Ints
        if self._on_device:
            assert self.pool is not None
            device = self.pool.device
            both = torch.cat([t.stacked(device) for t in tickets], dim=1)  # one copy, not two
            pages, expected = both[0], both[1]
            # Read at resolve(), after the tickets may have grown: taken now.
            owners = owners_of(tickets)
            instances = instances_of(tickets)
            return self._settle([self._tags.compare(owners, pages, expected, instances)])
        if len(tickets) >= _VECTOR_PAGES or sum(t.page_count for t in tickets) >= _VECTOR_PAGES:
            both = torch.from_numpy(np.concatenate([t.host_stacked() for t in tickets], axis=1))
            pages, expected = both[0], both[1]
        else:
            pages = self._state.concat([t.pages for t in tickets])
            expected = self._state.concat([t.tags for t in tickets])
        # On the host the finding is resolved before this returns: owners and instances are
        # needed only when a page is stale, so a clean step does not build them.
        owned, named = (lambda: owners_of(tickets)), (lambda: instances_of(tickets))
        return self._settle([self._tags.compare(owned, pages, expected, named)], before_read)

    @_hook(Hook.ADMISSION, lambda: Verdict(Admission.name, ""))
    def on_admission(
        self, request_id: str, queue: str, *, aborted: bool, finished: bool, instance: str = ""
    ) -> Verdict:
        """An admission queue is about to admit a request; ``aborted`` is ``to_finish`` set.
        Each call is one admission: without ``instance`` it gets a fresh one."""
        if not self._admission.active():
            return self._admission.clean(request_id)
        self._stats.verified(Admission.name)
        verdict = self._admission.check(request_id, queue, aborted, finished)
        if verdict.ok:
            return verdict
        return self._reporter.report(replace(verdict, instance=instance or new_instance()))

    @_hook(Hook.RESOLVE, list)
    def resolve(self) -> list[Verdict]:
        """Read the deferred device checks; call where the engine already synchronises."""
        pending, self._pending = self._pending, []
        return self._resolved(pending)

    # -- doors for adapters -------------------------------------------------------------------
    # Not hooks: an adapter calls them inside its own guarded hook, whose guard counts a failure.

    def verify_later(self, ticket: Ticket) -> None:
        """:meth:`verify_admit` without a device sync and without a seal: the canary and tag
        compares queue up until the next :meth:`resolve` (an engine that syncs only there)."""
        findings = self._admit_findings(ticket)
        self.skip(Detector.CHECKSUM, Skip.NO_SEAL)
        self._pending.extend(findings)

    def follow(self, ticket: Ticket, pages: PageIds) -> None:
        """The request's row reads ``pages`` now (a radix-cache dedup re-pointed it): the ticket
        follows. A page the engine re-pointed (the cache's copy of the same tokens) joins with
        its current generation, which its owner vouches for, and is written for it; a page left
        in place keeps the generation it was reserved with. No sync on an accelerator."""
        if self._state is None or not ticket.page_count:
            return
        index = self._state.index(pages)
        tags = self._state.repoint(index, ticket.pages, ticket.tags)
        if tags is not None:
            ticket.repoint(index, tags)

    def free_list(self, pages: PageIds) -> list[Verdict]:
        """The engine's whole free list is ``pages`` now (start-up, a cache flush): every
        page's old free mark is dropped, then ``pages`` are freed as by :meth:`on_free`."""
        if self._state is None or self.pool is None:
            return []
        self._state.set_free(self._state.index(range(self.pool.num_pages)), False)
        return self.on_free(pages)

    def seal_pages(self, pages: PageIds) -> Seal | None:
        """The checksum's seal over ``pages`` alone, for an adapter that records its writes
        itself (:meth:`wrote`); None when the checksum is off or there is no pool."""
        if self._checksum is None or not self._checksum.active():
            return None
        return self._checksum.seal_pages(pages)

    def verified(self, detector: Detector, count: int = 1) -> None:
        """``count`` requests verified by a detector the adapter runs (an engine's own)."""
        self._stats.add("verifications", (str(detector),), count)

    def skip(self, detector: Detector, reason: Skip, count: int = 1) -> None:
        """``count`` requests the detector did not verify, and why."""
        self._stats.add("verifications_skipped", (str(detector), str(reason)), count)

    def hook_failed(self, hook: Hook, count: int = 1) -> None:
        """An adapter's hook failed ``count`` times (its guard caught it; the engine went on)."""
        self._stats.add("hook_errors", (str(hook),), count)

    def engine_finding(
        self,
        detector: Detector,
        kind: Kind,
        request_id: str,
        detail: dict[str, int | str],
        *,
        enforced: bool,
        instance: str = "",
    ) -> None:
        """A mismatch the engine's own detector found: counted, and its event written."""
        self._stats.mismatch(str(detector), str(kind))
        self._reporter.engine_event(detector, kind, request_id, detail, enforced, instance)

    def counter(self, name: str, *labels: str) -> float:
        """A counter's value now (``name`` and label values as in the spool's ``counters``)."""
        return self._stats.get(name, *labels)

    def hook_seconds(self) -> dict[str, float]:
        """Time spent in each hook so far (the ``hook_seconds`` counter), by hook."""
        return {
            labels[0]: value
            for (name, labels), value in list(self._stats.values.items())
            if name == "hook_seconds"
        }

    # -- reporting ----------------------------------------------------------------------------

    def _settle(self, findings: list[Finding], before_read: bool = False) -> list[Verdict]:
        """Verdicts now on the host; on an accelerator, later through :meth:`resolve` (after
        the engine's read: ``before_read`` no longer holds)."""
        if self._on_device:
            self._pending.extend(findings)
            return []
        return [self._reporter.report(v) for v in stopped(self._verdicts(findings), before_read)]

    def _resolved(self, findings: list[Finding]) -> list[Verdict]:
        """The findings' verdicts, reported."""
        return [self._reporter.report(v) for v in self._verdicts(findings)]

    def _verdicts(self, findings: list[Finding]) -> list[Verdict]:
        """The findings' verdicts, not yet reported; a write into a free page as its late
        writer's."""
        out: list[Verdict] = []
        for finding in findings:
            verdicts = finding.resolve()
            if finding.kind == Canary.WRITE_TO_FREE_PAGE:
                verdicts = self._reporter.late_writers(verdicts, finding)
            out.extend(verdicts)
        return out

    def counter_series(self) -> list[list[Any]]:
        return self._snapshots.counter_series()

    def flush(self) -> None:
        """Write a cumulative snapshot of every counter (and the gauges) to the spool."""
        self._snapshots.flush()

    def close(self) -> None:
        """Final snapshot, stop the flush thread, close the spool. Idempotent."""
        self._snapshots.close()
