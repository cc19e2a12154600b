"""Seals per (page, KV head): digests that a reader of any tensor-parallel width recombines.

With tensor parallelism each rank holds a slice of the KV heads, and the two sides of a PD pair
may slice differently (prefill TP 1, decode TP 2: decode rank 1 holds heads 2-3 of prefill rank
0's 0-3). A digest over a rank's whole page names bytes that no reader rank holds, so the seal is
one Adler-32 per page *and KV head*: over that head's cells in logical order (layer by layer, then
token, then content: K then V), whatever the physical layout (HND, NHD, layer- or block-outermost).
Each reader rank composes its own page digest from the heads it holds
(:func:`~engine_hooks.detectors.page_digests_digest` over their digests, in head order) and
computes the same from its own pages: a writer of any width, a reader of any width.

The wire cost is 4 bytes per page and KV head held by the writer (base64 on the wire: 5.33), e.g.
43 bytes a block for 8 KV heads; the KV it seals is some 10^5 times larger.

On a GPU the sums run as torch ops on the pool's device (one row per (page, head), Adler-32's
own recurrence, no Python loop over bytes); on the CPU zlib-ng's SIMD Adler-32 runs over each
row. Both are bit-identical to ``zlib.adler32`` over the concatenated cells; only the digests
reach the host, once per seal or verification, never per token.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from engine_hooks.checksum import BASE, adler32
from engine_hooks.detectors import page_digests_digest
from engine_hooks.pool import Layout, PagedKVPool, PageIds

# Elements widened to int32 at once (bounds the temporary memory, as checksum.AdlerState).
_BATCH_ELEMENTS = 1 << 24


class RowAdler:
    """One running Adler-32 per row, as int64 tensors on the data's device: ``fold`` appends
    each row's next bytes (``a += S``, ``b += n*a + W``, with ``S`` the bytes' sum and ``W`` their
    weighted sum, byte ``i`` of ``n`` weighing ``n - i``)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.a = torch.ones(rows, dtype=torch.int64, device=device)
        self.b = torch.zeros(rows, dtype=torch.int64, device=device)
        self._weights: dict[int, torch.Tensor] = {}

    def _weight(self, n: int) -> torch.Tensor:
        weight = self._weights.get(n)
        if weight is None:
            weight = torch.arange(n, 0, -1, dtype=torch.int64, device=self.a.device) % BASE
            weight = self._weights[n] = weight.to(torch.int32)
        return weight

    def fold(self, data: torch.Tensor, first: int = 0) -> None:
        """Append ``data`` (``[rows, n]`` uint8) to rows ``first`` ... ``first + rows - 1``."""
        rows, n = data.shape
        if not rows or not n:
            return
        wide = data.to(torch.int32)
        sums = wide.sum(dim=1, dtype=torch.int64) % BASE
        weighted = (wide * self._weight(n)).sum(dim=1, dtype=torch.int64) % BASE
        a, b = self.a[first : first + rows], self.b[first : first + rows]
        b.copy_((b + (n % BASE) * a + weighted) % BASE)
        a.copy_((a + sums) % BASE)

    def digests(self) -> torch.Tensor:
        return (self.b << 16) | self.a


