"""Decode, driven through SGLang's own code (see ``bed.py``): the door, ``_pre_alloc``,
``process_prebuilt``, ``process_batch_result`` and the decode steps run as SGLang runs them, and
kvwatch's hooks fire because ``load_plugins()`` put them there. No test calls a hook."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.sglang import sgl
from tests.sglang.bed import DECODE_ON_CPU, NO_DECODE_ON_CPU, PAGE_SIZES, Bed

pytestmark = pytest.mark.skipif(not DECODE_ON_CPU, reason=NO_DECODE_ON_CPU)


@pytest.fixture
def bed(kv: Any) -> Iterator[Bed]:
    with Bed(page_size=16, radix=False) as b:
        yield b


@pytest.fixture
def bed_enforce(kv_enforce: Any) -> Iterator[Bed]:
    with Bed(page_size=16, radix=False) as b:
        yield b


def tokens(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def arrive_and_reserve(bed: Bed, rid: str, n: int, start: int = 1) -> Any:
    req = bed.request(rid, tokens(n, start))
    assert bed.arrive(req)
    bed.reserve(req)
    return req


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_the_incident_eight_reserved_one_written(kv: Any, kind: str) -> None:
    with Bed(page_size=16, radix=False, kind=kind) as bed:
        # Two earlier users leave their KV in the pool, unzeroed.
        for user in ("user-a", "user-b"):
            req = arrive_and_reserve(bed, user, 64, start=500)
            bed.transfer(req)
            bed.admit([req])
        bed.run_until_idle()
        # The rejected request: decode reserves 8 pages for the long prompt, prefill writes one.
        req = arrive_and_reserve(bed, "rejected-1", 128)
        pages = bed.dst_pages(req)
        assert len(pages) == 8
        bed.transfer(req, written=1)
        assert bed.admit([req]) == []  # log mode: served
        events = sgl.spool(kv).events(detector="canary", kind="unwritten_page")
        assert [(e["request_id"], sorted(e["pages"]), e["action"]) for e in events] == [
            ("rejected-1", pages[1:], "logged")
        ]
        assert events[0]["instance"]
        bed.run_until_idle()


def test_enforce_fails_the_request_before_decode_reads_it(
    kv_enforce: Any, bed_enforce: Bed
) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    bed = bed_enforce
    req = arrive_and_reserve(bed, "rejected-2", 128)
    pages = bed.dst_pages(req)
    bed.transfer(req, written=1)
    free_before = bed.allocator.available_size()
    assert bed.admit([req]) == [req]  # SGLang's result path finished it at admission
    assert isinstance(req.finished_reason, FINISH_ABORT)
    assert req.finished_reason.status_code == 500
    assert bed.streamer.finished == [req]
    assert bed.running is None or bed.running.is_empty()  # never decoded
    assert bed.allocator.available_size() == free_before + len(pages) * bed.page_size
    events = sgl.spool(kv_enforce).events(detector="canary", kind="unwritten_page")
    assert [e["action"] for e in events] == ["enforced"]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("radix", [False, True], ids=["radix-off", "radix-on"])
def test_fully_written_requests_pass(kv: Any, page_size: int, radix: bool) -> None:
    with Bed(page_size=page_size, radix=radix, pages=48) as bed:
        reqs = [arrive_and_reserve(bed, f"clean-{i}", 3 * page_size + i) for i in range(3)]
        for req in reqs:
            bed.transfer(req)
        assert bed.admit(reqs) == []
        bed.run_until_idle()
        assert sorted(r.rid for r in bed.streamer.finished) == [r.rid for r in reqs]
        contents = sgl.spool(kv)
        assert contents.events() == []
        assert sgl.counter(contents, "verifications", detector="canary") >= 3
        assert sgl.counter(contents, "verifications", detector="page_tag") >= 3
        assert kv.tickets == {}  # every finished request let go of its ticket


def test_a_page_reused_while_the_request_still_references_it(kv: Any, bed: Bed) -> None:
    running = arrive_and_reserve(bed, "running-4", 48)
    bed.transfer(running)
    bed.admit([running])
    bed.step()
    assert sgl.spool(kv).events() == []
    row = bed.rows.req_to_token[running.kv.req_pool_idx]
    # One page freed by mistake while the request runs ... and handed to another request.
    stolen = int(row[16]) // bed.page_size
    bed.allocator.free(row[16:32].to(bed.allocator.free_pages.dtype).clone())
    bed.allocator.merge_and_sort_free()
    thief = arrive_and_reserve(bed, "thief", 16)
    assert bed.dst_pages(thief) == [stolen]
    bed.step()
    events = sgl.spool(kv).events(detector="page_tag", kind="stale_tag")
    assert [(e["request_id"], e["pages"]) for e in events] == [("running-4", [stolen])]


def test_enforce_stops_a_request_whose_page_was_reused(kv_enforce: Any, bed_enforce: Bed) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    bed = bed_enforce
    running = arrive_and_reserve(bed, "running-5", 48)
    bed.transfer(running)
    bed.admit([running])
    row = bed.rows.req_to_token[running.kv.req_pool_idx]
    bed.allocator.free(row[16:32].to(bed.allocator.free_pages.dtype).clone())
    bed.allocator.merge_and_sort_free()
    arrive_and_reserve(bed, "thief", 16)
    bed.step()  # the step that finds it marks the request; SGLang finishes it at the next
    assert bed.step() == [running]
    assert isinstance(running.finished_reason, FINISH_ABORT)
    assert running.finished_reason.status_code == 500
    events = sgl.spool(kv_enforce).events(detector="page_tag", kind="stale_tag")
    assert [e["action"] for e in events] == ["enforced"]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_decode_radix_cache_dedup_is_not_a_stale_page(kv: Any, page_size: int) -> None:
    """Finding 4: two requests with one prompt, both reserved before either is admitted. At
    ``process_prebuilt`` the tree insert frees the second one's duplicate pages and points its
    row at the first one's; when another request gets the freed pages, nothing is stale."""
    with Bed(page_size=page_size, radix=True, pages=9) as bed:
        prompt = 2 * page_size + 8  # two full pages (cached) and a partial one (kept)
        first = arrive_and_reserve(bed, "same-prompt-1", prompt)
        second = arrive_and_reserve(bed, "same-prompt-2", prompt)
        for req in (first, second):
            bed.transfer(req)
        bed.admit([first, second])
        row = bed.rows.req_to_token[second.kv.req_pool_idx]
        shared = [int(t) // page_size for t in row[: 2 * page_size : page_size]]
        assert shared == bed.dst_pages(first)[:2]  # SGLang re-pointed the row
        freed = bed.dst_pages(second)[:2]
        # The pool is small: the next request's reservation takes the freed pages.
        other = arrive_and_reserve(bed, "other", 3 * page_size, start=1000)
        assert set(freed) <= set(bed.dst_pages(other))
        bed.transfer(other)
        bed.admit([other])
        bed.run_until_idle()
        assert sgl.spool(kv).events() == []


@pytest.mark.parametrize("page_size", (1, *PAGE_SIZES))
def test_decode_radix_cache_dedup_of_a_300_token_prompt_is_not_a_stale_page(
    kv: Any, page_size: int
) -> None:
    """Issue 24's case: two requests with the same 300-token prompt reserved before either is
    admitted, admitted together by one ``process_prebuilt``; the second one's row then holds
    the first one's pages and one of its own; a third request takes the freed pages."""
    pages = -(-300 // page_size)
    # Room for the decode tokens, less than the third request needs: it takes the freed pages.
    headroom = -(-64 // page_size) + 3
    with Bed(page_size=page_size, radix=True, pages=2 * pages + headroom) as bed:
        prompt = tokens(300)
        first, second = (bed.request(f"same-300-{i}", prompt, max_new_tokens=24) for i in (1, 2))
        for req in (first, second):
            assert bed.arrive(req)
            bed.reserve(req)
        for req in (first, second):
            bed.transfer(req)
        bed.admit([first, second])
        row = bed.rows.req_to_token[second.kv.req_pool_idx]
        read = sorted({int(t) // page_size for t in row[:300]})
        full = 300 // page_size
        assert read[:full] == bed.dst_pages(first)[:full]  # the cached copy: the first's pages
        freed = sorted(set(bed.dst_pages(second)) - set(read))
        assert len(freed) == full
        other = arrive_and_reserve(bed, "third", 300, start=5000)
        assert set(freed) <= set(bed.dst_pages(other))  # the third takes the freed pages
        bed.transfer(other)
        bed.admit([other])
        bed.run_until_idle()
        assert sgl.spool(kv).events() == []


@pytest.mark.parametrize("page_size", (1, *PAGE_SIZES))
def test_after_a_radix_dedup_a_page_the_row_really_reads_is_still_caught(
    kv: Any, page_size: int
) -> None:
    """The ticket follows the re-pointed row, so it still catches a real stale read: a page both
    requests' rows read (the cached copy) freed by mistake and handed to a third request."""
    with Bed(page_size=page_size, radix=True, pages=64 if page_size > 1 else 256) as bed:
        length = 3 * page_size + 1 if page_size > 1 else 40
        first = arrive_and_reserve(bed, "same-prompt-a", length)
        second = arrive_and_reserve(bed, "same-prompt-b", length)
        for req in (first, second):
            bed.transfer(req)
        bed.admit([first, second])
        row = bed.rows.req_to_token[second.kv.req_pool_idx]
        slot = int(row[page_size])  # the second page (slot) of the prompt: the first's copy
        stolen = slot // page_size
        assert stolen in bed.dst_pages(first) and stolen not in bed.dst_pages(second)
        bed.allocator.free(row[page_size : 2 * page_size].to(torch.int64).clone())
        bed.allocator.merge_and_sort_free()
        thief = arrive_and_reserve(bed, "thief", page_size, start=900)
        assert stolen in bed.dst_pages(thief)
        bed.step()
        events = sgl.spool(kv).events(detector="page_tag", kind="stale_tag")
        assert sorted((e["request_id"], e["pages"]) for e in events) == [
            ("same-prompt-a", [stolen]),
            ("same-prompt-b", [stolen]),
        ]


def test_a_late_write_is_caught_when_decode_reserves_the_page(kv: Any, bed: Bed) -> None:
    """A stray write into a page SGLang freed: ``_pre_alloc`` (``alloc_extend``) takes it."""
    done = arrive_and_reserve(bed, "done", 48)
    pages = bed.dst_pages(done)
    bed.transfer(done)
    bed.admit([done])
    bed.run_until_idle()
    bed.write_pages([pages[1]], value=0.75)  # a late transfer lands after the free
    bed.allocator.merge_and_sort_free()
    taker = arrive_and_reserve(bed, "taker", 48)
    assert pages[1] in bed.dst_pages(taker)
    events = sgl.spool(kv).events(detector="canary", kind="write_to_free_page")
    assert [e["pages"] for e in events] == [[pages[1]]]


def test_a_late_write_is_caught_when_a_decode_step_takes_the_page(kv: Any, bed: Bed) -> None:
    """The same, when a decode step's ``alloc_decode`` takes the page (a token past a page)."""
    first = arrive_and_reserve(bed, "first", 32)
    second = arrive_and_reserve(bed, "second", 32, start=500)  # exactly two pages
    freed = bed.dst_pages(first)
    bed.transfer(first)
    bed.admit([first])
    bed.run_until_idle()
    bed.write_pages([freed[0]], value=0.75)
    bed.allocator.merge_and_sort_free()
    bed.transfer(second)
    bed.admit([second])  # its first decode token starts a new page: the lowest free one
    events = sgl.spool(kv).events(detector="canary", kind="write_to_free_page")
    assert [e["pages"] for e in events] == [[freed[0]]]


def test_a_finished_request_drops_its_ticket(kv: Any, bed: Bed) -> None:
    req = arrive_and_reserve(bed, "done-6", 20)
    assert kv.ticket(req) is not None
    bed.transfer(req)
    bed.admit([req])
    bed.run_until_idle()
    assert req.finished() and kv.ticket(req) is None


def test_a_request_finished_at_admission_drops_its_ticket(kv: Any, bed: Bed) -> None:
    """One output token (prefill's): SGLang finishes it at admission, it never decodes."""
    req = bed.request("one-token", tokens(20), max_new_tokens=1)
    assert bed.arrive(req)
    bed.reserve(req)
    bed.transfer(req)
    assert bed.admit([req]) == [req]
    assert kv.tickets == {}


def test_a_reused_request_id_is_two_requests(kv: Any, bed: Bed) -> None:
    """Finding 5 through SGLang: two requests share an id, each reads three unwritten pages."""
    reqs = [arrive_and_reserve(bed, "same-rid", 64, start=1 + 100 * i) for i in range(2)]
    for req in reqs:
        bed.transfer(req, written=1)
    bed.admit(reqs)
    contents = sgl.spool(kv)
    events = contents.events(detector="canary", kind="unwritten_page")
    assert [e["request_id"] for e in events] == ["same-rid", "same-rid"]
    assert len({e["instance"] for e in events}) == 2
    assert sgl.counter(contents, "mismatches", detector="canary", kind="unwritten_page") == 2
