"""The incident's 8-page walkthrough, in one process, with every detector watching.

Run: ``python -m engine_hooks.walkthrough [--spool DIR] [--mode log|enforce]``.

A decode pool of 16 pages that nobody clears; two users write and leave; a rejected request
reserves 8 pages while prefill writes 1 (the SGLang path before v0.5.20). Then a late write into
a freed page, a flipped bit in a transfer, a page reallocated under a running request, an
aborted request at an admission queue, the pool-versus-context band, and a clean request.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine_hooks import KVWatch, Mode, PagedKVPool, Ticket, Verdict
from engine_hooks.testing import read_spool

PAGE_SIZE = 4
PAGES = 16
LAYERS = 2
HEADS, HEAD_DIM = 2, 8


class Allocator:
    """A free list that hands out pages without clearing them, as SGLang's does."""

    def __init__(self, watch: KVWatch, pages: int) -> None:
        self.watch = watch
        self.free = list(range(pages))
        watch.on_free(self.free)  # stamp the whole pool free at start

    def alloc(self, count: int, rid: str) -> list[int]:
        pages, self.free = self.free[:count], self.free[count:]
        report(self.watch.on_alloc(pages, rid))
        return pages

    def release(self, pages: Sequence[int]) -> None:
        report(self.watch.on_free(pages))
        self.free.extend(pages)


def make_pool() -> PagedKVPool:
    # MHA: one K and one V buffer per layer, [token_slots, heads, head_dim], bf16.
    slots = PAGES * PAGE_SIZE
    buffers = [torch.zeros(slots, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2 * LAYERS)]
    return PagedKVPool(buffers, PAGE_SIZE)


def write_pages(
    src: PagedKVPool, src_pages: Sequence[int], dst: PagedKVPool, dst_pages: Sequence[int]
) -> None:
    """Prefill's one-sided write of whole pages into decode's pool."""
    for s, d in zip(src_pages, dst_pages, strict=True):
        for s_view, d_view in zip(src.page(s), dst.page(d), strict=True):
            d_view.copy_(s_view)


