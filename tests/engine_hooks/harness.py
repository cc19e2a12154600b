"""A prefill/decode pair in one process, driving engine_hooks as an engine would."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine_hooks import KVWatch, Mode, PagedKVPool, Scrub, Seal, Ticket, Verdict, canary
from engine_hooks.pagestate import DevicePages, HostPages
from engine_hooks.pool import Layout

PAGE_SIZE = 4


def make_pool(kind: str, dtype: torch.dtype, pages: int, layers: int = 2) -> PagedKVPool:
    """MHA (K and V per layer) or MLA (one latent buffer per layer) or vLLM-style page-major."""
    storage, kv_dtype = dtype, None
    if dtype in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)):
        storage, kv_dtype = torch.uint8, dtype  # SGLang stores fp8 KV as uint8
    slots = pages * PAGE_SIZE
    if kind == "mha":
        shape: tuple[int, ...] = (slots, 2, 8)
        buffers = [torch.zeros(shape, dtype=storage) for _ in range(2 * layers)]
        return PagedKVPool(buffers, PAGE_SIZE, kv_dtype=kv_dtype)
    if kind == "mla":
        buffers = [torch.zeros((slots, 1, 24), dtype=storage) for _ in range(layers)]
        return PagedKVPool(buffers, PAGE_SIZE, kv_dtype=kv_dtype)
    if kind == "vllm":
        buffers = [torch.zeros((pages, PAGE_SIZE, 2, 8), dtype=storage) for _ in range(2 * layers)]
        return PagedKVPool(buffers, PAGE_SIZE, layout=Layout.PAGES, kv_dtype=kv_dtype)
    raise ValueError(kind)


def fill(pool: PagedKVPool, pages: Sequence[int], rng: random.Random) -> None:
    """Write KV for these pages: finite values, as a model writes (never NaN)."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    storage = pool.buffers[0].dtype
    for page in pages:
        for view in pool.page(page):
            if storage == torch.uint8:  # fp8 bit patterns other than 0x7F/0xFF (the NaNs)
                low = torch.randint(0, 0x7F, (view.numel(),), generator=gen)
                sign = torch.randint(0, 2, (view.numel(),), generator=gen) << 7
                view.copy_((low | sign).to(torch.uint8))
            else:
                count = view.numel() // storage.itemsize
                values = torch.randn(count, generator=gen).to(storage)
                view.copy_(values.view(torch.uint8))


def as_list(values: object) -> list[object]:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)  # type: ignore[call-overload]


def backends_agree(dtype: torch.dtype, kind: str, *, kernel: bool, ops: int) -> None:
    """The host and device page-state backends (the device one on CPU, as torch ops or the
    Triton kernels) agree on ``ops`` random operations."""
    host_pool, device_pool = make_pool(kind, dtype, 32), make_pool(kind, dtype, 32)
    host, device = HostPages(host_pool), DevicePages(device_pool, kernel=kernel)
    assert device.kernels is kernel
    rng = random.Random(3)
    for _ in range(ops):
        pages = rng.sample(range(32), rng.randint(1, 12))  # both sides of _BATCH_PAGES
        op = rng.choice(
            ["bump", "stamp", "intact", "free", "own", "stale", "scribble", "claim", "sources",
             "scrub", "tag", "tail"]
        )  # fmt: skip
        h, d = host.index(pages), device.index(pages)
        purpose = rng.choice(list(canary.Purpose))
        owner, now = rng.randint(-1, 5), rng.randint(0, 10**6) / 8
        if op == "bump":
            host.bump(h, owner, now)
            device.bump(d, owner, now)
        elif op == "claim":
            host.claim(h, owner, now)
            device.claim(d, owner, now)
        elif op == "sources":
            assert host.sources(h) == device.sources(d)
            then = host.written_tags(h)
            assert then == device.written_tags(d).tolist()
            assert host.sources(h, then) == device.sources(d, torch.tensor(then))
        elif op == "scrub":
            host.scrub(h)
            device.scrub(d)
        elif op == "tail":
            used = rng.randint(0, PAGE_SIZE)
            host.scrub_tail(pages[0], used)
            device.scrub_tail(pages[0], used)
        elif op == "tag":  # a remote writer's tags: now, one generation back, or stale
            for pool, state in ((host_pool, host), (device_pool, device)):
                gens = as_list(state.generations(state.index(pages)))
                tags = [max(0, int(g) - p % 3) for p, g in zip(pages, gens, strict=True)]  # type: ignore[call-overload]
                pool.mark_written(pages, tags)
        elif op == "stamp":
            host.stamp(h, host.generations(h), purpose)
            device.stamp(d, device.generations(d), purpose)
        elif op == "intact":
            assert host.intact(h, host.generations(h), purpose) == as_list(
                device.intact(d, device.generations(d), purpose)
            )
        elif op == "free":
            flag = rng.random() < 0.5
            assert host.set_free(h, flag) == as_list(device.set_free(d, flag))
        elif op == "own":  # nobody named, one owner, or one owner per page
            named = rng.choice([None, owner, [rng.randint(-1, 5) for _ in pages]])
            host.own_writes(h, now, named)
            device.own_writes(d, now, named)
        elif op == "stale":
            expected = [rng.randint(0, 3) for _ in pages]
            assert host.stale(h, expected) == as_list(device.stale(d, torch.tensor(expected)))
        else:  # a write into the pages' stamp area and ends, the same on both pools
            for pool in (host_pool, device_pool):
                for p in pages:
                    for view in pool.page(p):
                        view[:4] = p % 7
                        view[-3:] = p % 5 + 1
        assert host.generations(list(range(32))) == as_list(
            device.generations(device.index(list(range(32))))
        )
    for host_view, device_view in zip(host_pool.page_views, device_pool.page_views, strict=True):
        assert torch.equal(host_view, device_view)
    assert torch.equal(host_pool.tag_store, device_pool.tag_store)
    assert torch.equal(host.holders_t, device.holders.cpu())
    everything = list(range(32))
    assert host.sources(everything) == device.sources(device.index(everything))


