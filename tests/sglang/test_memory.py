"""Page tags and free-page canaries on the real PagedTokenToKVPoolAllocator, MHA and MLA pools."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.sglang import sgl


@pytest.fixture(params=sorted(sgl.POOLS))
def pool(request: pytest.FixtureRequest, kv: Any) -> Any:
    return sgl.POOLS[request.param]()


def test_allocator_gets_a_watch_over_the_pool(kv: Any, pool: Any) -> None:
    alloc = sgl.allocator(pool)
    watch = kv.watch_for(alloc)
    assert watch is not None and watch.pool is not None
    assert watch.pool.num_pages == alloc.num_pages + 1  # SGLang's padded page 0
    assert watch._canary is not None and watch._canary.usable
    assert watch._state is not None
    # Every free page carries a free stamp from the start.
    assert all(watch._state.was_free(list(range(1, alloc.num_pages + 1))))


def test_alloc_paths_and_release_bump_tags(kv: Any, pool: Any) -> None:
    alloc = sgl.allocator(pool)
    # Before v0.5.22, alloc_extend/alloc_decode run Triton kernels only, which need a GPU.
    sgl.needs("0.5.22", sgl.extend_on_cpu(alloc), "a torch alloc_extend/alloc_decode off CUDA")
    state = kv.watch_for(alloc)._state
    first = sgl.pages_of(alloc.alloc(8))
    assert len(first) == 2
    assert state.generations(first) == [1, 1]
    assert not any(state.was_free(first))

    extend = alloc.alloc_extend(
        prefix_lens=torch.tensor([0]),
        prefix_lens_cpu=torch.tensor([0]),
        seq_lens=torch.tensor([6]),
        seq_lens_cpu=torch.tensor([6]),
        last_loc=torch.tensor([-1]),
        extend_num_tokens=6,
    )
    ext_pages = sgl.pages_of(extend)
    assert len(ext_pages) == 2 and state.generations(ext_pages) == [1, 1]

    # One decode token for a request whose 8 tokens fill its two pages: a new page.
    last = int(extend[-1]) + 2  # pretend two more tokens were extended into its second page
    decode = alloc.alloc_decode(
        seq_lens=torch.tensor([9]), seq_lens_cpu=torch.tensor([9]), last_loc=torch.tensor([last])
    )
    dec_pages = sgl.pages_of(decode)
    assert len(dec_pages) == 1 and state.generations(dec_pages) == [1]

    alloc.free(torch.cat([alloc_token(first), extend]))
    assert all(state.was_free(first + ext_pages))
    again = sgl.pages_of(alloc.alloc(16))
    assert set(first + ext_pages) <= set(again)
    assert state.generations(first) == [2, 2]
    contents = sgl.spool(kv)
    assert contents.events() == []
    assert sgl.counter(contents, "verifications", detector="canary") == 4


def alloc_token(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * sgl.PAGE_SIZE + i for p in pages for i in range(sgl.PAGE_SIZE)])


def test_write_into_a_released_page_is_caught_at_the_next_allocation(kv: Any, pool: Any) -> None:
    alloc = sgl.allocator(pool)
    pages = sgl.pages_of(alloc.alloc(8))
    alloc.free(alloc_token(pages))
    sgl.write_page(pool, pages[1])  # a late (aborted) transfer lands after the free
    taken = sgl.pages_of(alloc.alloc(8))  # released pages go to the front of the free list
    assert taken == pages
    events = sgl.spool(kv).events(detector="canary", kind="write_to_free_page")
    assert [e["pages"] for e in events] == [[pages[1]]]
    assert events[0]["action"] == "logged"


def test_double_free_is_caught(kv: Any, pool: Any) -> None:
    alloc = sgl.allocator(pool)
    pages = sgl.pages_of(alloc.alloc(4))
    alloc.free(alloc_token(pages))
    alloc.free(alloc_token(pages))
    events = sgl.spool(kv).events(detector="page_tag", kind="double_free")
    assert [e["pages"] for e in events] == [pages]


def test_staged_free_pages_merge_path(kv: Any, pool: Any) -> None:
    """need_sort (PD mode): frees are staged and merged, sorted, when the free list runs short;
    the pages an allocation took are still the ones tagged."""
    alloc = sgl.allocator(pool, need_sort=True)
    state = kv.watch_for(alloc)._state
    everything = sgl.pages_of(alloc.alloc(sgl.SIZE))
    assert len(everything) == alloc.num_pages
    alloc.free(alloc_token(everything[8:]))
    alloc.free(alloc_token(everything[:4]))
    sgl.write_page(pool, everything[0])
    taken = sgl.pages_of(alloc.alloc(8))  # merges the staged pages, sorted: the lowest two
    assert taken == sorted(everything[:4] + everything[8:])[:2]
    assert state.generations(taken) == [2, 2]
    assert state.generations(everything[4:8]) == [1, 1, 1, 1]
    events = sgl.spool(kv).events(detector="canary", kind="write_to_free_page")
    assert [e["pages"] for e in events] == [[everything[0]]]


def test_fp8_pool_stored_as_uint8(kv: Any) -> None:
    pool = sgl.mha_pool(dtype=torch.float8_e4m3fn)
    assert pool.k_buffer[0].dtype == torch.uint8
    alloc = sgl.allocator(pool)
    watch = kv.watch_for(alloc)
    assert watch.pool.kv_dtype == torch.float8_e4m3fn and watch._canary.usable
    pages = sgl.pages_of(alloc.alloc(4))
    alloc.free(alloc_token(pages))
    for buf in sgl.buffers(pool):
        buf[pages[0] * sgl.PAGE_SIZE] = 0x38  # 1.0 in e4m3
    alloc.alloc(4)
    assert sgl.spool(kv).events(detector="canary", kind="write_to_free_page")


def test_hooks_never_raise_into_the_engine(kv: Any, pool: Any) -> None:
    from engine_hooks.sglang import hooks_memory

    alloc = sgl.allocator(pool)
    errors = kv.hook_errors
    hooks_memory.before_release(alloc, "not a tensor")
    assert kv.hook_errors == errors + 1
    # The allocator still works through its hooks.
    assert alloc.alloc(4) is not None


def test_a_cache_flush_stamps_every_page_free(kv: Any, pool: Any) -> None:
    """``clear()`` (SGLang's flush_cache) puts every page back at once, without a release: a late
    write into a page that was in use before the flush is still caught at its next allocation."""
    alloc = sgl.allocator(pool)
    pages = sgl.pages_of(alloc.alloc(8))
    alloc.clear()
    sgl.write_page(pool, pages[0])
    taken = sgl.pages_of(alloc.alloc(8))
    assert taken == pages
    events = sgl.spool(kv).events(detector="canary", kind="write_to_free_page")
    assert [e["pages"] for e in events] == [[pages[0]]]
