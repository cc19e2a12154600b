"""The detectors: canaries, transfer checksum, page tags, admission invariant, pool vs context.

Each detector has a :class:`Mode` and returns :class:`Verdict` objects that name the request, the
detector, the kind of mismatch and the pages. Each counts what it verified and what it skipped
(with a reason) in a shared :class:`Stats`. Checks that run on the engine's per-token path return
a :class:`Finding` that holds device tensors and is turned into a verdict only at a point where
the engine already synchronises; on CPU that is at once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import torch

from engine_hooks import canary
from engine_hooks.checksum import adler32
from engine_hooks.pagestate import Ints, Mask, PageState
from engine_hooks.pool import PagedKVPool, PageIds
from kvspool.catalogue import DETECTOR, KIND, SKIP_REASON, unsafe_band
from kvspool.records import Source

_MODE_OFF = SKIP_REASON.check("mode_off")
# Requests a seal may name as the residue of its last page (one, but a peer's list is capped).
_MAX_RESIDUE = 16

#: (request id, page count) per consecutive run of a check's pages, or a callable giving them.
Owners = list[tuple[str, int]] | Callable[[], list[tuple[str, int]]]
#: The request instance of each owner (or none), or a callable giving them, as ``Owners``.
Instances = tuple[str, ...] | Callable[[], tuple[str, ...]]


class Mode(StrEnum):
    OFF = "off"  # do nothing, count the request as skipped
    LOG = "log"  # count and record a mismatch, serve the request
    ENFORCE = "enforce"  # also fail the request, so its user gets an error, not others' data


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of one check. ``ok`` is False for a mismatch."""

    detector: str
    request_id: str
    ok: bool = True
    kind: str | None = None
    pages: tuple[int, ...] = ()
    mode: Mode = Mode.LOG
    detail: dict[str, int | str] = field(default_factory=dict)
    #: The request instance (one admission of ``request_id``), minted by the hooks; "" if none.
    instance: str = ""
    #: Whose data the failing pages held (the requests that last wrote them, never the reader
    #: itself), most pages first, at most ``MAX_EVENT_SOURCES``; the rest counted in
    #: ``other_sources`` and ``other_source_pages``. Filled by :class:`KVWatch` when it reports
    #: a finding of one of :data:`EXPOSING_KINDS` (once per instance, detector and kind).
    sources: tuple[Source, ...] = ()
    other_sources: int = 0
    other_source_pages: int = 0

    @property
    def blocks(self) -> bool:
        """True when the engine must fail the request (a mismatch in enforce mode)."""
        return not self.ok and self.mode is Mode.ENFORCE


@dataclass(frozen=True, slots=True)
class Seal:
    """What the writer of a transfer says it wrote: page count and Adler-32 over the pages.

    ``pages``, when given, holds one Adler-32 per page, in page order (``digest`` is then the
    Adler-32 of those digests): the reader can check any run of the pages, the ones its transport
    really delivered, and name exactly the pages that differ.
    """

    page_count: int
    digest: int
    pages: tuple[int, ...] = ()
    #: Requests (id, instance) whose KV may remain in the unwritten tail of the last sealed
    #: page: its previous holder, when the writer wrote fewer tokens than its pages hold. A
    #: reader that reads past the sealed pages reads that tail too (it is named as a source).
    residue: tuple[tuple[str, str], ...] = ()
    #: Per page, one digest per KV head, where the pool sees its heads
    #: (:class:`engine_hooks.heads.HeadedPool`): ``pages`` are composed from them, and a reader
    #: of another tensor-parallel width recombines the heads it holds.
    heads: tuple[tuple[int, ...], ...] = ()

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"page_count": self.page_count, "digest": self.digest}
        if self.pages:
            wire["pages"] = list(self.pages)
        if self.residue:
            wire["residue"] = [list(r) for r in self.residue]
        return wire

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Seal:
        pages = tuple(int(d) for d in data.get("pages") or ())
        # A peer's residue names requests only: malformed entries are dropped, at most 16 kept.
        residue = tuple(
            (str(r[0])[:128], str(r[1])[:128])
            for r in (data.get("residue") or ())[:_MAX_RESIDUE]
            if isinstance(r, list | tuple) and len(r) == 2
        )
        return cls(int(data["page_count"]), int(data["digest"]), pages, residue)

    def run(self, start: int, count: int) -> Seal:
        """The per-page seal of ``count`` pages from ``start`` (fewer when it has fewer)."""
        pages = self.pages[start : start + count]
        residue = self.residue if start + count >= self.page_count else ()
        return Seal(len(pages), page_digests_digest(pages), pages, residue)


