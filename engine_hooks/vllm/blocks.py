"""Block generations beside vLLM's ``BlockPool``, which the scheduler-side connector is bound to.

``KVCacheBlock`` has ``__slots__``, so generations live in a side array indexed by ``block_id``
and bumped on every ``BlockPool.get_new_blocks``. ``free_blocks`` is watched for blocks whose
reference count reached zero: those without a prefix-cache hash go back to the free list for
reuse and are handed to the worker for a free canary; cached ones stay readable (a later prefix
hit reads them) and are handed over when an allocation evicts them. The wrappers are bound to
the one pool instance, run the original first, and never raise: a failure is counted and the
engine goes on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from engine_hooks.guard import Guard
from engine_hooks.labels import Hook
from engine_hooks.vllm.metadata import BlockEvent


def _failed(_hook: Hook, _fn: Callable[..., Any], args: tuple[Any, ...], _exc: Exception) -> None:
    args[0].errors += 1  # the connector counts them as hook_errors{alloc}


_guard = Guard(_failed)


class BlockLedger:
    """Generations per block id and the alloc/free events the worker has not seen yet."""

    def __init__(self, num_blocks: int) -> None:
        self.generation = [0] * num_blocks
        self.events: list[BlockEvent] = []
        #: Blocks freed while in the prefix cache: still readable, not on the free list yet.
        self.cached: set[int] = set()
        self.errors = 0
        self.pool: Any = None

    def attach(self, pool: Any) -> None:
        """Watch ``pool.get_new_blocks`` and ``pool.free_blocks`` (instance attributes)."""
        if self.pool is pool or getattr(pool, "_kvwatch_ledger", None) is not None:
            return
        self.pool = pool
        get_new: Callable[[int], list[Any]] = pool.get_new_blocks
        free: Callable[[Iterable[Any]], None] = pool.free_blocks

        @functools.wraps(get_new)
        def get_new_blocks(num_blocks: int) -> list[Any]:
            blocks = get_new(num_blocks)
            self._allocated(blocks)
            return blocks

        @functools.wraps(free)
        def free_blocks(ordered_blocks: Iterable[Any]) -> None:
            blocks = list(ordered_blocks)
            free(blocks)
            self._freed(blocks)

        pool.get_new_blocks = get_new_blocks
        pool.free_blocks = free_blocks
        pool._kvwatch_ledger = self

    @_guard(Hook.ALLOC)
    def _allocated(self, blocks: list[Any]) -> None:
        self.allocated(blocks)

    @_guard(Hook.ALLOC)
    def _freed(self, blocks: list[Any]) -> None:
        self.freed(blocks)

    def allocated(self, blocks: list[Any]) -> None:
        ids = [b.block_id for b in blocks]
        self.evicted(ids)
        for block_id in ids:
            self.generation[block_id] += 1
        if ids:
            self.events.append(BlockEvent("alloc", ids))

    def evicted(self, ids: list[int]) -> None:
        """A cached block handed out again was evicted from the prefix cache just now: that is
        when it really returned to the free list (scrub on_free zeroes it then)."""
        if not self.cached:
            return
        evicted = [b for b in ids if b in self.cached]
        if evicted:
            self.cached.difference_update(evicted)
            self.events.append(BlockEvent("free", evicted))

    def freed(self, blocks: list[Any]) -> None:
        # Only blocks of this pool that really reached the free list, unhashed (not cached);
        # cached ones are remembered until an allocation evicts them.
        ids = []
        for b in blocks:
            if b.is_null or (b.pool is not None and b.pool is not self.pool) or b.ref_cnt != 0:
                continue
            if b.block_hash is None:
                ids.append(b.block_id)
                self.cached.discard(b.block_id)
            else:
                self.cached.add(b.block_id)
        if ids:
            self.events.append(BlockEvent("free", ids))

    def snapshot(self, block_ids: Iterable[int]) -> list[int]:
        return [self.generation[b] for b in block_ids]

    def drain(self) -> list[BlockEvent]:
        events, self.events = self.events, []
        return events
