"""Per-page state behind the canary and page-tag detectors, in two backends.

(Over 450 lines: the two backends of one protocol stay side by side, method beside method, so
that a change to one is made and reviewed beside the other; the tests check them against each
other.)

``DevicePages`` keeps everything in tensors on the pool's device: every operation is a few
kernels and nothing waits for the device; results come back as bool tensors that the engine
reads at its own sync points. ``HostPages`` does the same for a pool in host memory with Python
integers over zero-copy views of the same storage: on a CPU a handful of small tensor ops costs
tens of microseconds, and these hooks sit on the engine's per-token path. Both implement
:class:`PageState`; the tests check them against each other.

State per physical page: ``generation`` (bumped on every allocation), ``written`` (the
generation the page was last written for: the pool's ``tag_store``), ``free`` (it carries a
free stamp), and the canary stamp in the first bytes of the page.

Whose data a page holds (the blast radius of a stale read) follows from the tags: the page
holds the KV of whoever owned the generation it was last written for. Beside the tags each page
keeps three *holder* slots, each a (request key, generation, time) triple: ``CURRENT`` for the
page's generation now, ``PREVIOUS`` for the one before (a late write for it can still land),
and ``WRITER`` for the last generation known to have been written before those. An allocation
rotates them (``bump``): the previous holder becomes the writer if the page's tag says its
write was the last one, the current becomes the previous. Request keys are small integers
(the hooks map them to request ids in a bounded table); no token ids, no content. ``sources``
reads a page's holder: ``NOBODY`` for a page never written since start-up or scrubbed (its
tag is 0), ``UNKNOWN`` where the writer's generation is older than the three slots remember
or its owner was not named.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from engine_hooks import canary
from engine_hooks.checksum import tensor_buffer
from engine_hooks.pool import PagedKVPool, PageIds

if TYPE_CHECKING:
    from engine_hooks.kernels import PageTables

# From this many pages on, the host backend computes canary stamps as arrays.
_BATCH_PAGES = 8

#: The holder slots of a page (see the module docstring), and the fields of a slot: request
#: key, generation, time in Unix milliseconds (one int64 array of ``[pages, slots, fields]``).
CURRENT, PREVIOUS, WRITER = 0, 1, 2
KEY, GEN, AT_MS = 0, 1, 2
_SLOTS = _FIELDS = 3
#: Request keys: a page whose data is nobody's (zeros: never written, or scrubbed), and one
#: whose writer the hooks cannot name.
NOBODY, UNKNOWN = 0, -1

#: Page ids or generations: a list of ints on the host backend, an int64 tensor on the device.
Ints = list[int] | torch.Tensor
#: Per-page booleans: a list on the host backend, a bool tensor on the device.
Mask = list[bool] | torch.Tensor
#: Who wrote pages: one request key for all, one per page, or nobody named.
Owner = int | Sequence[int] | None


class PageState(Protocol):
    def index(self, pages: PageIds) -> Ints: ...
    def concat(self, parts: Sequence[Ints]) -> Ints: ...
    def bump(self, pages: Ints, owner: int = UNKNOWN, now: float = 0.0) -> None: ...
    def generations(self, pages: Ints) -> Ints: ...
    def own_writes(self, pages: Ints, now: float | None = None, owner: Owner = None) -> None: ...
    def claim(self, pages: Ints, owner: int, now: float) -> None: ...
    def sources(
        self, pages: Ints, written: Ints | None = None
    ) -> tuple[list[int], list[float]]: ...
    def written_tags(self, pages: Ints) -> Ints: ...
    def land(self, pages: Ints, gens: Ints, unwritten: Mask | None = None) -> None: ...
    def repoint(self, pages: Ints, kept: Ints, tags: Ints) -> Ints | None: ...
    def scrub(self, pages: Ints) -> None: ...
    def scrub_tail(self, page: int, used: int) -> None: ...
    def stale(self, pages: Ints, expected: Ints) -> Mask: ...
    def set_free(self, pages: Ints, free: bool) -> Mask: ...
    def was_free(self, pages: Ints) -> Mask: ...
    def stamp(self, pages: Ints, gens: Ints, purpose: canary.Purpose) -> None: ...
    def intact(self, pages: Ints, gens: Ints, purpose: canary.Purpose) -> Mask: ...


def page_state(pool: PagedKVPool) -> PageState:
    return HostPages(pool) if pool.is_cpu else DevicePages(pool)


def _ms(now: float) -> int:
    return int(now * 1000)


def _tail_starts(pool: PagedKVPool, used: int) -> list[int]:
    """Per buffer, the byte where a page's token rows after the first ``used`` begin (a page is
    ``page_size`` equal rows in every buffer, token-major, in both layouts)."""
    return [width // pool.page_size * used for width in pool.layer_page_bytes]


def _kernels_available(device: torch.device) -> bool:
    if device.type == "cpu":
        return False  # the kernels run on CPU only when asked for (kernel=True, interpreter)
    from engine_hooks import kernels

    return kernels.available(device)


class DevicePages:
    def __init__(self, pool: PagedKVPool, *, kernel: bool | None = None) -> None:
        self.pool = pool
        n, device = pool.num_pages, pool.device
        self.generation = torch.zeros(n, dtype=torch.int64, device=device)
        self.written = pool.tag_store
        self.free = torch.zeros(n, dtype=torch.bool, device=device)
        self.holders = torch.zeros((n, _SLOTS, _FIELDS), dtype=torch.int64, device=device)
        self.stamp_area = pool.page_views[0][:, : canary.STAMP_BYTES]
        self._one = torch.ones(1, dtype=torch.int64, device=device)
        # The batched checks as one Triton launch each where triton runs on this device.
        self.kernels = kernel if kernel is not None else _kernels_available(device)
        self._tables: PageTables | None = None

    def index(self, pages: PageIds) -> torch.Tensor:
        return self.pool.as_index(pages)

    def _on_device(self, values: Ints) -> torch.Tensor:
        """int64 on the pool's device: a kernel reads raw pointers (a host tensor given to a
        GPU kernel is an illegal address) and mixes ids in 64-bit arithmetic."""
        return torch.as_tensor(values).to(device=self.pool.device, dtype=torch.int64)

    def concat(self, parts: Sequence[Ints]) -> torch.Tensor:
        return torch.cat([torch.as_tensor(p, device=self.pool.device) for p in parts])

    def bump(self, pages: Ints, owner: int = UNKNOWN, now: float = 0.0) -> None:
        """A new generation for each page (distinct pages), given to ``owner``."""
        index = torch.as_tensor(pages)
        if self.kernels:  # one launch instead of a dozen: this runs as decode grows
            from engine_hooks.kernels import bump

            bump(
                self.generation, self.written, self.holders, self._on_device(index), owner,
                _ms(now),
            )  # fmt: skip
            return
        rows = self.holders.index_select(0, index)
        written = self.written.index_select(0, index)
        last = (written != 0) & (written == rows[:, PREVIOUS, GEN])  # its write was the last
        new = torch.empty_like(rows)
        new[:, WRITER] = torch.where(last.unsqueeze(1), rows[:, PREVIOUS], rows[:, WRITER])
        new[:, PREVIOUS] = rows[:, CURRENT]
        self.generation.index_add_(0, index, self._one.expand(index.numel()))
        new[:, CURRENT, KEY] = owner
        new[:, CURRENT, GEN] = self.generation.index_select(0, index)
        new[:, CURRENT, AT_MS] = _ms(now)
        self.holders.index_copy_(0, index, new)

    def generations(self, pages: Ints) -> torch.Tensor:
        return self.generation.index_select(0, torch.as_tensor(pages))

    def own_writes(self, pages: Ints, now: float | None = None, owner: Owner = None) -> None:
        """The pages are written for their current generation (by ``owner``, where given: the
        claim in the same pass, as a decode step's own pages need; a sequence names each
        page's owner)."""
        index = torch.as_tensor(pages)
        self.written[index] = self.generation.index_select(0, index)
        self.holders[index, CURRENT, AT_MS] = _ms(time.time() if now is None else now)
        if isinstance(owner, int):
            self.holders[index, CURRENT, KEY] = owner
        elif owner is not None:
            keys = torch.tensor(owner, dtype=torch.int64)
            if self.holders.device.type == "cuda":
                # Pinned and async: a copy from pageable host memory would wait for the stream
                # (a sync on decode's per-step path); the caching host allocator keeps the
                # buffer until the copy is done.
                keys = keys.pin_memory().to(self.holders.device, non_blocking=True)
            self.holders[index, CURRENT, KEY] = keys.to(self.holders.device)

    def claim(self, pages: Ints, owner: int, now: float) -> None:
        """The pages' current generation belongs to ``owner`` (a request key)."""
        index = torch.as_tensor(pages)
        self.holders[index, CURRENT, KEY] = owner
        self.holders[index, CURRENT, AT_MS] = _ms(now)

    def written_tags(self, pages: Ints) -> torch.Tensor:
        """The pages' tags now (the generation each was last written for): one gather, no
        sync; :meth:`sources` given them later names who had written the pages then."""
        return self.written.index_select(0, torch.as_tensor(pages))

    def land(self, pages: Ints, gens: Ints, unwritten: Mask | None = None) -> None:
        """A write that carries no tags (or another engine's) wrote the pages for ``gens``,
        except those ``unwritten`` (a page it did not write keeps its tag). A select, no sync."""
        index = self.pool.as_index(pages)
        tags = torch.as_tensor(gens).to(device=self.pool.device, dtype=torch.int64)
        if unwritten is None:
            self.written[index] = tags
            return
        kept = torch.as_tensor(unwritten, device=self.pool.device)
        self.written[index] = torch.where(kept, self.written.index_select(0, index), tags)

    def repoint(self, pages: Ints, kept: Ints, tags: Ints) -> torch.Tensor:
        """A request's row reads ``pages`` now, where it read ``kept`` with ``tags``: its tags
        from now on. A page the engine re-pointed (its cache's copy of the same tokens) joins
        with its current generation, which its owner vouches for, and is written for it; a page
        left in place keeps its tag. One select, no sync."""
        index = torch.as_tensor(pages)
        fresh = self.generations(index)
        same = index == torch.as_tensor(kept, device=index.device)
        self.land(index, fresh, same)
        return torch.where(same, torch.as_tensor(tags, device=index.device), fresh)

    def sources(self, pages: Ints, written: Ints | None = None) -> tuple[list[int], list[float]]:
        """Per page, the key of the request whose data it holds and when (read on the host:
        call only where the engine synchronises); by the tags ``written`` where given (taken
        earlier by :meth:`written_tags`), else by the pages' tags now."""
        index = torch.as_tensor(pages)
        rows = self.holders.index_select(0, index)
        written = (
            self.written.index_select(0, index) if written is None else self._on_device(written)
        )
        match = rows[:, :, GEN] == written.unsqueeze(1)
        found = match.any(dim=1) & (written != 0)
        slot = match.to(torch.int8).argmax(dim=1, keepdim=True)
        key = rows[:, :, KEY].gather(1, slot).squeeze(1)
        at = rows[:, :, AT_MS].gather(1, slot).squeeze(1)
        key = torch.where(found, key, torch.where(written == 0, NOBODY, UNKNOWN))
        at = torch.where(found, at, 0)
        return key.tolist(), [ms / 1000 for ms in at.tolist()]

    def scrub(self, pages: Ints) -> None:
        """Zero every byte of the pages in every buffer and mark them never written: one
        launch where the kernels run, else one fill per buffer; no sync either way."""
        index = torch.as_tensor(pages)
        if self.kernels:
            from engine_hooks.kernels import PageTables, scrub

            if self._tables is None:
                self._tables = PageTables(self.pool.page_views)
            scrub(self._tables, self._on_device(index))
        else:
            for view in self.pool.page_views:
                view.index_fill_(0, index, 0)
        self.written[index] = 0

    def scrub_tail(self, page: int, used: int) -> None:
        """Zero the tail of one page after its first ``used`` token rows, in every buffer."""
        for view, start in zip(self.pool.page_views, _tail_starts(self.pool, used), strict=True):
            view[page, start:].zero_()

    def stale(self, pages: Ints, expected: Ints) -> torch.Tensor:
        index, want = torch.as_tensor(pages), torch.as_tensor(expected)
        if self.kernels:
            from engine_hooks.kernels import stale_tags

            return stale_tags(
                self.generation, self.written, self._on_device(index), self._on_device(want)
            )
        return (self.generation.index_select(0, index) != want) | (
            self.written.index_select(0, index) != want
        )

    def was_free(self, pages: Ints) -> torch.Tensor:
        return self.free.index_select(0, torch.as_tensor(pages))

    def set_free(self, pages: Ints, free: bool) -> torch.Tensor:
        index = torch.as_tensor(pages)
        before = self.free.index_select(0, index)
        self.free[index] = free
        return before

    def _stamps(self, pages: Ints, gens: Ints, purpose: canary.Purpose) -> torch.Tensor:
        return canary.stamps(
            torch.as_tensor(pages), torch.as_tensor(gens), purpose, self.pool.kv_dtype
        )

    def stamp(self, pages: Ints, gens: Ints, purpose: canary.Purpose) -> None:
        if self.kernels:
            from engine_hooks.kernels import canary as kernel

            kernel(
                self.stamp_area,
                self._on_device(pages),
                self._on_device(gens),
                purpose,
                self.pool.kv_dtype,
                stamp=True,
            )
            return
        self.stamp_area[torch.as_tensor(pages)] = self._stamps(pages, gens, purpose)

    def intact(self, pages: Ints, gens: Ints, purpose: canary.Purpose) -> torch.Tensor:
        if self.kernels:
            from engine_hooks.kernels import canary as kernel

            return kernel(
                self.stamp_area,
                self._on_device(pages),
                self._on_device(gens),
                purpose,
                self.pool.kv_dtype,
                stamp=False,
            )
        current = self.stamp_area.index_select(0, torch.as_tensor(pages))
        return (current == self._stamps(pages, gens, purpose)).all(dim=1)


class HostPages:
    def __init__(self, pool: PagedKVPool) -> None:
        self.pool = pool
        # Tensors for batch checks, with int views of the same memory for per-page work.
        self.generation_t = torch.zeros(pool.num_pages, dtype=torch.int64)
        self.generation = tensor_buffer(self.generation_t).cast("q")
        self.written = tensor_buffer(pool.tag_store).cast("q")
        self.free = bytearray(pool.num_pages)
        self.holders_t = torch.zeros((pool.num_pages, _SLOTS, _FIELDS), dtype=torch.int64)
        self.holders = tensor_buffer(self.holders_t).cast("q")
        # The same memory as arrays, for batches of pages (a prompt's pages at alloc, seal).
        self.holders_np = self.holders_t.numpy()
        self.generation_np = self.generation_t.numpy()
        self.written_np = pool.tag_store.numpy()
        self.stamp_view = tensor_buffer(pool.page_views[0])
        self.stamp_rows = pool.page_views[0].numpy()  # the same bytes, for batches of pages
        self.page_rows = [view.numpy() for view in pool.page_views]
        self.width = pool.layer_page_bytes[0]
        self.kv_dtype = pool.kv_dtype

    def index(self, pages: PageIds) -> list[int]:
        ids = pages.tolist() if isinstance(pages, torch.Tensor) else [int(p) for p in pages]
        self.pool.check_ids(ids)
        return ids

    def concat(self, parts: Sequence[Ints]) -> list[int]:
        out: list[int] = []
        for part in parts:
            out.extend(part.tolist() if isinstance(part, torch.Tensor) else part)
        return out

    @staticmethod
    def _ints(values: Ints) -> list[int]:
        return values.tolist() if isinstance(values, torch.Tensor) else values

    def bump(self, pages: Ints, owner: int = UNKNOWN, now: float = 0.0) -> None:
        if len(pages) >= _BATCH_PAGES:  # as arrays; the same steps as the loop below
            ids = np.asarray(self._ints(pages), dtype=np.int64)
            rows = self.holders_np[ids]
            written_ = self.written_np[ids]
            last = (written_ != 0) & (written_ == rows[:, PREVIOUS, GEN])
            rows[last, WRITER] = rows[last, PREVIOUS]
            rows[:, PREVIOUS] = rows[:, CURRENT]
            self.generation_np[ids] += 1
            rows[:, CURRENT, KEY] = owner
            rows[:, CURRENT, GEN] = self.generation_np[ids]
            rows[:, CURRENT, AT_MS] = _ms(now)
            self.holders_np[ids] = rows
            return
        gen, written, h, at = self.generation, self.written, self.holders, _ms(now)
        size = _SLOTS * _FIELDS
        current, previous, writer = CURRENT * _FIELDS, PREVIOUS * _FIELDS, WRITER * _FIELDS
        for p in self._ints(pages):
            base = p * size
            w = written[p]
            if w and w == h[base + previous + GEN]:  # the previous holder's write was the last
                h[base + writer : base + writer + _FIELDS] = h[
                    base + previous : base + previous + _FIELDS
                ]
            h[base + previous : base + previous + _FIELDS] = h[
                base + current : base + current + _FIELDS
            ]
            gen[p] += 1
            h[base + current + KEY] = owner
            h[base + current + GEN] = gen[p]
            h[base + current + AT_MS] = at

    def generations(self, pages: Ints) -> list[int]:
        return [self.generation[p] for p in self._ints(pages)]

    def own_writes(self, pages: Ints, now: float | None = None, owner: Owner = None) -> None:
        at = _ms(time.time() if now is None else now)
        if len(pages) >= _BATCH_PAGES:
            ids = np.asarray(self._ints(pages), dtype=np.int64)
            self.written_np[ids] = self.generation_np[ids]
            self.holders_np[ids, CURRENT, AT_MS] = at
            if owner is not None:
                self.holders_np[ids, CURRENT, KEY] = owner
            return
        h, stride = self.holders, _SLOTS * _FIELDS
        listed = self._ints(pages)
        owners = [owner] * len(listed) if owner is None or isinstance(owner, int) else owner
        for p, key in zip(listed, owners, strict=True):
            self.written[p] = self.generation[p]
            h[p * stride + CURRENT * _FIELDS + AT_MS] = at
            if key is not None:
                h[p * stride + CURRENT * _FIELDS + KEY] = key

    def claim(self, pages: Ints, owner: int, now: float) -> None:
        if len(pages) >= _BATCH_PAGES:
            ids = np.asarray(self._ints(pages), dtype=np.int64)
            self.holders_np[ids, CURRENT, KEY] = owner
            self.holders_np[ids, CURRENT, AT_MS] = _ms(now)
            return
        at, h, stride = _ms(now), self.holders, _SLOTS * _FIELDS
        for p in self._ints(pages):
            h[p * stride + CURRENT * _FIELDS + KEY] = owner
            h[p * stride + CURRENT * _FIELDS + AT_MS] = at

    def written_tags(self, pages: Ints) -> list[int]:
        return [self.written[p] for p in self._ints(pages)]

    def repoint(self, pages: Ints, kept: Ints, tags: Ints) -> list[int] | None:
        """As :meth:`DevicePages.repoint`; None when no page moved."""
        ids, old, old_tags = self._ints(pages), self._ints(kept), self._ints(tags)
        if ids == old:
            return None
        fresh = self.generations(ids)
        self.own_writes([p for p, q in zip(ids, old, strict=True) if p != q])
        return [t if p == q else f for p, q, t, f in zip(ids, old, old_tags, fresh, strict=True)]

    def land(self, pages: Ints, gens: Ints, unwritten: Mask | None = None) -> None:
        if unwritten is None:
            self.pool.mark_written(pages, gens)
            return
        written = [
            (page, tag) for page, tag, skip in zip(pages, gens, unwritten, strict=True) if not skip
        ]
        if written:
            self.pool.mark_written([p for p, _ in written], [t for _, t in written])

    def sources(self, pages: Ints, written: Ints | None = None) -> tuple[list[int], list[float]]:
        h, stride = self.holders, _SLOTS * _FIELDS
        keys: list[int] = []
        times: list[float] = []
        ids = self._ints(pages)
        tags = None if written is None else self._ints(written)
        for i, p in enumerate(ids):
            w = self.written[p] if tags is None else tags[i]
            key, at = (NOBODY if w == 0 else UNKNOWN), 0.0
            if w:
                for slot in (CURRENT, PREVIOUS, WRITER):
                    base = p * stride + slot * _FIELDS
                    if h[base + GEN] == w:
                        key, at = h[base + KEY], h[base + AT_MS] / 1000
                        break
            keys.append(key)
            times.append(at)
        return keys, times

    def scrub(self, pages: Ints) -> None:
        ids = np.asarray(self._ints(pages), dtype=np.int64)
        if not ids.size:
            return
        # Runs of consecutive ids (a free list hands out and takes back runs) as one memset
        # each: more bandwidth than a gather-scatter over the same rows (docs/performance.md).
        breaks = np.flatnonzero(np.diff(ids) != 1) + 1
        if len(breaks) < ids.size // 4:
            starts = np.concatenate(([0], breaks)).tolist()
            ends = np.concatenate((breaks, [ids.size])).tolist()
            first = ids.tolist()
            for rows in self.page_rows:
                for a, b in zip(starts, ends, strict=True):
                    rows[first[a] : first[a] + b - a] = 0
        else:
            for rows in self.page_rows:
                rows[ids] = 0
        self.written_np[ids] = 0

    def scrub_tail(self, page: int, used: int) -> None:
        for rows, start in zip(self.page_rows, _tail_starts(self.pool, used), strict=True):
            rows[page, start:] = 0

    def stale(self, pages: Ints, expected: Ints) -> Mask:
        if isinstance(pages, torch.Tensor):  # a whole decode batch: vectorised
            want = torch.as_tensor(expected)
            return (self.generation_t.index_select(0, pages) != want) | (
                self.pool.tag_store.index_select(0, pages) != want
            )
        gen, written = self.generation, self.written
        return [
            gen[p] != e or written[p] != e
            for p, e in zip(self._ints(pages), self._ints(expected), strict=True)
        ]

    def was_free(self, pages: Ints) -> list[bool]:
        return [bool(self.free[p]) for p in self._ints(pages)]

    def set_free(self, pages: Ints, free: bool) -> list[bool]:
        before = []
        for p in self._ints(pages):
            before.append(bool(self.free[p]))
            self.free[p] = free
        return before

    def _batch_stamps(
        self, pages: Ints, gens: Ints, purpose: canary.Purpose
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Page ids and their stamps as arrays, for a batch large enough that a few array ops
        beat a Python loop (a prompt's pages at reserve, admit, free); None for a few pages."""
        if len(pages) < _BATCH_PAGES:
            return None
        ids = np.asarray(pages, dtype=np.int64)
        rows = canary.stamps(
            torch.from_numpy(ids), torch.from_numpy(np.asarray(gens, dtype=np.int64)), purpose,
            self.kv_dtype,
        )  # fmt: skip
        return ids, rows.numpy()

    def stamp(self, pages: Ints, gens: Ints, purpose: canary.Purpose) -> None:
        batch = self._batch_stamps(pages, gens, purpose)
        if batch is not None:
            ids, rows = batch
            self.stamp_rows[ids, : canary.STAMP_BYTES] = rows
            return
        view, width, n = self.stamp_view, self.width, canary.STAMP_BYTES
        for p, g in zip(self._ints(pages), self._ints(gens), strict=True):
            view[p * width : p * width + n] = canary.stamp_bytes(p, g, purpose, self.kv_dtype)

    def intact(self, pages: Ints, gens: Ints, purpose: canary.Purpose) -> list[bool]:
        batch = self._batch_stamps(pages, gens, purpose)
        if batch is not None:
            ids, rows = batch
            same = self.stamp_rows[ids, : canary.STAMP_BYTES] == rows
            return same.all(axis=1).tolist()  # type: ignore[no-any-return]
        view, width, n = self.stamp_view, self.width, canary.STAMP_BYTES
        return [
            view[p * width : p * width + n] == canary.stamp_bytes(p, g, purpose, self.kv_dtype)
            for p, g in zip(self._ints(pages), self._ints(gens), strict=True)
        ]