def compute_kv(pool: PagedKVPool, pages: Sequence[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for page in pages:
        for buf in pool.buffers:
            rows = buf[page * PAGE_SIZE : (page + 1) * PAGE_SIZE]
            rows.copy_(torch.randn(rows.shape, generator=gen).to(buf.dtype))


def report(verdicts: Sequence[Verdict]) -> None:
    for v in verdicts:
        action = "request FAILED (enforce)" if v.blocks else "logged, request served"
        print(
            f"    caught: detector={v.detector:<9} kind={v.kind:<19} "
            f"request={v.request_id or '-'} pages={list(v.pages)}  [{action}]"
        )


def exposure_line(verdicts: Sequence[Verdict], unwritten: int) -> str:
    """What the request's reads would have exposed without kvwatch, from its verdicts' sources
    (the requests whose KV the pages held, as the spool names them): never more."""
    held: dict[str, int] = {}
    for v in verdicts:
        for s in v.sources:
            held[s.request_id] = max(held.get(s.request_id, 0), s.pages)
    pages = f"the {unwritten} page(s) nobody wrote for it" if unwritten else "its pages"
    if not held:
        return f"{pages} hold no other request's keys and values: nothing to disclose"
    named = ", ".join(f"{rid} ({count} page(s))" for rid, count in sorted(held.items()))
    return f"without kvwatch, attention would now read {pages}: the keys and values of {named}"


def heading(text: str) -> None:
    print(f"\n== {text}")


@dataclass
class Bed:
    """A decode and a prefill engine, each a pool, its hooks and an allocator."""

    decode_pool: PagedKVPool
    prefill_pool: PagedKVPool
    decode: KVWatch
    prefill: KVWatch
    d_alloc: Allocator
    p_alloc: Allocator

    @classmethod
    def build(cls, mode: str, spool: str) -> Bed:
        decode_pool, prefill_pool = make_pool(), make_pool()
        watches = [
            KVWatch(pool, role=role, engine="minipd", model="walkthrough", mode=mode, spool=spool)
            for pool, role in ((decode_pool, "decode"), (prefill_pool, "prefill"))
        ]
        decode, prefill = watches
        return cls(
            decode_pool,
            prefill_pool,
            decode,
            prefill,
            Allocator(decode, PAGES),
            Allocator(prefill, PAGES),
        )

    def transfer(
        self, rid: str, prompt_pages: int, written_pages: int, seed: int
    ) -> tuple[list[int], Ticket, list[Verdict]]:
        """The incident's three steps: decode reserves, prefill writes and seals, decode admits.
        Also the verdicts of the request's reads (admit's), for the narration."""
        dst = self.d_alloc.alloc(prompt_pages, rid)
        ticket = self.decode.on_reserve(rid, dst)
        assert ticket is not None
        src = self.p_alloc.alloc(written_pages, rid)
        compute_kv(self.prefill_pool, src, seed)
        write_pages(self.prefill_pool, src, self.decode_pool, dst[:written_pages])
        self.decode_pool.mark_written(dst[:written_pages], ticket.tags[:written_pages])
        seal = self.prefill.seal(rid, src)
        self.p_alloc.release(src)
        verdicts = self.decode.verify_admit(ticket, seal)
        report(verdicts)
        if not verdicts:
            print(f"    {rid}: all detectors passed ({prompt_pages} pages verified)")
        return dst, ticket, verdicts


def stale_reads(bed: Bed) -> None:
    """The scenes where a request reads pages it never wrote."""
    decode, d_alloc, decode_pool = bed.decode, bed.d_alloc, bed.decode_pool
    heading("Two users write their prompts and finish; their pages go back unzeroed")
    for user, seed in (("user-a", 1), ("user-b", 2)):
        pages, _, _ = bed.transfer(user, 4, 4, seed)
        d_alloc.release(pages)

    heading("A rejected over-length request: the admission queue checks finished(), not to_finish")
    report([decode.on_admission("rejected-1", "decode_prealloc", aborted=True, finished=False)])
    heading("... decode reserves 8 pages, prefill writes 1 (the placeholder), decode admits")
    pages, _, verdicts = bed.transfer("rejected-1", 8, 1, 3)
    print(f"    {exposure_line(verdicts, 7)}")
    d_alloc.release(pages)

    heading("A late RDMA write lands in a page after its request was aborted and the page freed")
    late = d_alloc.alloc(2, "aborted-2")
    late_ticket = decode.on_reserve("aborted-2", late)
    assert late_ticket is not None
    d_alloc.release(late)
    compute_kv(decode_pool, late[:1], 9)  # the write nobody waited for, with its page tag
    decode_pool.mark_written(late[:1], late_ticket.tags[:1])
    d_alloc.free.sort(key=lambda p: p != late[0])  # the next allocation takes that page
    taken, _, verdicts = bed.transfer("next-owner", 2, 2, 4)
    print(f"    {exposure_line(verdicts, 0)}")
    d_alloc.release(taken)


def other_faults(bed: Bed) -> None:
    """A corrupted transfer, a double free, and a clean request."""
    decode, d_alloc, p_alloc = bed.decode, bed.d_alloc, bed.p_alloc
    heading("A flipped bit in a transfer")
    dst = d_alloc.alloc(3, "flip-3")
    ticket = decode.on_reserve("flip-3", dst)
    assert ticket is not None
    src = p_alloc.alloc(3, "flip-3")
    compute_kv(bed.prefill_pool, src, 5)
    write_pages(bed.prefill_pool, src, bed.decode_pool, dst)
    bed.decode_pool.mark_written(dst, ticket.tags)
    bed.decode_pool.page(dst[1])[0][7] ^= 0x10
    report(decode.verify_admit(ticket, bed.prefill.seal("flip-3", src)))
    p_alloc.release(src)
    d_alloc.release(dst)

    heading("A page reallocated while a running request still references it (double free)")
    running, run_ticket, _ = bed.transfer("running-4", 2, 2, 6)
    d_alloc.release(running[:1])  # freed by mistake while still in use
    d_alloc.free.sort(key=lambda p: p != running[0])
    thief = d_alloc.alloc(1, "thief-5")  # ... and handed to another request
    print("    decode step of running-4:")
    report(decode.check_step(run_ticket))
    d_alloc.release(running[1:] + thief)

    heading("A clean request")
    pages, _, _ = bed.transfer("clean-6", 4, 4, 7)
    d_alloc.release(pages)


def spool_summary(spool: str) -> None:
    contents = read_spool(spool)
    heading(
        f"What the hooks wrote to the spool ({len(contents.records)} records, "
        f"{sum(contents.errors.values())} unreadable)"
    )
    for event in contents.events():
        print(
            f"    event  {event['detector']:<9} {event['kind']:<19} "
            f"request={event['request_id'] or '-':<11} "
            f"pages={event['pages']} action={event['action']}"
        )
    counters = contents.latest_counters()
    for name in ("verifications", "mismatches"):
        for labels, value in sorted(counters.get(name, {}).items()):
            print(f"    counter {name}{dict(labels)} = {value:g}")
    print(f"\nRead it again with: kvwatch spool {spool} --events")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--spool", default=None, help="spool directory (default: a new temp dir)")
    parser.add_argument("--mode", default="log", choices=[m.value for m in Mode])
    args = parser.parse_args(argv)
    spool = args.spool or tempfile.mkdtemp(prefix="kvwatch-walkthrough-")
    bed = Bed.build(args.mode, spool)

    print(f"kvwatch detector walkthrough (mode={args.mode}); spool: {spool}")
    heading("Pool versus context at start-up (the Workers AI numbers)")
    band = bed.decode.report_pool(681_280, 1_048_576, PAGE_SIZE)
    assert band is not None
    print(
        f"    pool={band.pool_tokens:,} context={band.context_length_tokens:,} "
        f"unsafe band={band.unsafe_band_tokens:,} tokens ({band.unsafe_share:.0%} of the window)"
    )
    stale_reads(bed)
    other_faults(bed)
    bed.decode.close()
    bed.prefill.close()
    spool_summary(spool)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
