"""Reporting a mismatch: counted, written to the spool once, with whose KV its pages held.

:class:`Reporter` is :class:`~engine_hooks.watch.KVWatch`'s: it counts each mismatch and writes
its event record once per request instance, detector and kind.

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
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from engine_hooks.detectors import EXPOSING_KINDS, Finding, Stats, Verdict
from engine_hooks.pagestate import NOBODY, UNKNOWN, PageState
from engine_hooks.spool import SpoolWriter
from engine_hooks.tickets import RequestKeys
from kvspool import schema
from kvspool.records import STOPPED_BEFORE_READ, Source

#: Mismatches already reported, remembered so a request instance is reported once per detector
#: and kind.
REMEMBERED_REPORTS = 4096


class Reporter:
    """Counts and writes the mismatches of one :class:`~engine_hooks.watch.KVWatch`."""

    def __init__(
        self,
        state: PageState | None,
        requests: RequestKeys,
        stats: Stats,
        spool: SpoolWriter | None,
        written: threading.Event,
    ) -> None:
        self.state = state
        self.requests = requests
        self.stats = stats
        self.spool = spool
        #: Set when an event is written: the flush thread then writes the counters at once.
        self.written = written
        self._reported: OrderedDict[tuple[str, str, str], None] = OrderedDict()

    def late_writers(self, verdicts: list[Verdict], finding: Finding) -> list[Verdict]:
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
                detail["next_owner"] = text(verdict.request_id)
            for (rid, instance), pages in sorted(writers.items()):
                out.append(
                    replace(
                        verdict, request_id=rid, instance=instance, pages=tuple(pages),
                        detail=detail,
                    )
                )  # fmt: skip
        return out

    def report(
        self, verdict: Verdict, residue: Sequence[tuple[str, str]] = (), *, exposed: bool = False
    ) -> Verdict:
        """Count a mismatch and write its event record, once per request instance, detector and
        kind: a stale page found at admit is found again at every decode step of the same
        request. The instance, not the request id: two requests may share an id. ``exposed``:
        the verdict's sources are named already (:meth:`named`)."""
        key = (verdict.instance, verdict.detector, verdict.kind or "other")
        if verdict.instance and key in self._reported:
            return verdict
        if verdict.instance:
            self._reported[key] = None
            if len(self._reported) > REMEMBERED_REPORTS:
                self._reported.popitem(last=False)
        if not exposed:
            verdict = self.expose(verdict, residue)
        self.stats.mismatch(verdict.detector, verdict.kind or "other")
        if self.spool is not None:
            record: dict[str, Any] = {
                "detector": verdict.detector,
                "kind": verdict.kind or "other",
                "mode": str(verdict.mode),
                "action": "enforced" if verdict.blocks else "logged",
                "request_id": text(verdict.request_id),
                "pages": list(verdict.pages[: schema.MAX_EVENT_PAGES]),
                "pages_total": len(verdict.pages),
                "detail": verdict.detail,
            }
            if verdict.instance:
                record["instance"] = text(verdict.instance)
            if verdict.kind in EXPOSING_KINDS:
                record["sources"] = [_source_record(s) for s in verdict.sources]
                record["other_sources"] = verdict.other_sources
                record["other_source_pages"] = verdict.other_source_pages
            self.spool.write(schema.EVENT, record)
            self.written.set()
        return verdict

    def expose(self, verdict: Verdict, residue: Sequence[tuple[str, str]] = ()) -> Verdict:
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
        detail = verdict.detail
        if unattributed:
            detail = {**detail, "unattributed_pages": unattributed}
        sources = [
            Source(
                request_id=rid,
                pages=int(count),
                instance=instance or None,
                written_at=max(0.0, at),
            )
            for (rid, instance), (count, at) in held.items()
        ]
        return self.named(replace(verdict, detail=detail), sources)

    def named(self, verdict: Verdict, sources: Sequence[Source]) -> Verdict:
        """The verdict with ``sources`` as whose data its pages held: most pages first, at most
        ``MAX_EVENT_SOURCES``, the rest counted (``other_sources``, ``other_source_pages``)."""
        ranked = sorted(sources, key=lambda s: (-s.pages, s.request_id, s.instance or ""))
        top, rest = ranked[: schema.MAX_EVENT_SOURCES], ranked[schema.MAX_EVENT_SOURCES :]
        return replace(
            verdict,
            sources=tuple(top),
            other_sources=len(rest),
            other_source_pages=int(sum(s.pages for s in rest)),
        )

    def engine_event(
        self,
        detector: str,
        kind: str,
        request_id: str,
        detail: dict[str, int | str],
        enforced: bool,
        instance: str = "",
    ) -> None:
        """The event of an engine's own detector's finding (no pages: the engine names none)."""
        if self.spool is None:
            return
        record: dict[str, Any] = {
            "detector": str(detector),
            "kind": str(kind),
            "mode": "log",
            "action": "enforced" if enforced else "logged",
            "request_id": request_id[:128],
            "pages": [],
            "pages_total": 0,
            "detail": detail,
        }
        if instance:
            record["instance"] = instance
        self.spool.write(schema.EVENT, record)


def stopped(verdicts: list[Verdict], before_read: bool) -> list[Verdict]:
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


def text(value: str) -> str:
    """An id as the spool takes it: valid UTF-8 (a lone surrogate, which UTF-8 cannot hold, as
    its escape: the record would be refused whole) and at most 128 characters."""
    return value.encode("utf-8", "backslashreplace").decode("utf-8")[:128]


def _source_record(source: Source) -> dict[str, Any]:
    record: dict[str, Any] = {
        "request_id": text(source.request_id),
        "pages": source.pages,
        "written_at": source.written_at,
    }
    if source.instance:
        record["instance"] = text(source.instance)
    return record
