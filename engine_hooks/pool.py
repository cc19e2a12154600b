"""The paged KV pool as the hooks see it: per-layer tensors whose leading rows form pages.

Every detector works on raw page bytes, so it does not matter whether the pool is MHA (separate
K and V per layer), MLA (one latent buffer per layer), bf16, fp16 or fp8 stored as uint8.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_hooks.checksum import AdlerState, adler32_addresses

if TYPE_CHECKING:
    from engine_hooks.kernels import SealKernel

PageIds = Sequence[int] | torch.Tensor


class Layout(StrEnum):
    #: ``[token_slots, ...]``: pages are runs of ``page_size`` rows (SGLang's k/v/kv buffers).
    TOKENS = "tokens"
    #: ``[num_pages, ...]``: one row per page (vLLM's per-layer ``[num_blocks, ...]`` views).
    PAGES = "pages"


class PagedKVPool:
    """An engine's KV pool described for the hooks.

    ``buffers`` are the per-layer tensors in a fixed order (for MHA, e.g. all K then all V). Each
    must be contiguous. ``kv_dtype`` is the logical element type when the storage is uint8 (fp8
    pools), used only to choose canary bit patterns that are NaN in that type. ``tag_store`` is
    an int64 tensor of one entry per page holding the generation each page was last written
    for; an engine whose writers are remote places it where they can reach it (shared memory,
    a registered RDMA region). Without one, the pool keeps its own.
    """

    def __init__(
        self,
        buffers: Sequence[torch.Tensor],
        page_size: int,
        *,
        layout: Layout | str = Layout.TOKENS,
        kv_dtype: torch.dtype | None = None,
        tag_store: torch.Tensor | None = None,
    ) -> None:
        if not buffers:
            raise ValueError("a pool needs at least one buffer")
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.layout = Layout(layout)
        self.buffers = list(buffers)
        self.device = self.buffers[0].device
        self.kv_dtype = kv_dtype or self.buffers[0].dtype
        pages: list[torch.Tensor] = []
        for index, buffer in enumerate(self.buffers):
            if not buffer.is_contiguous():
                raise ValueError(f"buffer {index} is not contiguous")
            if buffer.device != self.device:
                raise ValueError(f"buffer {index} is on {buffer.device}, not {self.device}")
            rows = buffer.shape[0] if buffer.dim() else 0
            raw = buffer.view(torch.uint8).reshape(rows, -1) if rows else buffer.view(torch.uint8)
            if self.layout is Layout.TOKENS:
                count = rows // page_size
                raw = raw[: count * page_size].reshape(count, -1)
            pages.append(raw)
        counts = {p.shape[0] for p in pages}
        if len(counts) != 1:
            raise ValueError(f"buffers disagree on the number of pages: {sorted(counts)}")
        #: Per buffer, a ``[num_pages, page_bytes]`` uint8 view of the same storage.
        self.page_views = pages
        self.num_pages = pages[0].shape[0]
        self.layer_page_bytes = [p.shape[1] for p in pages]
        self.page_bytes = sum(self.layer_page_bytes)
        if tag_store is None:
            tag_store = torch.zeros(self.num_pages, dtype=torch.int64, device=self.device)
        if tag_store.shape != (self.num_pages,) or tag_store.dtype != torch.int64:
            raise ValueError("tag_store must be an int64 tensor with one entry per page")
        self.tag_store = tag_store
        self._bases = np.array([p.data_ptr() for p in pages], dtype=np.uint64)
        self._widths = np.array(self.layer_page_bytes, dtype=np.uint64)
        self._seal_kernel: SealKernel | None = None

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    def page(self, page_id: int) -> list[torch.Tensor]:
        """The byte views of one page, one per buffer."""
        return [view[page_id] for view in self.page_views]

    def as_index(self, pages: PageIds) -> torch.Tensor:
        if isinstance(pages, torch.Tensor):
            return pages.to(device=self.device, dtype=torch.int64)
        return torch.tensor(list(pages), dtype=torch.int64, device=self.device)

    def mark_written(self, pages: PageIds, generations: torch.Tensor | Sequence[int]) -> None:
        """A writer wrote these pages for these generations (the tags from the reader's ticket)."""
        index = self.as_index(pages)
        self.tag_store[index] = torch.as_tensor(generations, dtype=torch.int64).to(self.device)

    def check_ids(self, ids: Sequence[int]) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.num_pages):
            raise ValueError(f"page id out of range [0, {self.num_pages})")

    def checksum(self, pages: PageIds, value: int = 1) -> int:
        """Adler-32 over the pages' bytes: buffer by buffer, pages in the given order.

        Contiguous runs of page ids are read in one pass each. On an accelerator the sum is
        computed on the device and only the 4-byte result reaches the host.
        """
        if not self.is_cpu:
            return self.device_checksum(pages, value)
        ids = pages.numpy() if isinstance(pages, torch.Tensor) else np.asarray(pages)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_pages):
            raise ValueError(f"page id out of range [0, {self.num_pages})")
        return adler32_addresses(*self.chunks(ids), value)

    def page_digests(self, pages: PageIds) -> tuple[int, ...]:
        """One digest per page, in order: what a per-page seal holds and its reader compares."""
        ids = pages.tolist() if isinstance(pages, torch.Tensor) else list(pages)
        return tuple(self.checksum((p,)) for p in ids)

    def head_digests(self, pages: PageIds) -> tuple[tuple[int, ...], ...] | None:
        """Per page, one digest per KV head (:class:`engine_hooks.heads.HeadedPool`); None for a
        pool that does not see its heads."""
        return None

    def chunks(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The seal's stream as ``(addresses, lengths)`` uint64 arrays of a CPU pool: buffer by
        buffer, the pages ``ids`` in order, one chunk per (buffer, page)."""
        ids = ids.astype(np.uint64)
        addresses = (self._bases[:, None] + ids[None, :] * self._widths[:, None]).reshape(-1)
        return addresses, np.repeat(self._widths, ids.size)

    def device_checksum(self, pages: PageIds, value: int = 1, *, kernel: bool | None = None) -> int:
        """The accelerator's seal: the Triton kernel where it can run (``kernel=None``), else
        torch ops. Both also run on CPU tensors, which is how the tests check them."""
        from engine_hooks import kernels  # imports triton: only pools that need it pay for it

        index = self.as_index(pages)
        if kernel is None:
            kernel = kernels.available(self.device)
        if kernel:
            if self._seal_kernel is None:
                self._seal_kernel = kernels.SealKernel(self.page_views)
            return self._seal_kernel(index, value)
        state = AdlerState(self.device, value)
        for view in self.page_views:
            state.fold_rows(view.index_select(0, index))
        return state.value()
