"""Hooks on SGLang's two allocators: page tags and free-page canaries.

``PagedTokenToKVPoolAllocator`` (``--page-size`` N > 1): every allocation path (``alloc``,
``alloc_extend``, ``alloc_decode``) takes pages from the front of ``free_pages``; every free path
ends in ``_release_page_ids``. ``TokenToKVPoolAllocator`` (page size 1, SGLang's default): a
page is one token slot; ``alloc`` takes slots from the front of ``free_pages`` and every free
path ends in ``free`` (a free group's slots reach it once, at ``free_group_end``). The pages an
allocation took are read from the free list's storage (the new list is a slice of the old one,
or of the merged and sorted one), so no hook inspects token indices or synchronises the device.
"""

from __future__ import annotations

from typing import Any

import torch

from engine_hooks.labels import Detector, Hook, Skip
from engine_hooks.sglang.guard import safe
from engine_hooks.sglang.report import log_verdicts
from engine_hooks.sglang.runtime import describe_pool, runtime
from engine_hooks.watch import KVWatch


def free_page_ids(allocator: Any) -> torch.Tensor:
    """Every page the allocator holds free: the free list plus pages staged for a merge."""
    parts = [allocator.free_pages]
    staged = getattr(allocator, "staged_pages", None)  # v0.5.22+: a list of tensors
    if isinstance(staged, list):
        parts.extend(staged)
    released = getattr(allocator, "release_pages", None)  # v0.5.19: one tensor
    if isinstance(released, torch.Tensor):
        parts.append(released)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def taken_pages(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """The page ids an allocation removed from the front of the free list.

    ``after`` is ``base[n:]`` where ``base`` is ``before`` or, when the allocator merged its staged
    pages first, a fresh sorted tensor: either way the taken ids sit just before ``after`` in the
    same storage. Pure metadata arithmetic, no device access.
    """
    same = after.untyped_storage().data_ptr() == before.untyped_storage().data_ptr()
    start = before.storage_offset() if same else 0
    count = after.storage_offset() - start
    if count <= 0:
        return after[:0]
    return after.as_strided((count,), (1,), start)


def _stamp_all_free(watch: KVWatch, allocator: Any) -> None:
    """The whole free list at once (start-up, ``clear()``): forget old free marks, stamp."""
    if watch.pool is not None:
        log_verdicts(watch.free_list(free_page_ids(allocator)))


@safe(Hook.STARTUP)
def after_init(result: Any, allocator: Any, *args: Any, **kwargs: Any) -> None:
    """A paged allocator was built: describe its KV cache, start a watch, stamp the free pages."""
    rt = runtime()
    kvcache = getattr(allocator, "_kvcache", None)
    page_size = int(allocator.page_size)
    pool, reason = describe_pool(kvcache, page_size)
    # The token allocator (page size 1) has no num_pages: its pages are its slots.
    pages = int(getattr(allocator, "num_pages", 0) or int(allocator.size) // page_size)
    if pool is not None and pool.num_pages < pages + 1:
        pool, reason = None, Skip.UNSUPPORTED_LAYOUT
    watch = rt.new_watch(pool)
    rt.watches[allocator] = watch
    if pool is None:
        for detector in (Detector.CANARY, Detector.PAGE_TAG):
            watch.skip(detector, reason or Skip.NO_POOL)
        return
    _stamp_all_free(watch, allocator)


@safe(Hook.FREE)
def after_clear(result: Any, allocator: Any, *args: Any, **kwargs: Any) -> None:
    """``clear()`` (cache flush) put every page back on the free list at once."""
    watch = runtime().watch_for(allocator)
    if watch is not None and watch.pool is not None:
        _stamp_all_free(watch, allocator)


def around_alloc(original: Any, allocator: Any, *args: Any, **kwargs: Any) -> Any:
    """``alloc``, ``alloc_extend``, ``alloc_decode``: check free canaries, bump tags."""
    watch, before = _before_alloc(allocator)
    result = original(allocator, *args, **kwargs)
    if watch is not None and before is not None and result is not None:
        _after_alloc(watch, allocator, before)
    return result


@safe(Hook.ALLOC, lambda: (None, None))
def _before_alloc(allocator: Any) -> tuple[KVWatch | None, torch.Tensor | None]:
    watch = runtime().watch_for(allocator)
    if watch is not None and watch.pool is not None:
        return watch, allocator.free_pages
    return watch, None


@safe(Hook.ALLOC)
def _after_alloc(watch: KVWatch, allocator: Any, before: torch.Tensor) -> None:
    taken = taken_pages(before, allocator.free_pages)
    if taken.numel():
        log_verdicts(watch.on_alloc(taken))


@safe(Hook.FREE)
def before_release(allocator: Any, *page_ids: Any, **kwargs: Any) -> None:
    """``_release_page_ids``: every free path ends here. Stamp canaries, catch double frees."""
    watch = runtime().watch_for(allocator)
    if watch is None or watch.pool is None or not page_ids:
        return
    pages = torch.cat(page_ids) if len(page_ids) > 1 else page_ids[0]
    if pages.numel():
        log_verdicts(watch.on_free(pages))


@safe(Hook.FREE)
def before_token_free(allocator: Any, free_index: Any = None, *args: Any, **kwargs: Any) -> None:
    """``TokenToKVPoolAllocator.free`` (page size 1): every free path ends here. Inside a free
    group the slots are only queued; they come back through ``free`` at ``free_group_end``."""
    if getattr(allocator, "free_group", None) is not None:
        return
    free_index = kwargs.get("free_index", free_index)
    if isinstance(free_index, torch.Tensor):
        before_release(allocator, free_index)
