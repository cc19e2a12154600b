"""Page size 1, SGLang's default: ``TokenToKVPoolAllocator``, where a page is one token slot.

The same checks as at page size N, through SGLang's own allocator, decode queue and scheduler
(``bed.py``): free-slot canaries, double frees, reserved canaries at admission, per-step tags,
the radix cache's dedup. Before kvwatch hooked this allocator every one of these was skipped
(``verifications_skipped{reason="no_pool"}``) and found nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.sglang import sgl
from tests.sglang.bed import DECODE_ON_CPU, NO_DECODE_ON_CPU, Bed
from tests.sglang.test_decode import arrive_and_reserve

SLOTS = 64


def token_allocator(pool: Any, need_sort: bool = False) -> Any:
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    return TokenToKVPoolAllocator(SLOTS, pool.dtype, "cpu", pool, need_sort)


@pytest.fixture(params=["mha", "mla"])
def pool(request: pytest.FixtureRequest, kv: Any) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    common = dict(
        size=SLOTS, page_size=1, dtype=torch.bfloat16, layer_num=2, device="cpu",
        enable_memory_saver=False,
    )  # fmt: skip
    if request.param == "mha":
        return MHATokenToKVPool(head_num=2, head_dim=8, **common)
    return MLATokenToKVPool(kv_lora_rank=16, qk_rope_head_dim=8, **common)


def write_slot(pool: Any, slot: int, value: float = 0.5) -> None:
    for buffer in sgl.buffers(pool):
        buffer[slot] = value


def test_the_token_allocator_gets_a_watch_over_its_slots(kv: Any, pool: Any) -> None:
    alloc = token_allocator(pool)
    watch = kv.watch_for(alloc)
    assert watch is not None and watch.pool is not None
    assert watch.pool.page_size == 1 and watch.pool.num_pages == SLOTS + 1  # padded slot 0
    taken = alloc.alloc(4).tolist()
    contents = sgl.spool(kv)
    assert sgl.counter(contents, "verifications", detector="canary") == 1
    assert sgl.counter(contents, "verifications_skipped", detector="canary", reason="no_pool") == 0
    assert taken == [1, 2, 3, 4]


def test_a_write_into_a_freed_slot_is_caught_at_the_next_allocation(kv: Any, pool: Any) -> None:
    alloc = token_allocator(pool)
    slots = alloc.alloc(4)
    alloc.free(slots)
    write_slot(pool, int(slots[2]))  # a late (aborted) transfer lands after the free
    alloc.alloc(SLOTS)  # the freed slots are at the back of the free list: take everything
    events = sgl.spool(kv).events(detector="canary", kind="write_to_free_page")
    assert [e["pages"] for e in events] == [[int(slots[2])]]


def test_a_double_free_of_slots_is_caught_and_a_free_group_frees_once(kv: Any, pool: Any) -> None:
    alloc = token_allocator(pool, need_sort=True)
    grouped = alloc.alloc(3)
    alloc.free_group_begin()
    alloc.free(grouped[:1])
    alloc.free(grouped[1:])
    alloc.free_group_end()  # one free of the three slots, not two
    assert sgl.spool(kv).events() == []
    slots = alloc.alloc(2)
    alloc.free(slots)
    alloc.free(slots)
    events = sgl.spool(kv).events(detector="page_tag", kind="double_free")
    assert [e["pages"] for e in events] == [slots.tolist()]


def test_a_cache_flush_stamps_every_slot_free(kv: Any, pool: Any) -> None:
    alloc = token_allocator(pool)
    slots = alloc.alloc(8)
    alloc.clear()  # every slot back on the free list at once (no free call)
    write_slot(pool, int(slots[5]))
    alloc.alloc(8)
    events = sgl.spool(kv).events(detector="canary", kind="write_to_free_page")
    assert [e["pages"] for e in events] == [[int(slots[5])]]


decode = pytest.mark.skipif(not DECODE_ON_CPU, reason=NO_DECODE_ON_CPU)


@decode
def test_the_incident_at_page_size_one(kv: Any) -> None:
    """Decode reserves 128 slots for the long prompt, prefill writes 16: 112 unwritten slots."""
    with Bed(page_size=1, radix=False, pages=512) as bed:
        req = arrive_and_reserve(bed, "rejected-1", 128)
        slots = bed.dst_pages(req)
        bed.transfer(req, written=16)
        assert bed.admit([req]) == []  # log mode: served
        events = sgl.spool(kv).events(detector="canary", kind="unwritten_page")
        assert [(e["request_id"], sorted(e["pages"])) for e in events] == [
            ("rejected-1", slots[16:])
        ]
        bed.run_until_idle()


@decode
@pytest.mark.parametrize("radix", [False, True], ids=["radix-off", "radix-on"])
def test_clean_traffic_at_page_size_one_is_checked_and_clean(kv: Any, radix: bool) -> None:
    with Bed(page_size=1, radix=radix, pages=512) as bed:
        reqs = [arrive_and_reserve(bed, f"clean-{i}", 40 + i, start=1 + 7 * i) for i in range(3)]
        for req in reqs:
            bed.transfer(req)
        assert bed.admit(reqs) == []
        bed.run_until_idle()
        assert sorted(r.rid for r in bed.streamer.finished) == [r.rid for r in reqs]
        contents = sgl.spool(kv)
        assert contents.events() == []
        assert sgl.counter(contents, "verifications", detector="canary") >= 3
        assert sgl.counter(contents, "verifications", detector="page_tag") >= 3
        for detector in ("canary", "page_tag"):
            skipped = sgl.counter(
                contents, "verifications_skipped", detector=detector, reason="no_pool"
            )
            assert skipped == 0
        assert kv.tickets == {}


@decode
def test_a_slot_reused_while_the_request_still_reads_it_is_stale(kv: Any) -> None:
    with Bed(page_size=1, radix=False, pages=128) as bed:
        running = arrive_and_reserve(bed, "running", 48)
        bed.transfer(running)
        bed.admit([running])
        bed.step()
        assert sgl.spool(kv).events() == []
        row = bed.rows.req_to_token[running.kv.req_pool_idx]
        stolen = int(row[20])
        bed.allocator.free(row[20:21].to(torch.int64).clone())  # freed by mistake while it runs
        bed.allocator.merge_and_sort_free()
        thief = arrive_and_reserve(bed, "thief", 1, start=900)
        assert bed.dst_pages(thief) == [stolen]
        bed.step()
        events = sgl.spool(kv).events(detector="page_tag", kind="stale_tag")
        assert [(e["request_id"], e["pages"]) for e in events] == [("running", [stolen])]


@decode
def test_radix_dedup_at_page_size_one_is_not_a_stale_slot(kv: Any) -> None:
    """Two requests with one prompt, admitted together: the tree insert frees the second one's
    slots and re-points its row; a third request takes the freed slots; nothing is stale."""
    prompt = 30
    with Bed(page_size=1, radix=True, pages=2 * prompt + 24) as bed:
        first = arrive_and_reserve(bed, "same-prompt-1", prompt)
        second = arrive_and_reserve(bed, "same-prompt-2", prompt)
        for req in (first, second):
            bed.transfer(req)
        bed.admit([first, second])
        row = bed.rows.req_to_token[second.kv.req_pool_idx]
        assert [int(t) for t in row[:prompt]] == bed.dst_pages(first)  # re-pointed
        other = arrive_and_reserve(bed, "other", prompt, start=1000)
        assert set(bed.dst_pages(second)) & set(bed.dst_pages(other))
        bed.transfer(other)
        bed.admit([other])
        bed.run_until_idle()
        assert sgl.spool(kv).events() == []


@decode
def test_the_slots_a_decode_step_starts_join_their_own_requests(kv: Any) -> None:
    """At page size 1 each decode step starts a slot for every running request (one
    ``extend_each`` for the batch): each slot joins its own request's ticket. A slot the first
    request's decode wrote, freed by mistake while it runs and handed to a new request, is a
    stale tag for that request alone."""
    with Bed(page_size=1, radix=False, pages=256) as bed:
        reqs = [arrive_and_reserve(bed, f"run-{i}", 20 + i, start=1 + 50 * i) for i in range(3)]
        for req in reqs:
            bed.transfer(req)
        assert bed.admit(reqs) == []
        for _ in range(3):
            bed.step()
        assert sgl.spool(kv).events() == []
        victim = reqs[0]
        row = bed.rows.req_to_token[victim.kv.req_pool_idx]
        reserved = set(bed.dst_pages(victim))
        decoded = [int(s) for s in row[len(victim.origin_input_ids) :][:3]]
        assert decoded and not set(decoded) & reserved  # slots its decode steps took
        stolen = decoded[-1]
        bed.allocator.free(torch.tensor([stolen], dtype=torch.int64))  # freed while it runs
        bed.allocator.merge_and_sort_free()
        thief = arrive_and_reserve(bed, "thief", 1, start=900)
        assert bed.dst_pages(thief) == [stolen]
        bed.step()
        events = sgl.spool(kv).events(detector="page_tag", kind="stale_tag")
        assert [(e["request_id"], e["pages"]) for e in events] == [("run-0", [stolen])]
