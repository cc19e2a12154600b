"""A paged KV pool and its free list, as an engine keeps them.

The pool is ``2 * layers`` tensors of ``[token_slots, heads, head_dim]`` (all K, then all V),
grouped into pages of ``page_size`` slots. Freed pages are never cleared (as in SGLang: the next
owner overwrites them), so a slot that a request reads without writing still holds its last
owner's keys and values. The free list is FIFO: freed pages go to the back.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

HEADS = 1


@dataclass(frozen=True, slots=True)
class PoolShape:
    num_pages: int
    page_size: int
    layers: int
    head_dim: int

    @property
    def slots(self) -> int:
        return self.num_pages * self.page_size

    @classmethod
    def for_tokens(cls, tokens: int, page_size: int, layers: int, head_dim: int) -> PoolShape:
        return cls(max(1, tokens // page_size), page_size, layers, head_dim)


def pages_for(tokens: int, page_size: int) -> int:
    return max(1, math.ceil(tokens / page_size))


def make_buffers(shape: PoolShape, device: torch.device, *, shared: bool) -> list[torch.Tensor]:
    """Allocate the pool's per-layer K and V tensors (zeroed once, at start-up only)."""
    buffers = []
    for _ in range(2 * shape.layers):
        buf = torch.zeros(shape.slots, HEADS, shape.head_dim, dtype=torch.float32, device=device)
        if shared and device.type == "cpu":
            buf.share_memory_()  # type: ignore[no-untyped-call]
        buffers.append(buf)
    return buffers


class KVPool:
    """The engine's view of its pool: K and V buffers per layer, page-granular copies."""

    def __init__(self, buffers: Sequence[torch.Tensor], page_size: int) -> None:
        self.buffers = list(buffers)
        self.layers = len(self.buffers) // 2
        self.page_size = page_size
        self.num_pages = self.buffers[0].shape[0] // page_size
        self.device = self.buffers[0].device

    def keys(self, layer: int) -> torch.Tensor:
        return self.buffers[layer]

    def values(self, layer: int) -> torch.Tensor:
        return self.buffers[self.layers + layer]

    def page_rows(self, buffer: torch.Tensor) -> torch.Tensor:
        """``[num_pages, page_size * heads * head_dim]`` view of one buffer."""
        return buffer.view(self.num_pages, -1)

    def slots_of(self, pages: Sequence[int] | torch.Tensor, tokens: int) -> torch.Tensor:
        """The slot index of each of the first ``tokens`` positions of a page table."""
        table = torch.as_tensor(pages, dtype=torch.int64, device=self.device)
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        return (table.unsqueeze(1) * self.page_size + offsets).reshape(-1)[:tokens]


def copy_pages(
    src: KVPool, src_pages: Sequence[int], dst: KVPool, dst_pages: Sequence[int]
) -> None:
    """Whole-page copy from one pool into another (prefill's one-sided write into decode)."""
    if not src_pages:
        return
    s = torch.as_tensor(src_pages, dtype=torch.int64, device=src.device)
    d = torch.as_tensor(dst_pages, dtype=torch.int64, device=dst.device)
    for s_buf, d_buf in zip(src.buffers, dst.buffers, strict=True):
        rows = src.page_rows(s_buf).index_select(0, s)
        dst.page_rows(d_buf).index_copy_(0, d, rows.to(dst.device))


class FreeList:
    """Pages no request owns. ``alloc`` takes from the front, ``free`` appends; nothing is
    cleared and nothing checks for a page freed twice (that is the detectors' job)."""

    def __init__(self, num_pages: int) -> None:
        self.pages: deque[int] = deque(range(num_pages))

    def __len__(self) -> int:
        return len(self.pages)

    def alloc(self, count: int) -> list[int] | None:
        if count > len(self.pages):
            return None
        return [self.pages.popleft() for _ in range(count)]

    def free(self, pages: Sequence[int]) -> None:
        self.pages.extend(pages)


class PageOwners:
    """Which request's KV each token slot of a pool holds: minipd's own record, kept by the
    engine's code where it writes KV (the model's writes, prefill's whole-page copy into
    decode), not by kvwatch's hooks. It is the ground truth the blast-radius tests hold
    kvwatch's sources to. Slots, not pages: a page copied whole carries the unwritten tail of
    its source page (another request's KV) along with the request's own tokens.

    One int64 per slot, the writer's request number (:func:`request_number`; 0 for a slot never
    written); a reader checks the slot still holds a token's KV (a scrub may have zeroed it).
    Decode's record lives in shared memory, as its pool (prefill writes it from its process);
    decode, which sees every request id at reserve, maps numbers back to ids (the
    ``remember`` most recent).
    """

    def __init__(self, holders: torch.Tensor, page_size: int, remember: int = 1 << 16) -> None:
        self.holders = holders
        self.page_size = page_size
        self.remember = remember
        self.names: OrderedDict[int, str] = OrderedDict()

    def wrote(self, slots: torch.Tensor, rid: str) -> None:
        """``rid``'s KV was written at these slots."""
        self.holders[slots.cpu()] = request_number(rid)

    def copied(self, src: PageOwners, src_pages: Sequence[int], dst_pages: Sequence[int]) -> None:
        """Whole pages copied from ``src``'s pool into this one (see :func:`copy_pages`)."""
        if src_pages:
            rows = src.holders.view(-1, src.page_size)[torch.as_tensor(list(src_pages))]
            self.holders.view(-1, self.page_size)[torch.as_tensor(list(dst_pages))] = rows

    def named(self, rid: str) -> None:
        self.names[request_number(rid)] = rid
        while len(self.names) > self.remember:
            self.names.popitem(last=False)

    def held(self, slots: torch.Tensor, reader: str) -> dict[str, tuple[int, int]]:
        """Other requests whose KV a read of these slots sees: (pages, tokens) per request id
        (the reader's own slots and never-written ones left out)."""
        index = slots.cpu()
        numbers = self.holders[index]
        pages = index // self.page_size
        own = request_number(reader)
        out: dict[str, tuple[int, int]] = {}
        for number in set(numbers.tolist()) - {0, own}:
            mine = numbers == number
            name = self.names.get(number, "?")
            out[name] = (len(set(pages[mine].tolist())), int(mine.sum()))
        return out


def make_owners(slots: int, *, shared: bool) -> torch.Tensor:
    """The record behind :class:`PageOwners` (host memory on any device: bookkeeping)."""
    holders = torch.zeros(slots, dtype=torch.int64)
    if shared:
        holders.share_memory_()  # type: ignore[no-untyped-call]
    return holders


def request_number(rid: str) -> int:
    """A request id as a positive 56-bit number (the record's cell; collisions are 2^-56)."""
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=7).digest(), "big") or 1
