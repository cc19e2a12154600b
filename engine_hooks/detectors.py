"""The detectors: canaries, transfer checksum, page tags, admission invariant, pool vs context.

Each detector has a :class:`Mode` and returns :class:`Verdict` objects that name the request, the
detector, the kind of mismatch and the pages. Each counts what it verified and what it skipped
(with a reason) in a shared :class:`Stats`. Checks that run on the engine's per-token path return
a :class:`Finding` that holds device tensors and is turned into a verdict only at a point where
the engine already synchronises; on CPU that is at once.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from engine_hooks import canary
from engine_hooks.pool import PagedKVPool, PageIds


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

    @property
    def blocks(self) -> bool:
        """True when the engine must fail the request (a mismatch in enforce mode)."""
        return not self.ok and self.mode is Mode.ENFORCE


@dataclass(frozen=True, slots=True)
class Seal:
    """What the writer of a transfer says it wrote: page count and Adler-32 over the pages."""

    page_count: int
    digest: int

    def to_wire(self) -> dict[str, int]:
        return {"page_count": self.page_count, "digest": self.digest}

    @classmethod
    def from_wire(cls, data: dict[str, int]) -> Seal:
        return cls(int(data["page_count"]), int(data["digest"]))


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
    """A check whose result may still live on the device. ``bad`` masks the failing pages."""

    detector: str
    kind: str
    request_id: str
    pages: torch.Tensor
    bad: torch.Tensor
    mode: Mode

    def resolve(self) -> Verdict:
        """Read the result (a host sync on an accelerator) and return the verdict."""
        bad_pages = tuple(int(p) for p in self.pages[self.bad].tolist())
        if not bad_pages:
            return Verdict(self.detector, self.request_id, mode=self.mode)
        return Verdict(self.detector, self.request_id, False, self.kind, bad_pages, self.mode)


class Detector:
    name = ""

    def __init__(self, stats: Stats, mode: Mode) -> None:
        self.stats = stats
        self.mode = mode

    def active(self) -> bool:
        """False (and the skip counted) when the detector is off."""
        if self.mode is Mode.OFF:
            self.stats.skipped(self.name, "mode_off")
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

    ``generation[page]`` (the reader's own) is bumped whenever the page is allocated; a request
    snapshots the generations of its pages (its :class:`Ticket`). Whoever writes a page records
    the generation it wrote for in ``written[page]`` (the pool's ``tag_store``, which an engine
    may place where remote writers reach it, or fill from the transfer's completion message).
    Before a read, every page must show the request's generation in both: a page nobody wrote
    for this request, a late write from an earlier owner, and a page reallocated while still
    referenced (stale page table, double free) all fail.
    """

    name = "page_tag"

    def __init__(self, pool: PagedKVPool, stats: Stats, mode: Mode) -> None:
        super().__init__(stats, mode)
        self.pool = pool
        self.generation = torch.zeros(pool.num_pages, dtype=torch.int64, device=pool.device)
        self.written = pool.tag_store
        self._one = torch.ones(1, dtype=torch.int64, device=pool.device)

    def bump(self, index: torch.Tensor) -> None:
        self.generation.index_add_(0, index, self._one.expand(index.numel()))

    def snapshot(self, index: torch.Tensor) -> torch.Tensor:
        return self.generation.index_select(0, index)

    def own_writes(self, index: torch.Tensor) -> None:
        """The reader itself writes these pages (e.g. decode's own new tokens)."""
        self.written[index] = self.generation.index_select(0, index)

    def compare(self, request_id: str, index: torch.Tensor, expected: torch.Tensor) -> Finding:
        bad = (self.generation.index_select(0, index) != expected) | (
            self.written.index_select(0, index) != expected
        )
        return Finding(self.name, "stale_tag", request_id, index, bad, self.mode)


