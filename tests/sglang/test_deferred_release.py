"""An aborted transfer released on a timeout, through SGLang's own ``DecodeTransferQueue``.

A request's transfer fails while prefill writes its KV (``pop_transferred`` sees ``Failed``):
SGLang holds its pages (``_defer_release``) until prefill acknowledges that its writes stopped,
or until ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``, when
``resolve_deferred_releases`` releases them anyway. What runs is SGLang's: the transfer queue's
poll, abort, hold and release, the prealloc queue that gives the pages to the next requests,
admission and decode steps (``bed.py``). What stands in is the transport's receiver (no
network): it reports the failure and whether prefill acknowledged the abort (the drain).

Ground truth is SGLang's own: the requests whose reserved rows (``_pre_alloc``'s result) hold
the released pages. No test calls a hook.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_hooks.sglang import compat
from tests.sglang import sgl
from tests.sglang.bed import DECODE_ON_CPU, NO_DECODE_ON_CPU, Bed
from tests.sglang.test_decode import arrive_and_reserve

#: v0.5.19 releases on a timeout too, but says the outcome only in a log line (kvwatch reads it
#: from ``_observe_deferred_kv_release``, v0.5.22+; the plugin's start-up line lists it absent).
SAYS_OUTCOME = compat.exists(compat.TRANSFER_QUEUE + "._observe_deferred_kv_release")
pytestmark = [
    pytest.mark.skipif(not DECODE_ON_CPU, reason=NO_DECODE_ON_CPU),
    pytest.mark.skipif(not SAYS_OUTCOME, reason="this release does not say a release's outcome"),
]

TIMEOUT_S = 0.2  # SGLang's deferred-release timeout in these tests (30 s by default)
WINDOW_S = 2.0  # KVWATCH_FREED_WATCH_S: outlasts a loaded machine's reserves and steps


class _Manager:
    """The receiver's KV manager: prefill acknowledged the abort (drained) or never did."""

    enable_deferred_decode_kv_release = True

    def __init__(self, drained: bool) -> None:
        self.drained = drained
        self.cleared: list[int] = []

    def is_abort_release_safe(self, room: int, required_acks: int) -> bool:
        return self.drained

    def clear_deferred_abort_state(self, room: int) -> None:
        self.cleared.append(room)


class Receiver:
    """The transport stand-in: the transfer failed mid-way, the abort was sent to prefill."""

    def __init__(self, drained: bool) -> None:
        self.kv_mgr = _Manager(drained)
        self.abort_notified = True
        self.bootstrap_infos = [{"rank": 0}]

    def poll(self) -> int:
        from sglang.srt.disaggregation.base.conn import KVPoll

        return int(KVPoll.Failed)

    def failure_exception(self) -> None:
        raise RuntimeError("prefill stopped answering mid-transfer")

    def ensure_abort_notified(self, force_arm: bool = False) -> None:
        self.abort_notified = True

    def clear(self) -> None:
        pass


@pytest.fixture(scope="module")
def process_group() -> Iterator[None]:
    """A one-rank gloo group: the transfer queue reduces its flags over it (as on one GPU)."""
    import torch.distributed as dist

    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if mine:
        dist.destroy_process_group()


