"""Scrub mode (``KVWatch(scrub=...)``): what ``on_free`` and ``on_reserve`` cover and what they
do not, one failure class per test, each under ``off``, ``on_free`` and ``on_reserve``. A case
is covered when the reader's pages hold no other request's bytes; the detectors fire, and name
the same sources, in every scrub mode."""

from __future__ import annotations

import pytest
import torch

from engine_hooks import Scrub, Verdict
from engine_hooks.pagestate import NOBODY, HostPages
from tests.engine_hooks.harness import Pair, fill

FP8 = torch.float8_e4m3fn
LAYOUTS = [("mha", torch.bfloat16), ("vllm", FP8), ("mla", torch.float16)]
MODES = [Scrub.OFF, Scrub.ON_FREE, Scrub.ON_RESERVE]


@pytest.fixture(params=LAYOUTS, ids=lambda p: f"{p[0]}-{str(p[1]).removeprefix('torch.')}")
def layout(request: pytest.FixtureRequest) -> tuple[str, torch.dtype]:
    return request.param  # type: ignore[no-any-return]


def build(layout: tuple[str, torch.dtype], scrub: Scrub) -> Pair:
    pair = Pair.build(*layout, scrub=scrub)
    for i in range(6):  # earlier users write and leave
        pages, _, verdicts = pair.clean_request(f"user-{i}", 8)
        assert verdicts == []
        assert pair.free("decode", pages) == []
    return pair


def others_data(pair: Pair, pages: list[int]) -> list[int]:
    """The reader's pages that hold bytes it did not write (it wrote none of these)."""
    return [p for p in pages if pair.holds_data(p)]


def kinds(verdicts: list[Verdict]) -> set[tuple[str, str | None]]:
    return {(v.detector, v.kind) for v in verdicts}


def named(verdict: Verdict) -> dict[str, int]:
    return {s.request_id: s.pages for s in verdict.sources}


@pytest.mark.parametrize("scrub", MODES)
def test_stale_read_of_freed_pages_the_incident(
    layout: tuple[str, torch.dtype], scrub: Scrub
) -> None:
    """Decode reserves pages that earlier users wrote and freed; prefill writes one of them.
    Covered by both: on_free zeroed them when freed, on_reserve when reserved."""
    pair = build(layout, scrub)
    dst, ticket = pair.reserve("rejected", 8)
    truth = pair.exposed(dst, "rejected")
    assert truth  # the pool holds earlier users' KV in these pages (without a scrub)
    _, seal = pair.prefill_write("rejected", dst, ticket, written=1)
    leaked = others_data(pair, dst[1:])
    verdicts = pair.decode.verify_admit(ticket, seal)
    assert kinds(verdicts) == {
        ("canary", "unwritten_page"),
        ("page_tag", "stale_tag"),
        ("checksum", "page_count"),
    }  # detection works the same with a scrub
    if scrub is Scrub.OFF:
        assert leaked and all(named(v) == truth for v in verdicts)
    else:
        assert leaked == []  # zeros: nobody's KV, and nobody named
        assert all(v.sources == () for v in verdicts)


@pytest.mark.parametrize("scrub", MODES)
def test_late_write_while_the_page_is_free(layout: tuple[str, torch.dtype], scrub: Scrub) -> None:
    """A's transfer lands after A's pages were freed, before they are reused. on_free scrubbed
    before the write landed: NOT covered. on_reserve scrubs after it: covered."""
    pair = build(layout, scrub)
    pages, ticket, _ = pair.clean_request("aborted", 4)
    pair.free("decode", pages)
    pair.late_write("aborted", pages[:1], ticket.tags[:1])
    pair.decode_free.remove(pages[0])
    (found,) = pair.decode.on_alloc(pages[:1], "next")
    assert found.kind == "write_to_free_page" and found.request_id == "aborted"
    assert found.sources == () and found.detail["next_owner"] == "next"
    reader = pair.decode.on_reserve("next", pages[:1])
    assert reader is not None
    leaked = others_data(pair, pages[:1])
    assert leaked == ([] if scrub is Scrub.ON_RESERVE else pages[:1])
    (stale, *_) = pair.decode.verify_admit(reader, None)  # unwritten: canary and tags fire
    assert named(stale) == ({} if scrub is Scrub.ON_RESERVE else {"aborted": 1})