@dataclass
class Pair:
    """Decode (reserves, verifies, reads) and prefill (computes, writes, seals)."""

    decode: KVWatch
    prefill: KVWatch
    decode_free: list[int]
    prefill_free: list[int]
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    #: The test's own record: the request whose KV each decode page holds (the ground truth
    #: for the hooks' sources), kept where the pair writes pages.
    holder: dict[int, str] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        kind: str,
        dtype: torch.dtype,
        pages: int = 64,
        mode: Mode | str | Mapping[str, Mode | str] = Mode.LOG,
        spool: Path | None = None,
        scrub: Scrub | str = Scrub.OFF,
    ) -> Pair:
        d, p = (
            KVWatch(
                make_pool(kind, dtype, pages),
                role=role,
                engine="minipd",
                mode=mode,
                spool=spool,
                scrub=scrub,
            )
            for role in ("decode", "prefill")
        )
        pair = cls(d, p, list(range(pages)), list(range(pages)))
        d.on_free(pair.decode_free)
        p.on_free(pair.prefill_free)
        return pair

    @property
    def dpool(self) -> PagedKVPool:
        assert self.decode.pool is not None
        return self.decode.pool

    @property
    def ppool(self) -> PagedKVPool:
        assert self.prefill.pool is not None
        return self.prefill.pool

    def alloc(self, side: str, count: int, rid: str) -> tuple[list[int], list[Verdict]]:
        free = self.decode_free if side == "decode" else self.prefill_free
        watch = self.decode if side == "decode" else self.prefill
        self.rng.shuffle(free)
        pages = free[:count]
        del free[:count]
        return pages, watch.on_alloc(pages, rid)

    def free(self, side: str, pages: Sequence[int]) -> list[Verdict]:
        (self.decode_free if side == "decode" else self.prefill_free).extend(pages)
        watch = self.decode if side == "decode" else self.prefill
        return watch.on_free(pages)

    def reserve(self, rid: str, count: int) -> tuple[list[int], Ticket]:
        pages, verdicts = self.alloc("decode", count, rid)
        assert verdicts == []
        ticket = self.decode.on_reserve(rid, pages)
        assert ticket is not None
        return pages, ticket

    def prefill_write(
        self, rid: str, dst: Sequence[int], ticket: Ticket, written: int | None = None
    ) -> tuple[list[int], Seal | None]:
        """Prefill computes ``written`` pages, writes them one-sided into decode, seals them."""
        count = len(dst) if written is None else written
        src, verdicts = self.alloc("prefill", count, rid)
        assert verdicts == []
        fill(self.ppool, src, self.rng)
        for s, d in zip(src, dst[:count], strict=True):
            for sv, dv in zip(self.ppool.page(s), self.dpool.page(d), strict=True):
                dv.copy_(sv)
        self.dpool.mark_written(dst[:count], ticket.tags[:count])
        self.holder.update(dict.fromkeys(dst[:count], rid))
        seal = self.prefill.seal(rid, src)
        self.free("prefill", src)
        return src, seal

    def take(self, pages: Sequence[int], rid: str) -> Ticket:
        """Decode hands these free pages to ``rid``: allocated and reserved (not written)."""
        for page in pages:
            self.decode_free.remove(page)
        assert self.decode.on_alloc(pages, rid) == []
        ticket = self.decode.on_reserve(rid, pages)
        assert ticket is not None
        return ticket

    def reuse(self, pages: Sequence[int], rid: str) -> Ticket:
        """Pages freed by one request, taken by ``rid`` and written for it, cleanly."""
        self.free("decode", pages)
        ticket = self.take(pages, rid)
        _, seal = self.prefill_write(rid, pages, ticket)
        assert self.decode.verify_admit(ticket, seal) == []
        return ticket

    def late_write(self, rid: str, pages: Sequence[int], tags: Sequence[int]) -> None:
        """A transfer of ``rid``'s lands late in decode's pages, with the tags it was given."""
        fill(self.dpool, pages, self.rng)
        self.dpool.mark_written(pages, tags)
        self.holder.update(dict.fromkeys(pages, rid))

    def exposed(self, pages: Sequence[int], reader: str) -> dict[str, int]:
        """The ground truth: other requests whose KV these pages hold, pages each."""
        out: dict[str, int] = {}
        for page in pages:
            rid = self.holder.get(page)
            if rid is not None and rid != reader:
                out[rid] = out.get(rid, 0) + 1
        return out

    def holds_data(self, page: int) -> bool:
        """Whether the decode page holds any nonzero byte past the canary stamp."""
        first, *rest = self.dpool.page(page)
        return bool(first[canary.STAMP_BYTES :].any()) or any(bool(v.any()) for v in rest)

    def clean_request(self, rid: str, count: int) -> tuple[list[int], Ticket, list[Verdict]]:
        dst, ticket = self.reserve(rid, count)
        _, seal = self.prefill_write(rid, dst, ticket)
        return dst, ticket, self.decode.verify_admit(ticket, seal)
