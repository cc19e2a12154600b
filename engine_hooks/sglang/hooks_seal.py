"""kvwatch's transfer seal on SGLang's own wire, on every transfer backend.

SGLang sends a small metadata row with the last chunk of every transfer (``MetadataBuffers``:
the first output token, cached-token counts, ...); every backend (Mooncake, NIXL, ...) moves it
with the KV. Its ``bootstrap_room`` row is 8 x 64 bits, of which SGLang uses the first word (the
room, to detect a metadata mix-up). The seal rides in the other seven, as 14 little-endian
32-bit words, so nothing is added to the wire and no backend changes:

    [2] MAGIC  [3] page count  [4] digest  [5] k  [6] writer's slice  [7 .. 7+k) page digests

``k`` is the page count when it is at most :data:`MAX_PAGE_DIGESTS` (a finding then names the
pages that differ), else 0 and the digest is the Adler-32 over all the pages (a finding names
every page of the transfer). The writer's slice is its attention-TP (size << 16 | rank): the
digests cover that rank's shard of the heads, which a decode rank of another width does not
hold (SGLang's backends send a prefill rank's head slices to several decode ranks, and the
metadata row to each). A decode rank whose own slice differs cannot check the seal and counts
``skipped{checksum, unsupported_layout}`` instead: never a finding (measured over Mooncake at
prefill TP 1 -> decode TP 2 before this word: every request a false ``digest`` on both decode
ranks). Rows of the first version (``kvw1``, no slice, up to 10 page digests) still read.
Decode's row is cleared by SGLang before each use, and prefill writes all seven words on every
last chunk, so a row never carries another request's seal.

- ``SchedulerDisaggregationPrefillMixin.send_kv_chunk`` (BEFORE, last chunk): prefill seals the
  pages it is sending (from the prefix decode promised to the end of the prompt), after the
  forward wrote them and before the transfer reads them.
- ``DecodeTransferQueue._commit_transfer_to_req`` (BEFORE): the transfer completed and the
  metadata row arrived; the seal is read from it before SGLang frees the row, kept for the
  request, and verified in ``process_prebuilt`` (before the first decode step reads the KV).
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import Any

import numpy as np

from engine_hooks import Seal
from engine_hooks.labels import Hook, Skip
from engine_hooks.sglang.guard import safe
from engine_hooks.sglang.runtime import runtime

MAGIC_V1 = 0x3177766B  # b"kvw1", little-endian: no writer slice, up to 10 page digests
MAGIC = 0x3277766B  # b"kvw2"
MAX_PAGE_DIGESTS = 9
_FIRST = 2  # 32-bit word index: words 0-1 are SGLang's bootstrap room
#: A TP group of one, rank 0: what a row without a slice (kvw1) was written by.
ONE_RANK = (1, 0)


def _words(buffers: Any, index: int) -> np.ndarray | None:
    """The row's 16 32-bit words as a writable view, or None (a row off the host, or another
    shape: this release's metadata has no room for the seal)."""
    rows = getattr(buffers, "bootstrap_room", None)
    if rows is None or rows.device.type != "cpu" or rows.dim() != 2 or rows.shape[1] < 8:
        return None
    if rows.element_size() != 8 or not rows.is_contiguous():
        return None
    words: np.ndarray = rows[index].numpy().view(np.uint32)
    return words


def encode(words: np.ndarray, seal: Seal | None, writer: tuple[int, int] = ONE_RANK) -> None:
    """``writer``: the sealing rank's attention-TP (size, rank)."""
    words[_FIRST:] = 0
    if seal is None:
        return
    k = len(seal.pages) if 0 < len(seal.pages) <= MAX_PAGE_DIGESTS else 0
    size, rank = writer
    slice_word = (size & 0xFFFF) << 16 | rank & 0xFFFF
    words[_FIRST : _FIRST + 5] = (MAGIC, seal.page_count, seal.digest, k, slice_word)
    if k:
        words[_FIRST + 5 : _FIRST + 5 + k] = seal.pages