@pytest.fixture
def kv_window(
    sglang_plugins: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    from engine_hooks.sglang import runtime
    from engine_hooks.sglang.config import from_env

    monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT", str(TIMEOUT_S))
    (tmp_path / "spool").mkdir(exist_ok=True)  # as the daemon's install would
    env = {
        "KVWATCH_MODE": "log",
        "KVWATCH_SPOOL": str(tmp_path / "spool"),
        "KVWATCH_FREED_WATCH_S": str(WINDOW_S),
    }
    rt = runtime.reset(from_env(env))
    yield rt
    rt.close()


def transfer_queue(bed: Bed) -> Any:
    """SGLang's ``DecodeTransferQueue`` over the bed's scheduler and tree, with its metadata."""
    from sglang.srt.disaggregation.decode import DecodeTransferQueue
    from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator

    buffers = MetadataBuffers(8, 16, torch.float32, 0)
    return DecodeTransferQueue(ReqToMetadataIdxAllocator(8), buffers, bed.scheduler, bed.tree)


def fail_mid_transfer(bed: Bed, queue: Any, req: Any, drained: bool, held: int = 1) -> None:
    """The request's transfer fails while prefill writes: SGLang's own poll, abort and hold
    (``held``: the releases held now, this one included)."""
    from sglang.srt.disaggregation.decode import DecodeRequest
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    index = queue.req_to_metadata_buffer_idx_allocator.alloc()
    queue.add(DecodeRequest(req=req, kv_receiver=Receiver(drained), metadata_buffer_index=index))
    assert queue.pop_transferred() == []
    assert isinstance(req.finished_reason, FINISH_ABORT)
    assert queue.num_pending_deferred_releases() == held  # prefill may still be writing


def release(queue: Any) -> None:
    """SGLang's resolve, past the deadline: drained or timed out, the pages go back."""
    time.sleep(TIMEOUT_S + 0.05)
    queue.resolve_deferred_releases()
    assert queue.num_pending_deferred_releases() == 0


def abort_and_release(bed: Bed, drained: bool) -> tuple[Any, Any, set[int]]:
    """A 100-token request reserves its pages, fails mid-transfer and is released past the
    deadline (drained or timed out): (the transfer queue, the request, its freed pages)."""
    queue = transfer_queue(bed)
    aborted = arrive_and_reserve(bed, "aborted", 100)
    freed = set(bed.dst_pages(aborted))
    fail_mid_transfer(bed, queue, aborted, drained=drained)
    release(queue)
    return queue, aborted, freed


def others_take_the_pool(bed: Bed, first: int, count: int) -> list[Any]:
    """Other users' requests reserve, are written and admitted: they take the freed pages."""
    reqs = [arrive_and_reserve(bed, f"other-{first + i}", 40, start=900) for i in range(count)]
    for req in reqs:
        bed.transfer(req)
    bed.admit(reqs)
    return reqs


def after_the_window(queue: Any) -> None:
    """The window is over; SGLang's decode loop resolves its held releases every iteration
    (``process_decode_queue``), where the window closes."""
    time.sleep(WINDOW_S + 0.05)
    queue.resolve_deferred_releases()


def row_pages(bed: Bed, req: Any) -> set[int]:
    """The pages SGLang's row of ``req`` reads now (its tokens so far)."""
    length = len(req.origin_input_ids) + len(req.output_ids)
    row = bed.rows.req_to_token[req.kv.req_pool_idx][:length]
    return {int(t) // bed.page_size for t in row.tolist()}


@pytest.mark.parametrize("page_size", [16, 1])  # 1: SGLang's default, a page is a token slot
def test_a_timed_out_release_names_the_requests_that_took_its_pages(
    kv_window: Any, process_group: None, page_size: int
) -> None:
    with Bed(page_size=page_size, radix=False, pages=192 // page_size) as bed:
        # SGLang: "timed out ... releasing anyway"
        queue, aborted, freed = abort_and_release(bed, drained=False)
        assert len(freed) == -(-100 // page_size)
        instance = kv_window.instance_of(aborted)
        takers = others_take_the_pool(bed, 0, 4)
        assert sgl.spool(kv_window).events(kind="freed_before_drain") == []  # window open
        after_the_window(queue)
        # Ground truth: the released pages SGLang gave each request in the window, at its
        # reserve and at its decode step (at page size 1 every step takes a slot).
        given = {r.rid: freed & (set(bed.dst_pages(r)) | row_pages(bed, r)) for r in takers}
        took = {rid: len(pages) for rid, pages in given.items() if pages}
        assert len(took) >= 2, "the test is about something: the pages were taken"
        events = sgl.spool(kv_window).events(kind="freed_before_drain")
        assert {e["request_id"]: e["pages_total"] for e in events} == took
        for event in events:
            req = next(r for r in takers if r.rid == event["request_id"])
            assert set(event["pages"]) == given[req.rid]
            assert event["instance"] == kv_window.instance_of(req)
            assert (event["detector"], event["action"]) == ("page_tag", "logged")
            assert event["sources"] == [
                {"request_id": "aborted", "pages": event["pages_total"], "instance": instance,
                 "written_at": 0.0}
            ]  # fmt: skip
            assert event["detail"]["freed_pages"] == len(freed)
        # Nothing else was found: the takers' own KV checks are clean.
        assert len(sgl.spool(kv_window).events()) == len(events)
        bed.run_until_idle()


def test_a_decode_step_that_starts_a_released_page_is_a_taker(
    kv_window: Any, process_group: None
) -> None:
    with Bed(page_size=16, radix=False, pages=12) as bed:
        queue = transfer_queue(bed)
        # A running request whose next page comes from the free list at a decode step.
        running = bed.request("running", list(range(1, 48)), max_new_tokens=8)
        assert bed.arrive(running)
        bed.reserve(running)
        bed.transfer(running)
        bed.admit([running])
        before = row_pages(bed, running)
        aborted = arrive_and_reserve(bed, "aborted", 100)
        freed = set(bed.dst_pages(aborted))
        # The rest of the pool to another request: the released pages are all that is free.
        filler = arrive_and_reserve(bed, "filler", 16 * (bed.allocator.available_size() // 16))
        assert bed.allocator.available_size() == 0
        fail_mid_transfer(bed, queue, aborted, drained=False)
        release(queue)
        released = time.monotonic()
        bed.transfer(filler)
        bed.admit([filler])
        # Ground truth: the released pages SGLang's decode steps gave each request.
        reserved = {"running": before, "filler": set(bed.dst_pages(filler))}
        started: dict[str, set[int]] = {"running": set(), "filler": set()}
        while not running.finished():
            for req in (running, filler):
                if not req.finished():
                    started[req.rid] |= (row_pages(bed, req) - reserved[req.rid]) & freed
            bed.step()
        assert time.monotonic() - released < WINDOW_S, "the steps outlasted the window"
        assert started["running"], "SGLang's alloc_decode gave it a released page"
        after_the_window(queue)
        events = sgl.spool(kv_window).events(kind="freed_before_drain")
        found = {e["request_id"]: set(e["pages"]) for e in events}
        assert found == {rid: pages for rid, pages in started.items() if pages}
        assert {s["request_id"] for e in events for s in e["sources"]} == {"aborted"}
        bed.run_until_idle()


def test_a_drained_release_gives_no_finding_though_its_pages_are_taken(
    kv_window: Any, process_group: None
) -> None:
    with Bed(page_size=16, radix=False, pages=12) as bed:
        # Prefill acknowledged: its writes have stopped.
        queue, _, freed = abort_and_release(bed, drained=True)
        takers = others_take_the_pool(bed, 0, 4)
        assert any(freed & set(bed.dst_pages(r)) for r in takers)
        after_the_window(queue)
        assert sgl.spool(kv_window).events() == []
        bed.run_until_idle()


def test_one_resolve_that_drains_one_release_and_times_out_another(
    kv_window: Any, process_group: None
) -> None:
    """SGLang pairs each release with its outcome in turn: the takers of the drained request's
    pages are no finding, those of the timed-out one's are."""
    with Bed(page_size=16, radix=False, pages=12) as bed:
        queue = transfer_queue(bed)
        drained = arrive_and_reserve(bed, "drained", 40)
        timed_out = arrive_and_reserve(bed, "timed-out", 40, start=300)
        pages = {r.rid: set(bed.dst_pages(r)) for r in (drained, timed_out)}
        fail_mid_transfer(bed, queue, drained, drained=True)
        fail_mid_transfer(bed, queue, timed_out, drained=False, held=2)
        release(queue)  # one resolve: "drained", then "timeout"
        takers = others_take_the_pool(bed, 0, 3)
        after_the_window(queue)
        given = {r.rid: set(bed.dst_pages(r)) | row_pages(bed, r) for r in takers}
        assert any(p & pages["drained"] for p in given.values()), "its pages were taken too"
        took = {rid: p & pages["timed-out"] for rid, p in given.items() if p & pages["timed-out"]}
        assert took, "the test is about something"
        events = sgl.spool(kv_window).events()
        assert {e["request_id"]: set(e["pages"]) for e in events} == took
        assert {s["request_id"] for e in events for s in e["sources"]} == {"timed-out"}
        bed.run_until_idle()


def test_a_request_that_takes_the_pages_after_the_window_is_no_taker(
    kv_window: Any, process_group: None
) -> None:
    """The window is over though nothing closed it yet (decode was idle): a later request that
    gets the pages is no taker."""
    with Bed(page_size=16, radix=False, pages=12) as bed:
        queue, _, freed = abort_and_release(bed, drained=False)
        time.sleep(WINDOW_S + 0.05)
        late = others_take_the_pool(bed, 0, 4)
        assert any(freed & set(bed.dst_pages(r)) for r in late), "they got the pages"
        queue.resolve_deferred_releases()
        assert sgl.spool(kv_window).events() == []
        bed.run_until_idle()


def test_a_timeout_whose_pages_nobody_takes_is_no_finding(
    kv_window: Any, process_group: None
) -> None:
    with Bed(page_size=16, radix=False, pages=64) as bed:
        queue, _, freed = abort_and_release(bed, drained=False)
        # One small request in a large pool: the free list hands it other pages.
        (other,) = others_take_the_pool(bed, 0, 1)
        assert not freed & set(bed.dst_pages(other))
        after_the_window(queue)
        assert sgl.spool(kv_window).events() == []
        bed.run_until_idle()