@pytest.mark.parametrize("scrub", MODES)
def test_late_write_after_reuse(layout: tuple[str, torch.dtype], scrub: Scrub) -> None:
    """A's transfer lands after its page went to B and B's KV was written. Neither scrub
    covers it (both ran before the write); the page tags catch it and name A."""
    pair = build(layout, scrub)
    old, old_ticket, _ = pair.clean_request("old", 2)
    ticket = pair.reuse(old, "new")
    before = pair.dpool.page(old[0])[-1].clone()
    pair.late_write("old", old[:1], old_ticket.tags[:1])
    assert not torch.equal(pair.dpool.page(old[0])[-1], before)  # B now reads A's KV
    (verdict,) = pair.decode.check_step(ticket)
    assert verdict.kind == "stale_tag" and named(verdict) == {"old": 1}


@pytest.mark.parametrize("scrub", MODES)
def test_use_after_free_read_after_reallocation(
    layout: tuple[str, torch.dtype], scrub: Scrub
) -> None:
    """A stale page table: A's page is freed while A runs, handed to B, written with B's KV,
    and A reads it. No scrub covers it (B's KV is real data, written after any scrub); the
    page tags catch it at A's next step and name B."""
    pair = build(layout, scrub)
    dst, ticket, _ = pair.clean_request("running", 4)
    pair.reuse(dst[1:2], "thief")
    assert pair.holds_data(dst[1])  # B's KV, in A's page table
    (verdict,) = pair.decode.check_step(ticket)
    assert verdict.kind == "stale_tag" and named(verdict) == {"thief": 1}


@pytest.mark.parametrize("scrub", MODES)
def test_partly_written_last_page_of_a_transfer(
    layout: tuple[str, torch.dtype], scrub: Scrub
) -> None:
    """Prefill writes 1 token into a page whose other rows still hold an earlier request's KV
    (the placeholder's page in the incident) and sends the page whole. With either scrub the
    seal zeroes that tail first (on_free zeroed it already when freed); without, the seal
    names the earlier request as the residue."""
    pair = build(layout, scrub)
    src, _ = pair.alloc("prefill", 1, "earlier")
    fill(pair.ppool, src, pair.rng)
    pair.prefill.seal("earlier", src, tokens=4)
    pair.free("prefill", src)
    pair.prefill_free.remove(src[0])
    pair.prefill.on_alloc(src, "rejected")
    first_row = [view[src[0]][: view.shape[1] // 4].clone() for view in pair.ppool.page_views]
    seal = pair.prefill.seal("rejected", src, tokens=1)  # (its own row: not rewritten here)
    assert seal is not None
    tails = [view[src[0]][view.shape[1] // 4 :] for view in pair.ppool.page_views]
    rows = [view[src[0]][: view.shape[1] // 4] for view in pair.ppool.page_views]
    if scrub is Scrub.OFF:
        assert any(bool(t.any()) for t in tails) and seal.residue == (("earlier", ""),)
    else:
        assert not any(bool(t.any()) for t in tails) and seal.residue == ()
        if scrub is Scrub.ON_RESERVE:  # the written row is left alone
            assert all(torch.equal(r, f) for r, f in zip(rows, first_row, strict=True))


@pytest.mark.parametrize("scrub", [Scrub.ON_FREE, Scrub.ON_RESERVE])
def test_scrub_runs_with_every_detector_off(scrub: Scrub) -> None:
    pair = Pair.build("mha", torch.bfloat16, mode="off", scrub=scrub)
    pages, _, _ = pair.clean_request("user", 4)
    pair.free("decode", pages)
    pair.take(pages, "reader")
    assert others_data(pair, pages) == []
    assert isinstance(pair.decode._state, HostPages)
    assert pair.decode._state.sources(pages)[0] == [NOBODY] * len(pages)
