"""vLLM's per-layer KV cache views described as a :class:`~engine_hooks.PagedKVPool`.

vLLM (0.33) allocates one backing buffer and hands the connector one ``[B, H, N, C]`` view per
layer (``vllm.v1.worker.utils.allocate_kv_cache``), placed by a :class:`KVCacheLayout`: layer-
outermost (``LBHNC``, ``LBNHC``: each layer's block is one dense page, blocks back to back) or
block-outermost (``BLHNC``, ``BLNHC``, ``BHLNC``: each block holds every layer's page). The hooks
read pages as raw bytes, so both become ``[num_blocks, page_bytes]`` uint8 buffers over the same
storage (``Layout.PAGES``), with no copy. Layouts whose block is not one dense run of bytes in
either sense (``LHBNC``) are reported as unsupported, never guessed.

The same views, head at dim 1, give the pool its per-KV-head digests
(:class:`~engine_hooks.heads.HeadedPool`), and :func:`signature` says what the bytes mean, for a
reader to check before it reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from engine_hooks.heads import HeadedPool
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


def _layer_views(
    kv_caches: Mapping[str, torch.Tensor], num_blocks: int
) -> dict[_Page, torch.Tensor] | None:
    """Each distinct layer page (layers that share one are read once), in the engine's order."""
    pages: dict[_Page, torch.Tensor] = {}
    for view in kv_caches.values():
        page = _describe(view, num_blocks)
        if page is None:
            return None
        pages.setdefault(page, view)
    return pages


def page_buffers(
    kv_caches: Mapping[str, torch.Tensor], num_blocks: int
) -> list[torch.Tensor] | None:
    """``[num_blocks, page_bytes]`` uint8 buffers covering every layer's pages, or None."""
    pages = _layer_views(kv_caches, num_blocks)
    if pages is None:
        return None
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


def head_views(kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> list[torch.Tensor] | None:
    """The distinct layers' ``[B, H, N, C]`` views, or None when they are not all 4-D with one
    head count (the hooks then seal whole pages, which only a reader of the same TP width and
    head slice can check)."""
    pages = _layer_views(kv_caches, num_blocks)
    if pages is None:
        return None
    views = list(pages.values())
    if any(v.dim() != 4 for v in views) or len({v.shape[1] for v in views}) != 1:
        return None
    return views


def physical_order(view: torch.Tensor, page_bytes: int) -> str:
    """vLLM's name for a ``[B, H, N, C]`` view's memory layout (``LBHNC``, ``LBNHC``, ``BLHNC``,
    ...): block-outermost when a block holds every layer's page, then H, N, C by stride."""
    by_stride = sorted(zip(view.stride()[1:], "HNC", strict=True), key=lambda x: -x[0])
    inner = "".join(name for _, name in by_stride)
    compact = view.stride(0) * view.element_size() == page_bytes
    return ("LB" if compact else "BL") + inner


def signature(
    kv_caches: Mapping[str, torch.Tensor],
    num_blocks: int,
    block_size: int,
    *,
    dtype: str,
    kv_heads: int,
    head_start: int,
) -> dict[str, int | str] | None:
    """What this rank's pages mean, for the seal (see :data:`SIGNATURE_FIELDS`); None when the
    layout is not one the hooks read."""
    views = head_views(kv_caches, num_blocks)
    if not views:
        return None
    first = views[0]
    item = first.element_size()
    return {
        "dtype": dtype,
        "block_size": block_size,
        "layers": len(views),
        "kv_heads": kv_heads,
        "head_start": head_start,
        "head_count": int(first.shape[1]),
        "cell_bytes": int(first.shape[3]) * item,
        "layout": physical_order(first, first[0].numel() * item),
    }


#: The signature's fields that writer and reader must agree on: what a byte means. The head
#: range is the writer's own (the reader recombines heads across ranks); ``layout`` is compared
#: only where the transport copies blocks as raw bytes (see the connector's worker). Not
#: ``block_size``: vLLM's NIXL re-blocks between sizes (the bytes then mean the same), so a
#: differing one is the scheduler's ``unsupported_layout`` skip (per-block seals cannot be
#: recombined across block sizes), never a finding.
SIGNATURE_FIELDS: tuple[str, ...] = ("dtype", "layers", "kv_heads", "cell_bytes")

#: vLLM's ``--kv-cache-dtype`` names that mean the same element type: ``fp8`` is E4M3 (on
#: CUDA; its ROCm build reads both as the fnuz variant alike), so a pair started as ``fp8`` and
#: ``fp8_e4m3`` reads the same bytes the same way.
_DTYPE_ALIASES: dict[str, str] = {"fp8": "fp8_e4m3"}


def dtype_name(cache_dtype: str, pool_dtype: object) -> str:
    """What a KV element is, by meaning: vLLM's ``cache_dtype`` (aliases folded), or for
    ``auto`` the pool's own dtype (``bfloat16`` ...)."""
    if cache_dtype != "auto":
        return _DTYPE_ALIASES.get(cache_dtype, cache_dtype)[:32]
    return str(pool_dtype or "").removeprefix("torch.")[:32]


def kv_pool(
    kv_caches: Mapping[str, torch.Tensor],
    num_blocks: int,
    block_size: int,
    kv_dtype: torch.dtype | None = None,
    head_start: int = 0,
) -> PagedKVPool | None:
    """The pool for the hooks (per KV head where the views show heads), or None when the layout
    is not one the hooks can read."""
    buffers = page_buffers(kv_caches, num_blocks)
    if buffers is None:
        return None
    views = head_views(kv_caches, num_blocks)
    if views is None:
        return PagedKVPool(buffers, block_size, layout=Layout.PAGES, kv_dtype=kv_dtype)
    return HeadedPool(
        buffers, block_size, views, head_start=head_start, layout=Layout.PAGES, kv_dtype=kv_dtype
    )
