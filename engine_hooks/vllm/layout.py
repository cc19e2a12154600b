"""vLLM's per-layer KV cache views described as a :class:`~engine_hooks.PagedKVPool`.

vLLM (0.33) allocates one backing buffer and hands the connector one ``[B, H, N, C]`` view per
layer (``vllm.v1.worker.utils.allocate_kv_cache``), placed by a :class:`KVCacheLayout`: layer-
outermost (``LBHNC``, ``LBNHC``: each layer's block is one dense page, blocks back to back) or
block-outermost (``BLHNC``, ``BLNHC``, ``BHLNC``: each block holds every layer's page). The hooks
read pages as raw bytes, so both become ``[num_blocks, page_bytes]`` uint8 buffers over the same
storage (``Layout.PAGES``), with no copy. Layouts whose block is not one dense run of bytes in
either sense (``LHBNC``) are reported as unsupported, never guessed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from engine_hooks.pool import Layout, PagedKVPool


@dataclass(frozen=True, slots=True)
class _Page:
    storage: int  # data_ptr of the backing storage
    offset: int  # byte offset of block 0's page in the storage
    page_bytes: int
    block_stride: int  # bytes between consecutive blocks


def _storage_bytes(view: torch.Tensor) -> torch.Tensor:
    """The whole backing storage of ``view`` as a 1-D uint8 tensor (no copy)."""
    flat = torch.empty(0, dtype=torch.uint8, device=view.device)
    return flat.set_(view.untyped_storage())


def _describe(view: torch.Tensor, num_blocks: int) -> _Page | None:
    if view.dim() < 2 or view.shape[0] != num_blocks:
        return None
    item = view.element_size()
    page_bytes = view[0].numel() * item
    span = item + sum(
        (size - 1) * stride * item
        for size, stride in zip(view.shape[1:], view.stride()[1:], strict=True)
    )
    if span != page_bytes:  # a block's bytes are not one dense run (e.g. LHBNC)
        return None
    return _Page(
        int(view.untyped_storage().data_ptr()),
        int(view.storage_offset()) * item,
        int(page_bytes),
        int(view.stride(0)) * item,
    )


def page_buffers(
    kv_caches: Mapping[str, torch.Tensor], num_blocks: int
) -> list[torch.Tensor] | None:
    """``[num_blocks, page_bytes]`` uint8 buffers covering every layer's pages, or None."""
    pages: dict[_Page, torch.Tensor] = {}
    for view in kv_caches.values():
        page = _describe(view, num_blocks)
        if page is None:
            return None
        pages.setdefault(page, view)
    buffers: list[torch.Tensor] = []
    packed: dict[int, list[_Page]] = {}
    for page, view in pages.items():
        if page.block_stride == page.page_bytes:  # layer-outermost: one buffer per layer
            raw = _storage_bytes(view)
            buffers.append(
                raw.as_strided((num_blocks, page.page_bytes), (page.page_bytes, 1), page.offset)
            )
        else:
            packed.setdefault(page.storage, []).append(page)
    for group in packed.values():
        # Block-outermost: the layers' pages must tile each block exactly (no padding, which
        # the transport would not copy), so the block is one dense run.
        stride = group[0].block_stride
        base = min(p.offset for p in group)
        if any(p.block_stride != stride for p in group):
            return None
        if sorted(p.offset - base for p in group) != _tiles(group):
            return None
        if sum(p.page_bytes for p in group) != stride:
            return None
        raw = _storage_bytes(pages[group[0]])
        buffers.append(raw.as_strided((num_blocks, stride), (stride, 1), base))
    return buffers or None


def _tiles(group: list[_Page]) -> list[int]:
    ordered = sorted(group, key=lambda p: p.offset)
    starts, at = [], 0
    for page in ordered:
        starts.append(at)
        at += page.page_bytes
    return starts


def kv_pool(
    kv_caches: Mapping[str, torch.Tensor],
    num_blocks: int,
    block_size: int,
    kv_dtype: torch.dtype | None = None,
) -> PagedKVPool | None:
    """The pool for the hooks, or None when the layout is not one the hooks can read."""
    buffers = page_buffers(kv_caches, num_blocks)
    if buffers is None:
        return None
    return PagedKVPool(buffers, block_size, layout=Layout.PAGES, kv_dtype=kv_dtype)
