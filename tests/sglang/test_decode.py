"""Decode: reserved pages that prefill never wrote (the incident), and pages reused under a
running request, on a real allocator, pool, Req and ScheduleBatch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.sglang import sgl


def reserve(alloc: Any, req: Any, tokens: int) -> torch.Tensor:
    """Decode's prealloc: SGLang allocates the whole prompt (``alloc_extend`` from an empty
    prefix), then kvwatch's AFTER hook on ``DecodePreallocQueue._pre_alloc`` sees the result."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    from engine_hooks.sglang import hooks_disagg

    kv_loc = sgl.extend(alloc, tokens)
    # The queue as _pre_alloc's hook reads it: its allocator (no scheduler: not HiSparse).
    queue = DecodePreallocQueue.__new__(DecodePreallocQueue)
    queue.token_to_kv_pool_allocator = alloc
    queue.scheduler = None
    hooks_disagg.after_pre_alloc(kv_loc, queue, req, None, 0, 0)
    return kv_loc


def admit(reqs: list[Any]) -> None:
    """The BEFORE hook on ``process_prebuilt``, with a real ScheduleBatch of the requests."""
    from engine_hooks.sglang import hooks_disagg

    hooks_disagg.before_process_prebuilt(sgl.batch(reqs))


@pytest.mark.parametrize("kind", sorted(sgl.POOLS))
def test_the_incident_eight_reserved_one_written(kv: Any, kind: str) -> None:
    pool = sgl.POOLS[kind]()
    alloc = sgl.allocator(pool)
    # Two earlier users leave their KV in the pool, unzeroed.
    for user in ("user-a", "user-b"):
        loc = reserve(alloc, sgl.request(user, 16), 16)
        for page in sgl.pages_of(loc):
            sgl.write_page(pool, page, 0.25)
        admit([])
        alloc.free(loc)
    # The rejected request: decode reserves 8 pages for the long prompt, prefill writes one.
    req = sgl.request("rejected-1", 32)
    loc = reserve(alloc, req, 32)
    pages = sgl.pages_of(loc)
    assert len(pages) == 8
    sgl.write_page(pool, pages[0])
    admit([req])
    events = sgl.spool(kv).events(detector="canary", kind="unwritten_page")
    assert len(events) == 1
    assert events[0]["request_id"] == "rejected-1"
    assert sorted(events[0]["pages"]) == pages[1:]
    assert events[0]["action"] == "logged"
    assert req.to_finish is None  # log mode: served, recorded


def test_enforce_fails_the_request_before_decode_reads_it(kv_enforce: Any) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    pool = sgl.mha_pool()
    alloc = sgl.allocator(pool)
    req = sgl.request("rejected-2", 32)
    pages = sgl.pages_of(reserve(alloc, req, 32))
    sgl.write_page(pool, pages[0])
    admit([req])
    assert isinstance(req.to_finish, FINISH_ABORT)
    assert req.to_finish.status_code == 500
    events = sgl.spool(kv_enforce).events(detector="canary", kind="unwritten_page")
    assert events and events[0]["action"] == "enforced"


def test_a_fully_written_request_passes(kv: Any) -> None:
    pool = sgl.mla_pool()
    alloc = sgl.allocator(pool)
    req = sgl.request("clean-3", 30)
    for page in sgl.pages_of(reserve(alloc, req, 30)):
        sgl.write_page(pool, page)
    admit([req])
    contents = sgl.spool(kv)
    assert contents.events() == []
    assert req.to_finish is None
    assert sgl.counter(contents, "verifications", detector="canary") >= 2
    assert sgl.counter(contents, "verifications_skipped", detector="checksum", reason="no_seal")


def test_a_page_reused_while_the_request_still_references_it(kv: Any) -> None:
    from engine_hooks.sglang import hooks_disagg

    pool = sgl.mha_pool()
    alloc = sgl.allocator(pool)
    req = sgl.request("running-4", 16)
    loc = reserve(alloc, req, 16)
    for page in sgl.pages_of(loc):
        sgl.write_page(pool, page)
    admit([req])
    hooks_disagg.check_steps([req])  # a decode step: all good
    assert sgl.spool(kv).events() == []
    alloc.free(loc[8:12])  # one page freed by mistake while the request runs ...
    thief = sgl.pages_of(alloc.alloc(4))  # ... and handed to another request
    assert thief == sgl.pages_of(loc[8:12])
    hooks_disagg.check_steps([req])
    events = sgl.spool(kv).events(detector="page_tag", kind="stale_tag")
    assert [(e["request_id"], e["pages"]) for e in events] == [("running-4", thief)]


def test_a_finished_request_drops_its_ticket(kv: Any) -> None:
    from engine_hooks.sglang import hooks_disagg

    alloc = sgl.allocator(sgl.mha_pool())
    req = sgl.request("done-5", 8)
    reserve(alloc, req, 8)
    assert kv.ticket("done-5") is not None
    req.to_finish = None
    req.finished_reason = object()
    hooks_disagg.check_steps([req])
    assert kv.ticket("done-5") is None


def test_page_size_one_is_reported_as_not_covered(kv: Any) -> None:
    """SGLang's default page size (1) uses TokenToKVPoolAllocator, which kvwatch does not hook:
    decode's reservations show up as skipped canary and page-tag checks, not as silence."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from engine_hooks.sglang import hooks_disagg

    pool = MHATokenToKVPool(
        size=sgl.SIZE,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )
    alloc = TokenToKVPoolAllocator(sgl.SIZE, torch.bfloat16, "cpu", pool, False)
    queue = DecodePreallocQueue.__new__(DecodePreallocQueue)
    queue.token_to_kv_pool_allocator = alloc
    queue.scheduler = None
    req = sgl.request("unpaged-6", 8)
    hooks_disagg.after_pre_alloc(alloc.alloc(8), queue, req, None, 0, 0)
    contents = sgl.spool(kv)
    for detector in ("canary", "page_tag"):
        skipped = sgl.counter(
            contents, "verifications_skipped", detector=detector, reason="no_pool"
        )
        assert skipped == 1
    assert kv.ticket("unpaged-6") is None