class Canary(Detector):
    """Canary stamps on free pages and on reserved pages (see :mod:`engine_hooks.canary`)."""

    name = "canary"

    def __init__(self, pool: PagedKVPool, stats: Stats, mode: Mode) -> None:
        super().__init__(stats, mode)
        self.pool = pool
        self.usable = canary.supported(pool.kv_dtype) and pool.layer_page_bytes[0] >= (
            canary.STAMP_BYTES
        )
        # The stamp area of every page: a strided view into the pool's first buffer.
        self.stamp_area = pool.page_views[0][:, : canary.STAMP_BYTES]
        # Pages that carry an intact free stamp as far as we know (set on free, cleared on alloc).
        self.free_stamped = torch.zeros(pool.num_pages, dtype=torch.bool, device=pool.device)

    def _stamps(
        self, index: torch.Tensor, gens: torch.Tensor, purpose: canary.Purpose
    ) -> torch.Tensor:
        return canary.stamps(index, gens, purpose, self.pool.kv_dtype)

    def stamp(self, index: torch.Tensor, gens: torch.Tensor, purpose: canary.Purpose) -> None:
        self.stamp_area[index] = self._stamps(index, gens, purpose)

    def intact(
        self, index: torch.Tensor, gens: torch.Tensor, purpose: canary.Purpose
    ) -> torch.Tensor:
        """Per page, True where the stamp is still exactly as written."""
        current = self.stamp_area.index_select(0, index)
        return (current == self._stamps(index, gens, purpose)).all(dim=1)

    def check_free(self, request_id: str, index: torch.Tensor, gens: torch.Tensor) -> Finding:
        """Pages leaving the free list: a free stamp that changed means a write into a free page."""
        was_stamped = self.free_stamped.index_select(0, index)
        bad = was_stamped & ~self.intact(index, gens, canary.Purpose.FREE)
        return Finding(self.name, "write_to_free_page", request_id, index, bad, self.mode)

    def check_reserved(self, request_id: str, index: torch.Tensor, gens: torch.Tensor) -> Finding:
        """Reserved pages at admit: an intact reserved stamp means nobody wrote the page."""
        bad = self.intact(index, gens, canary.Purpose.RESERVED)
        return Finding(self.name, "unwritten_page", request_id, index, bad, self.mode)


class TransferChecksum(Detector):
    """Seal on the writer (page count + Adler-32 over the pages), verify on the reader."""

    name = "checksum"

    def __init__(self, pool: PagedKVPool, stats: Stats, mode: Mode) -> None:
        super().__init__(stats, mode)
        self.pool = pool

    def seal(self, pages: PageIds) -> Seal:
        count = pages.numel() if isinstance(pages, torch.Tensor) else len(pages)
        return Seal(count, self.pool.checksum(pages))

    def verify(self, request_id: str, pages: PageIds, seal: Seal) -> Verdict:
        ids = tuple(pages.tolist() if isinstance(pages, torch.Tensor) else pages)
        if seal.page_count != len(ids):
            extra = ids[seal.page_count :] if seal.page_count < len(ids) else ids
            return self.mismatch(
                request_id, "page_count", extra, sealed_pages=seal.page_count, held_pages=len(ids)
            )
        digest = self.pool.checksum(ids)
        if digest != seal.digest:
            return self.mismatch(
                request_id, "digest", ids, sealed_digest=seal.digest, read_digest=digest
            )
        return self.clean(request_id)


class Admission(Detector):
    """An aborted request (``to_finish`` set) must not pass an admission queue.

    SGLang before v0.5.20 admitted on ``not req.finished()``, which reads ``finished_reason``
    and not ``to_finish``: a rejected request looked live on prefill and on decode.
    """

    name = "admission"

    def check(self, request_id: str, queue: str, aborted: bool, finished: bool) -> Verdict:
        if aborted and not finished:
            self.stats.add("aborted_admissions", (queue,))
            return self.mismatch(request_id, "aborted_admitted", (), queue=queue)
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
        return max(0, self.context_length_tokens - self.pool_tokens)

    @property
    def unsafe_share(self) -> float:
        if self.context_length_tokens <= 0:
            return 0.0
        return self.unsafe_band_tokens / self.context_length_tokens