def page_digests_digest(pages: Sequence[int]) -> int:
    return adler32(b"".join(int(d).to_bytes(4, "big") for d in pages))


class Stats:
    """Cumulative counters of one engine process, keyed by (name, label values)."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, tuple[str, ...]], float] = defaultdict(float)

    def add(self, name: str, labels: tuple[str, ...], amount: float = 1) -> None:
        self.values[(name, labels)] += amount

    def get(self, name: str, *labels: str) -> float:
        return self.values.get((name, labels), 0)

    def verified(self, detector: str, count: int = 1) -> None:
        self.add("verifications", (detector,), count)

    def skipped(self, detector: str, reason: str) -> None:
        self.add("verifications_skipped", (detector, reason))

    def mismatch(self, detector: str, kind: str) -> None:
        self.add("mismatches", (detector, kind))


@dataclass(slots=True)
class Finding:
    """A check whose result may still live on the device: ``bad`` masks the failing pages.

    ``owners`` splits ``pages`` into consecutive runs that belong to one request each, so one
    vectorised check can cover a whole decode batch; a callable gives them when a page fails
    (for a check resolved at once, so a clean one does not build them). ``instances`` (empty,
    or one per owner) names each run's request instance.
    """

    detector: str
    kind: str
    owners: Owners
    pages: Ints
    bad: Mask
    mode: Mode
    instances: Instances = ()
    #: The pages' tags when checked, where the verdict is resolved by them later (a write into
    #: a free page names its writer by the tag it left, before the next owner's write lands).
    tags: Ints | None = None

    @classmethod
    def single(
        cls,
        detector: str,
        kind: str,
        request_id: str,
        pages: Ints,
        bad: Mask,
        mode: Mode,
        instance: str = "",
    ) -> Finding:
        return cls(detector, kind, [(request_id, len(pages))], pages, bad, mode, (instance,))

    def clean(self) -> bool:
        if isinstance(self.bad, torch.Tensor):
            return not bool(self.bad.any())  # the host sync, where the caller allows one
        return not any(self.bad)

    def resolve(self) -> list[Verdict]:
        """The mismatch verdicts, one per request with a failing page (empty when clean)."""
        if self.clean():
            return []
        pages = self.pages.tolist() if isinstance(self.pages, torch.Tensor) else self.pages
        bad = self.bad.tolist() if isinstance(self.bad, torch.Tensor) else self.bad
        owners = self.owners() if callable(self.owners) else self.owners
        instances = self.instances() if callable(self.instances) else self.instances
        verdicts, start = [], 0
        for i, (request_id, count) in enumerate(owners):
            failing = tuple(
                p
                for p, b in zip(
                    pages[start : start + count], bad[start : start + count], strict=True
                )
                if b
            )
            start += count
            if failing:
                instance = instances[i] if instances else ""
                verdict = Verdict(self.detector, request_id, False, self.kind, failing, self.mode)
                verdicts.append(replace(verdict, instance=instance) if instance else verdict)
        return verdicts


class Detector:
    name = ""

    def __init__(self, stats: Stats, mode: Mode) -> None:
        self.stats = stats
        self.mode = mode

    def active(self) -> bool:
        """False (and the skip counted) when the detector is off."""
        if self.mode is Mode.OFF:
            self.stats.skipped(self.name, _MODE_OFF)
            return False
        return True

    def clean(self, request_id: str) -> Verdict:
        return Verdict(self.name, request_id, mode=self.mode)

    def mismatch(
        self, request_id: str, kind: str, pages: tuple[int, ...], **detail: int | str
    ) -> Verdict:
        return Verdict(self.name, request_id, False, kind, pages, self.mode, dict(detail))


class PageTags(Detector):
    """Page generations: bumped on every allocation, carried by every write, compared on read.

    A page's generation (the reader's own) is bumped whenever the page is allocated; a request
    snapshots the generations of its pages (its ``Ticket``). Whoever writes a page records the
    generation it wrote for in the pool's ``tag_store``, which an engine may place where remote
    writers reach it, or fill from the transfer's completion message. Before a read, every page
    must show the request's generation in both: a page nobody wrote for this request, a late
    write from an earlier owner, and a page reallocated while still referenced (stale page
    table, double free) all fail.
    """

    name = DETECTOR.check("page_tag")
    STALE_TAG = KIND.check("stale_tag")
    DOUBLE_FREE = KIND.check("double_free")
    #: The writer's side: pages it sent were freed before the remote read was confirmed.
    FREED_BEFORE_READ = KIND.check("freed_before_read")
    #: The reader's side: an aborted transfer's pages, freed before its writes were known to
    #: have stopped, were taken by other requests (a late write lands in their KV).
    FREED_BEFORE_DRAIN = KIND.check("freed_before_drain")

    def __init__(self, state: PageState, stats: Stats, mode: Mode) -> None:
        super().__init__(stats, mode)
        self.state = state

    def compare(
        self,
        owners: Owners,
        pages: Ints,
        expected: Ints,
        instances: Instances = (),
    ) -> Finding:
        bad = self.state.stale(pages, expected)
        return Finding(self.name, self.STALE_TAG, owners, pages, bad, self.mode, instances)

    def freed(self, pages: Ints, request_id: str = "") -> Finding:
        """Pages returning to the free list; one that is already free was freed twice."""
        twice = self.state.set_free(pages, True)
        return Finding.single(self.name, self.DOUBLE_FREE, request_id, pages, twice, self.mode)


class Canary(Detector):
    """Canary stamps on free pages and on reserved pages (see :mod:`engine_hooks.canary`)."""

    name = DETECTOR.check("canary")
    WRITE_TO_FREE_PAGE = KIND.check("write_to_free_page")
    UNWRITTEN_PAGE = KIND.check("unwritten_page")

    def __init__(self, pool: PagedKVPool, state: PageState, stats: Stats, mode: Mode) -> None:
        super().__init__(stats, mode)
        self.state = state
        self.usable = canary.supported(pool.kv_dtype) and pool.layer_page_bytes[0] >= (
            canary.STAMP_BYTES
        )

    def check_free(self, request_id: str, pages: Ints, gens: Ints) -> Finding:
        """Pages leaving the free list: a free stamp that changed means a write into a free page."""
        was_free = self.state.was_free(pages)
        intact = self.state.intact(pages, gens, canary.Purpose.FREE)
        if isinstance(was_free, torch.Tensor):
            assert isinstance(intact, torch.Tensor)
            bad: Mask = was_free & ~intact
        else:
            bad = [f and not i for f, i in zip(was_free, intact, strict=True)]
        # Logged, never enforced: the page's next owner rewrites it before anything reads it, and
        # the late writer's request is gone, so there is no request to fail.
        mode = Mode.LOG if self.mode is Mode.ENFORCE else self.mode
        return Finding.single(self.name, self.WRITE_TO_FREE_PAGE, request_id, pages, bad, mode)

    def check_reserved(
        self, request_id: str, pages: Ints, gens: Ints, instance: str = ""
    ) -> Finding:
        """Reserved pages at admit: an intact reserved stamp means nobody wrote the page."""
        bad = self.state.intact(pages, gens, canary.Purpose.RESERVED)
        return Finding.single(
            self.name, self.UNWRITTEN_PAGE, request_id, pages, bad, self.mode, instance
        )


class TransferChecksum(Detector):
    """Seal on the writer (page count + Adler-32 over the pages), verify on the reader."""

    name = DETECTOR.check("checksum")
    PAGE_COUNT = KIND.check("page_count")
    DIGEST = KIND.check("digest")
    LAYOUT_MISMATCH = KIND.check("layout_mismatch")

    def __init__(self, pool: PagedKVPool, stats: Stats, mode: Mode) -> None:
        super().__init__(stats, mode)
        self.pool = pool

    def seal(self, pages: PageIds) -> Seal:
        count = pages.numel() if isinstance(pages, torch.Tensor) else len(pages)
        return Seal(count, self.pool.checksum(pages))

    def seal_pages(self, pages: PageIds) -> Seal:
        """A seal with one digest per page (see :class:`Seal`), and per KV head where the pool
        sees its heads."""
        ids = pages.tolist() if isinstance(pages, torch.Tensor) else list(pages)
        heads = self.pool.head_digests(ids)
        if heads is None:
            digests = self.pool.page_digests(ids)
            return Seal(len(ids), page_digests_digest(digests), digests)
        digests = tuple(page_digests_digest(row) for row in heads)
        return Seal(len(ids), page_digests_digest(digests), digests, heads=heads)

    def layout_mismatch(
        self, request_id: str, pages: PageIds, detail: Mapping[str, int | str]
    ) -> Verdict:
        """The writer's pages mean something else than the reader's (``detail``: what differs):
        the bytes may arrive intact and still be read wrongly, so no digest is compared."""
        ids = tuple(pages.tolist() if isinstance(pages, torch.Tensor) else pages)
        return self.mismatch(request_id, self.LAYOUT_MISMATCH, ids, **detail)

    def verify(self, request_id: str, pages: PageIds, seal: Seal) -> Verdict:
        ids = tuple(pages.tolist() if isinstance(pages, torch.Tensor) else pages)
        if seal.page_count != len(ids):
            extra = ids[seal.page_count :] if seal.page_count < len(ids) else ids
            return self.mismatch(
                request_id,
                self.PAGE_COUNT,
                extra,
                sealed_pages=seal.page_count,
                held_pages=len(ids),
            )
        if seal.pages:
            read = self.pool.page_digests(ids)
            bad = tuple(p for p, d, r in zip(ids, seal.pages, read, strict=True) if r != d)
            if bad:
                return self.mismatch(request_id, self.DIGEST, bad, pages_differ=len(bad))
            return self.clean(request_id)
        digest = self.pool.checksum(ids)
        if digest != seal.digest:
            return self.mismatch(
                request_id, self.DIGEST, ids, sealed_digest=seal.digest, read_digest=digest
            )
        return self.clean(request_id)


#: The mismatch kinds in which the reader was given pages it did not write, so the pages' data
#: may be other requests' (their sources are named). Not a write into a free page: nobody read
#: it (the finding is its late writer's; a read of the page unwritten is one of these).
EXPOSING_KINDS = frozenset(
    {
        Canary.UNWRITTEN_PAGE,
        PageTags.STALE_TAG,
        TransferChecksum.DIGEST,
        TransferChecksum.PAGE_COUNT,
        # The sent request's remote reader may read what the requests that took them wrote.
        PageTags.FREED_BEFORE_READ,
        # The takers may read what the aborted request's late writes put in their pages.
        PageTags.FREED_BEFORE_DRAIN,
    }
)


class Admission(Detector):
    """An aborted request (``to_finish`` set) must not pass an admission queue.

    SGLang before v0.5.20 admitted on ``not req.finished()``, which reads ``finished_reason``
    and not ``to_finish``: a rejected request looked live on prefill and on decode.
    """

    name = DETECTOR.check("admission")
    ABORTED_ADMITTED = KIND.check("aborted_admitted")

    def check(self, request_id: str, queue: str, aborted: bool, finished: bool) -> Verdict:
        if aborted and not finished:
            self.stats.add("aborted_admissions", (queue,))
            return self.mismatch(request_id, self.ABORTED_ADMITTED, (), queue=queue)
        return self.clean(request_id)


@dataclass(frozen=True, slots=True)
class PoolReport:
    """Pool versus context: the unsafe band is the prompt lengths that pass the context check
    but do not fit the pool."""

    pool_tokens: int
    context_length_tokens: int
    page_size_tokens: int

    @property
    def unsafe_band_tokens(self) -> int:
        return unsafe_band(self.context_length_tokens, self.pool_tokens)

    @property
    def unsafe_share(self) -> float:
        if self.context_length_tokens <= 0:
            return 0.0
        return self.unsafe_band_tokens / self.context_length_tokens