def decode(words: np.ndarray) -> Seal | None:
    sealed = decode_with_writer(words)
    return None if sealed is None else sealed[0]


def decode_with_writer(words: np.ndarray) -> tuple[Seal, tuple[int, int]] | None:
    """The seal and its writer's attention-TP (size, rank), or None for a row without one."""
    magic, count, digest, k = (int(w) for w in words[_FIRST : _FIRST + 4])
    if magic == MAGIC_V1 and k <= 10 and (not k or k == count):
        pages = tuple(int(d) for d in words[_FIRST + 4 : _FIRST + 4 + k])
        return Seal(count, digest, pages), ONE_RANK
    if magic != MAGIC or k > MAX_PAGE_DIGESTS or (k and k != count):
        return None
    slice_word = int(words[_FIRST + 4])
    pages = tuple(int(d) for d in words[_FIRST + 5 : _FIRST + 5 + k])
    return Seal(count, digest, pages), (slice_word >> 16, slice_word & 0xFFFF)


def _fake(req: Any) -> bool:
    """Warm-up and health-check requests: nothing real is sent, nothing to seal."""
    utils = importlib.import_module("sglang.srt.disaggregation.utils")
    fake_host = getattr(utils, "FAKE_BOOTSTRAP_HOST", None)
    if fake_host is not None and getattr(req, "bootstrap_host", None) == fake_host:
        return True
    check = getattr(utils, "is_health_check_req", None)
    return bool(callable(check) and check(req))


def _seal_of(scheduler: Any, req: Any, end: int) -> Seal | None:
    allocator = scheduler.token_to_kv_pool_allocator
    watch = runtime().watch_for(allocator)
    if watch is None or watch.pool is None or _fake(req):
        return None
    page_size = int(allocator.page_size)
    start = int(getattr(req, "disagg_decode_prefix_len", 0) or 0)
    if start % page_size or end <= start:
        return None
    kv = getattr(req, "kv", None)
    row_index = getattr(kv, "req_pool_idx", None)
    if row_index is None:
        row_index = req.req_pool_idx
    row = scheduler.req_to_token_pool.req_to_token[row_index]
    pages = row[start:end:page_size] // page_size
    seal = watch.seal(str(req.rid), pages, tokens=end - start)
    if seal is not None and seal.page_count <= MAX_PAGE_DIGESTS:
        per_page = watch.seal_pages(pages)  # the pages' own digests: a finding names the page
        if per_page is not None:
            seal = replace(per_page, residue=seal.residue)
    return seal


@safe(Hook.SEAL)
def before_send_kv_chunk(scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """Prefill, last chunk: seal the request's pages into its metadata row."""
    last = kwargs.get("last_chunk", args[0] if args else False)
    if not last:
        return
    words = _words(scheduler.disagg_metadata_buffers, req.metadata_buffer_index)
    if words is None:
        return
    end = kwargs.get("end_idx", args[1] if len(args) > 1 else None)
    end = len(req.origin_input_ids) if end is None else int(end)
    encode(words, None)  # never leave an earlier request's seal in a reused row
    encode(words, _seal_of(scheduler, req, end), runtime().consensus.slice)


@safe(Hook.VERIFY)
def before_commit_transfer(queue: Any, decode_req: Any, *args: Any, **kwargs: Any) -> None:
    """Decode: the transfer's metadata arrived; keep the seal for ``process_prebuilt``."""
    rt = runtime()
    held = rt.ticket(decode_req.req)
    if held is None:
        return
    words = _words(queue.metadata_buffers, decode_req.metadata_buffer_index)
    sealed = None if words is None else decode_with_writer(words)
    held.seal, held.skip = None, None
    if sealed is not None:
        seal, writer = sealed
        if writer == rt.consensus.slice:
            held.seal = seal
        else:  # another rank's shard of the heads: not this rank's to check
            held.skip = Skip.UNSUPPORTED_LAYOUT
