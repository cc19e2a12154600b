"""Triton kernels for the page checks on an accelerator: the seal, the page-tag compare, the
canary stamps, the holder rotation of an allocation and the scrub's zero fill, each one launch
over every page of a call.

The seal reads each byte of the sealed pages once, straight from the page table: program ``k``
takes one chunk of one page of one buffer (buffers outer, pages in page-table order, the order
:meth:`PagedKVPool.checksum` defines), keeps its byte sum ``S_k`` and weighted sum ``W_k`` in
integer registers and writes one partial. Folding ``adler32_combine`` over the partials in
order is linear in them, so it unrolls to one sum on the device::

    a = a0 + sum(S_k)                            (mod 65521)
    b = b0 + N * a0 + sum(W_k + S_k * after_k)   (mod 65521)

with ``after_k`` the bytes of the stream after chunk ``k`` (each program computes its own term).
Only the 4-byte result reaches the host. Without triton (or with ``KVWATCH_TRITON=0``) the
callers use the torch path in :mod:`engine_hooks.checksum`; under ``TRITON_INTERPRET=1`` the
same kernels run on CPU tensors, which is how CI checks them against zlib.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from engine_hooks.checksum import BASE

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the fallback is tested by forcing KVWATCH_TRITON=0
    triton = None

#: Bytes per program of the seal: a 64-token page of a 128-head-dim bf16 layer is a few of them.
SEAL_CHUNK = 1 << 15
#: Bytes one program loads at once: 16 per thread at 4 warps; the weighted block sum of uint8
#: values with weights up to 2048 fits int32.
SEAL_BLOCK = 2048
#: Pages per program of the page checks.
CHECK_BLOCK = 128


def available(device: torch.device) -> bool:
    """Whether the kernels are the default on tensors of ``device`` (an accelerator)."""
    if triton is None or os.environ.get("KVWATCH_TRITON", "1") == "0":
        return False
    return device.type in ("cuda", "xpu")


def interpreted() -> bool:
    """Whether the kernels were built for Triton's interpreter, so run on CPU tensors too
    (``TRITON_INTERPRET=1`` before this module is imported: the tests, the dry gpu-check)."""
    return triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _seal_kernel(
        anchor,  # uint8 pointer; every buffer is addressed as a byte offset from it
        offsets,  # int64 [buffers]: buffer start - anchor
        widths,  # int64 [buffers]: bytes of one page in the buffer
        starts,  # int64 [buffers]: bytes of one page in the buffers before it
        pages,  # int64 [num_pages]: the page table
        partials,  # int64 [programs, 2] out: S_k and W_k + S_k * after_k, both mod BASE
        num_pages,
        pool_pages,  # an id outside [0, pool_pages) reads nothing (the digest cannot match)
        chunks,  # programs per (buffer, page)
        total,  # bytes in the stream
        MOD: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
        ALIGNED: tl.constexpr,  # buffers, page widths and chunks are multiples of 16 bytes
    ) -> None:
        pid = tl.program_id(0).to(tl.int64)
        item = pid // chunks
        lo = (pid % chunks) * CHUNK
        buf = item // num_pages
        pos = item % num_pages
        page = tl.load(pages + pos)
        width = tl.load(widths + buf)
        n = tl.maximum(tl.minimum(width - lo, CHUNK), 0)  # a narrower buffer: nothing here
        n = tl.where((page >= 0) & (page < pool_pages), n, 0)
        src = anchor + tl.load(offsets + buf) + page * width + lo
        if ALIGNED:  # every page and chunk starts on 16 bytes: vector loads
            src = tl.multiple_of(src, 16)
        idx = tl.arange(0, BLOCK)
        s = pid * 0  # int64 accumulators in registers
        w = pid * 0
        full = n // BLOCK * BLOCK
        for start in range(0, full, BLOCK):  # whole blocks, unmasked
            x = tl.load(src + start + idx).to(tl.int32)
            block_sum = tl.sum(x, axis=0).to(tl.int64)
            # Byte i of the chunk weighs n - i = (n - start - BLOCK) + (BLOCK - idx).
            block_weighted = tl.sum(x * (BLOCK - idx), axis=0).to(tl.int64)
            s += block_sum
            w += block_weighted + block_sum * (n - start - BLOCK)
        # The tail (fewer than BLOCK bytes, maybe none), masked.
        x = tl.load(src + full + idx, mask=full + idx < n, other=0).to(tl.int32)
        block_sum = tl.sum(x, axis=0).to(tl.int64)
        s += block_sum
        w += tl.sum(x * (BLOCK - idx), axis=0).to(tl.int64) + block_sum * (n - full - BLOCK)
        stream_end = tl.load(starts + buf) * num_pages + pos * width + lo + n
        after = (total - stream_end) % MOD
        s = s % MOD
        tl.store(partials + 2 * pid, s)
        tl.store(partials + 2 * pid + 1, (w % MOD + s * after) % MOD)

    @triton.jit
    def _scrub_kernel(
        anchor,  # uint8 pointer, as the seal's
        offsets,  # int64 [buffers]: buffer start - anchor
        widths,  # int64 [buffers]: bytes of one page in the buffer
        pages,  # int64 [num_pages]
        num_pages,
        chunks,  # programs per (buffer, page)
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
        ALIGNED: tl.constexpr,
    ) -> None:
        pid = tl.program_id(0).to(tl.int64)
        item = pid // chunks
        lo = (pid % chunks) * CHUNK
        buf = item // num_pages
        page = tl.load(pages + item % num_pages)
        width = tl.load(widths + buf)
        n = tl.maximum(tl.minimum(width - lo, CHUNK), 0)
        dst = anchor + tl.load(offsets + buf) + page * width + lo
        if ALIGNED:
            dst = tl.multiple_of(dst, 16)
        idx = tl.arange(0, BLOCK)
        zero = tl.zeros((BLOCK,), dtype=tl.uint8)
        for start in range(0, CHUNK, BLOCK):
            tl.store(dst + start + idx, zero, mask=start + idx < n)

    @triton.jit
    def _bump_kernel(
        generation,  # int64 [pool pages]
        written,  # int64 [pool pages]: the tag store
        holders,  # int64 [pool pages, SLOTS, FIELDS] (pagestate's holder slots)
        pages,  # int64 [count], distinct
        owner,
        now_ms,
        count,
        SLOTS: tl.constexpr,
        FIELDS: tl.constexpr,
        BLOCK: tl.constexpr,
    ) -> None:
        # pagestate.DevicePages.bump in one launch: slots are CURRENT, PREVIOUS, WRITER and
        # fields KEY, GEN, AT_MS, in that order.
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < count
        p = tl.load(pages + i, mask=mask, other=0)
        w = tl.load(written + p, mask=mask, other=0)
        base = holders + p * (SLOTS * FIELDS)
        last = (w != 0) & (w == tl.load(base + FIELDS + 1, mask=mask, other=0))
        for f in tl.static_range(FIELDS):
            current = tl.load(base + f, mask=mask, other=0)
            previous = tl.load(base + FIELDS + f, mask=mask, other=0)
            writer = tl.load(base + 2 * FIELDS + f, mask=mask, other=0)
            tl.store(base + 2 * FIELDS + f, tl.where(last, previous, writer), mask=mask)
            tl.store(base + FIELDS + f, current, mask=mask)
        gen = tl.load(generation + p, mask=mask, other=0) + 1
        tl.store(generation + p, gen, mask=mask)
        tl.store(base, p * 0 + owner, mask=mask)
        tl.store(base + 1, gen, mask=mask)
        tl.store(base + 2, p * 0 + now_ms, mask=mask)

    @triton.jit
    def _tags_kernel(
        generation, written, pages, expected, stale, count, BLOCK: tl.constexpr
    ) -> None:
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < count
        p = tl.load(pages + i, mask=mask, other=0)
        want = tl.load(expected + i, mask=mask, other=0)
        gen = tl.load(generation + p, mask=mask, other=0)
        wrote = tl.load(written + p, mask=mask, other=0)
        tl.store(stale + i, (gen != want) | (wrote != want), mask=mask)

    @triton.jit
    def _canary_kernel(
        stamp_area,  # uint8 pointer: first buffer, page p starts at p * row
        row,
        pages,
        generations,
        purpose,
        out,  # bool [count]: intact (CHECK) or unused (STAMP)
        count,
        ELEMENT: tl.constexpr,  # bytes per element of the KV dtype
        WORD: tl.constexpr,  # NaN bits of an element
        BITS: tl.constexpr,  # payload bits per element
        SHIFT: tl.constexpr,  # where they go in the element
        STAMP_BYTES: tl.constexpr,
        STAMP: tl.constexpr,  # write the stamps (True) or compare with them (False)
        BLOCK: tl.constexpr,
    ) -> None:
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < count
        p = tl.load(pages + i, mask=mask, other=0)
        g = tl.load(generations + i, mask=mask, other=0)
        # canary.payload, in int64 with the same wrap-around.
        mixed = p * 0x9E3779B1 + g * 0x85EBCA77 + purpose.to(tl.int64) * 0xC2B2AE3D
        mixed = mixed ^ (mixed >> 29)
        mixed = (mixed * 0x94D049BB) & 0xFFFFFFFFFFFF
        payload = mixed ^ (mixed >> 17)
        j = tl.arange(0, STAMP_BYTES)
        element = (j // ELEMENT).to(tl.int64)
        bits = (payload[:, None] >> (element[None, :] * BITS)) & ((1 << BITS) - 1)
        word = WORD | (bits << SHIFT)
        want = ((word >> ((j % ELEMENT) * 8)[None, :]) & 0xFF).to(tl.uint8)
        address = stamp_area + p[:, None] * row + j[None, :]
        cell = mask[:, None] & (j[None, :] < STAMP_BYTES)
        if STAMP:
            tl.store(address, want, mask=cell)
        else:
            current = tl.load(address, mask=cell, other=0)
            same = tl.sum((current == want).to(tl.int32), axis=1) == STAMP_BYTES
            tl.store(out + i, same, mask=mask)


class PageTables:
    """Where a pool's pages lie, as tables on the device built once: every buffer as a byte
    offset from the lowest one (the anchor), its page width, and the bytes of one page in the
    buffers before it. One launch can then reach every buffer of the pool."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        device = buffers[0].device
        self.pool_pages = buffers[0].shape[0]
        pointers = [b.data_ptr() for b in buffers]
        self.anchor = buffers[pointers.index(min(pointers))]
        widths = [b.shape[1] for b in buffers]
        starts = [sum(widths[:i]) for i in range(len(widths))]
        self.offsets = torch.tensor([p - min(pointers) for p in pointers], device=device)
        self.widths = torch.tensor(widths, dtype=torch.int64, device=device)
        self.starts = torch.tensor(starts, dtype=torch.int64, device=device)
        self.chunks = -(-max(widths) // SEAL_CHUNK)
        self.page_bytes = sum(widths)
        self.buffers = len(buffers)
        self.aligned = all(p % 16 == 0 for p in pointers) and all(w % 16 == 0 for w in widths)


class SealKernel(PageTables):
    """The seal of one pool."""

    def partials(self, pages: torch.Tensor) -> torch.Tensor:
        """The ``[programs, 2]`` partials of the pages, in page-table order."""
        programs = self.buffers * pages.numel() * self.chunks
        out = torch.empty((programs, 2), dtype=torch.int64, device=pages.device)
        _seal_kernel[(programs,)](
            self.anchor,
            self.offsets,
            self.widths,
            self.starts,
            pages,
            out,
            pages.numel(),
            self.pool_pages,
            self.chunks,
            self.page_bytes * pages.numel(),
            MOD=BASE,
            CHUNK=SEAL_CHUNK,
            BLOCK=SEAL_BLOCK,
            ALIGNED=self.aligned,
        )
        return out

    def digest(self, pages: torch.Tensor, value: int = 1) -> torch.Tensor:
        """Adler-32 of the pages continuing from ``value``, as an int64 tensor on the device."""
        a0, b0 = value & 0xFFFF, (value >> 16) & 0xFFFF
        if pages.numel() == 0:
            return torch.tensor((b0 % BASE) << 16 | a0 % BASE, device=pages.device)
        sums = self.partials(pages).sum(dim=0)
        total = self.page_bytes * pages.numel()
        a = (sums[0] + a0) % BASE
        b = (sums[1] + b0 + (total % BASE) * a0) % BASE
        return (b << 16) | a

    def __call__(self, pages: torch.Tensor, value: int = 1) -> int:
        # The one device-to-host transfer of a seal: 4 bytes.
        return int(self.digest(pages, value).to(torch.int32).item()) & 0xFFFFFFFF


def scrub(tables: PageTables, pages: torch.Tensor) -> None:
    """Zero every byte of these pages (int64, on the device) in every buffer of the pool: one
    launch, no sync (the scrub mode's fill)."""
    if pages.numel():
        programs = tables.buffers * pages.numel() * tables.chunks
        _scrub_kernel[(programs,)](
            tables.anchor,
            tables.offsets,
            tables.widths,
            pages,
            pages.numel(),
            tables.chunks,
            CHUNK=SEAL_CHUNK,
            BLOCK=SEAL_BLOCK,
            ALIGNED=tables.aligned,
        )


def bump(
    generation: torch.Tensor,
    written: torch.Tensor,
    holders: torch.Tensor,
    pages: torch.Tensor,
    owner: int,
    now_ms: int,
) -> None:
    """New generations for distinct pages, given to ``owner``, holder slots rotated (one
    launch, no sync; see :meth:`engine_hooks.pagestate.DevicePages.bump`)."""
    if pages.numel():
        slots, fields = holders.shape[1], holders.shape[2]
        grid = (triton.cdiv(pages.numel(), CHECK_BLOCK),)
        _bump_kernel[grid](
            generation, written, holders, pages, owner, now_ms, pages.numel(),
            SLOTS=slots, FIELDS=fields, BLOCK=CHECK_BLOCK,
        )  # fmt: skip


def stale_tags(
    generation: torch.Tensor, written: torch.Tensor, pages: torch.Tensor, expected: torch.Tensor
) -> torch.Tensor:
    """Per page, generation or written tag differs from ``expected`` (one launch, no sync)."""
    out = torch.empty(pages.numel(), dtype=torch.bool, device=pages.device)
    if pages.numel():
        grid = (triton.cdiv(pages.numel(), CHECK_BLOCK),)
        _tags_kernel[grid](generation, written, pages, expected, out, pages.numel(), CHECK_BLOCK)
    return out


# Per element size: NaN bits, payload bits per element and where they sit (canary._encode_*).
_CANARY_FORMATS = {1: (0x7F, 1, 7), 4: (0x7FC00000, 12, 0)}
_CANARY_HALF = {torch.bfloat16: 0x7F80 | 0x40, torch.float16: 0x7C00 | 0x200}


def _canary_format(kv_dtype: torch.dtype) -> tuple[int, int, int, int]:
    size = 1 if kv_dtype == torch.uint8 else torch.empty((), dtype=kv_dtype).element_size()
    if size == 2:
        return 2, _CANARY_HALF.get(kv_dtype, _CANARY_HALF[torch.float16]), 6, 0
    word, bits, shift = _CANARY_FORMATS[size]
    return size, word, bits, shift


def canary(
    stamp_area: torch.Tensor,
    pages: torch.Tensor,
    generations: torch.Tensor,
    purpose: int,
    kv_dtype: torch.dtype,
    *,
    stamp: bool,
) -> torch.Tensor:
    """Write (``stamp``) or check the canary stamps of these pages in one launch.

    ``stamp_area`` is the ``[num_pages, page_bytes]`` uint8 view of the first buffer. Returns
    the per-page ``intact`` mask when checking (an empty tensor when stamping)."""
    from engine_hooks.canary import STAMP_BYTES

    count = pages.numel()
    out = torch.empty(0 if stamp else count, dtype=torch.bool, device=pages.device)
    if count:
        size, word, bits, shift = _canary_format(kv_dtype)
        grid = (triton.cdiv(count, CHECK_BLOCK),)
        _canary_kernel[grid](
            stamp_area,
            stamp_area.stride(0),
            pages,
            generations,
            int(purpose),
            out if not stamp else pages,  # unused when stamping
            count,
            ELEMENT=size,
            WORD=word,
            BITS=bits,
            SHIFT=shift,
            STAMP_BYTES=STAMP_BYTES,
            STAMP=stamp,
            BLOCK=CHECK_BLOCK,
        )
    return out


def launch_config() -> dict[str, Any]:
    """The constants a GPU report prints next to its figures."""
    return {"seal_chunk": SEAL_CHUNK, "seal_block": SEAL_BLOCK, "check_block": CHECK_BLOCK}