def _cells(view: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The pages ``index`` of a ``[pages, heads, ...]`` view as ``[pages * heads, bytes]`` uint8,
    each row one head's cells in logical order (a copy: the layout's strides are resolved)."""
    picked = view.index_select(0, index).contiguous()
    return picked.view(torch.uint8).reshape(picked.shape[0] * picked.shape[1], -1)


class HeadedPool(PagedKVPool):
    """A pool whose pages are also seen per KV head: ``head_views`` are per-layer
    ``[num_pages, heads, ...]`` views of the same storage (head at dim 1, the rest the head's cells
    in logical order), ``heads`` the global KV heads this rank holds (``head_start`` on).

    Its page digest is composed from its heads' digests, so a reader's digest of its page equals
    the one a writer's per-head seal gives for the same heads (see the module docstring)."""

    def __init__(
        self,
        buffers: Sequence[torch.Tensor],
        page_size: int,
        head_views: Sequence[torch.Tensor],
        *,
        head_start: int = 0,
        layout: Layout | str = Layout.TOKENS,
        kv_dtype: torch.dtype | None = None,
        tag_store: torch.Tensor | None = None,
    ) -> None:
        super().__init__(buffers, page_size, layout=layout, kv_dtype=kv_dtype, tag_store=tag_store)
        if not head_views:
            raise ValueError("a headed pool needs at least one head view")
        heads = {int(v.shape[1]) for v in head_views}
        if len(heads) != 1 or any(v.shape[0] != self.num_pages for v in head_views):
            raise ValueError("head views disagree on pages or heads")
        self.head_views = list(head_views)
        self.head_count = heads.pop()
        self.head_start = head_start

    def head_digests(self, pages: PageIds) -> tuple[tuple[int, ...], ...]:
        """Per page, in order, the Adler-32 of each of its heads (this rank's, in head order)."""
        index = self.as_index(pages)
        count = int(index.numel())
        if not count:
            return ()
        if self.device.type == "cpu":
            return self._host_head_digests(index, count)
        return self._device_head_digests(index, count)

    def _row_batches(self, index: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """Layer by layer, the pages ``index`` as ``(first row, [rows, bytes] uint8)`` batches,
        one row per (page, head) in logical cell order, a bounded copy at a time."""
        heads = self.head_count
        for view in self.head_views:
            cell = max(1, view[0, 0].numel() * view.element_size())
            step = max(1, _BATCH_ELEMENTS // (cell * heads))
            for start in range(0, int(index.numel()), step):
                yield start * heads, _cells(view, index[start : start + step])

    def _device_head_digests(self, index: torch.Tensor, count: int) -> tuple[tuple[int, ...], ...]:
        """On the pool's device: :class:`RowAdler`, one row per (page, head)."""
        state = RowAdler(count * self.head_count, self.device)
        for first, rows in self._row_batches(index):
            state.fold(rows, first)
        values = state.digests().reshape(count, self.head_count).cpu().tolist()
        return tuple(tuple(int(d) for d in row) for row in values)

    def _host_head_digests(self, index: torch.Tensor, count: int) -> tuple[tuple[int, ...], ...]:
        """On the CPU: zlib-ng's SIMD Adler-32 continued row by row, layer by layer (some GB/s;
        :class:`RowAdler`'s widened tensor sums run at tens of MB/s on a CPU)."""
        heads = self.head_count
        values = [1] * (count * heads)
        for first, rows in self._row_batches(index):
            for offset, row in enumerate(rows.numpy()):
                values[first + offset] = adler32(row.data, values[first + offset])
        return tuple(tuple(values[p * heads : (p + 1) * heads]) for p in range(count))

    def page_digests(self, pages: PageIds) -> tuple[int, ...]:
        return tuple(page_digests_digest(row) for row in self.head_digests(pages))

    def checksum(self, pages: PageIds, value: int = 1) -> int:
        """Adler-32 over the pages' head digests (4 bytes each, big-endian), pages in order."""
        flat = [d for row in self.head_digests(pages) for d in row]
        return adler32(np.asarray(flat, dtype=">u4").tobytes(), value)


def pack(rows: Sequence[Sequence[int]]) -> str:
    """Per-page head digests on the wire: big-endian uint32s, page-major, base64."""
    return base64.b64encode(np.asarray(rows, dtype=">u4").tobytes()).decode("ascii")


def unpack(text: str, pages: int, heads: int) -> list[list[int]] | None:
    """:func:`pack`'s rows back, or None when ``text`` does not hold ``pages`` x ``heads``."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        return None
    if pages < 0 or heads < 1 or len(raw) != 4 * pages * heads:
        return None
    return np.frombuffer(raw, dtype=">u4").reshape(pages, heads).astype(np.int64).tolist()


def head_range(rank: int, tp_size: int, total_heads: int) -> tuple[int, int]:
    """The global KV heads ``(start, count)`` a tensor-parallel rank holds, as vLLM and SGLang
    shard them: ``total / tp`` each, or, with fewer heads than ranks, one head replicated on
    ``tp / total`` consecutive ranks."""
    if tp_size <= 1 or total_heads <= 0:
        return 0, max(total_heads, 0)
    if total_heads >= tp_size:
        per = total_heads // tp_size
        return rank * per, per
    return rank * total_heads // tp_size, 1
