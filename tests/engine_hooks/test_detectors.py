"""Every failure class is caught in MHA, MLA and vLLM-layout pools, in bf16, fp16 and fp8;
clean traffic gives zero mismatches."""

from __future__ import annotations

import time

import pytest
import torch

from engine_hooks import Mode, Seal, Verdict
from engine_hooks.pagestate import DevicePages
from kvspool.schema import MAX_EVENT_SOURCES
from tests.engine_hooks.harness import Pair, fill

FP8 = torch.float8_e4m3fn
LAYOUTS = [
    ("mha", torch.bfloat16),
    ("mha", FP8),
    ("mla", torch.bfloat16),
    ("mla", FP8),
    ("mha", torch.float16),
    ("vllm", torch.bfloat16),
]
ids = [f"{kind}-{str(dtype).removeprefix('torch.')}" for kind, dtype in LAYOUTS]


def kinds(verdicts: list) -> set[tuple[str, str]]:  # type: ignore[type-arg]
    return {(v.detector, v.kind) for v in verdicts}


@pytest.fixture(params=LAYOUTS, ids=ids)
def pair(request: pytest.FixtureRequest) -> Pair:
    kind, dtype = request.param
    return Pair.build(kind, dtype)


def warm(pair: Pair) -> None:
    """Earlier users write and leave: the pool now holds their KV, unzeroed."""
    for i in range(6):
        pages, _, verdicts = pair.clean_request(f"user-{i}", 8)
        assert verdicts == []
        assert pair.free("decode", pages) == []


def test_incident_unwritten_reserved_pages(pair: Pair) -> None:
    warm(pair)
    dst, ticket = pair.reserve("rejected", 8)
    _, seal = pair.prefill_write("rejected", dst, ticket, written=1)  # the placeholder page
    verdicts = pair.decode.verify_admit(ticket, seal)
    assert kinds(verdicts) == {
        ("canary", "unwritten_page"),
        ("page_tag", "stale_tag"),
        ("checksum", "page_count"),
    }
    for v in verdicts:
        assert v.request_id == "rejected"
        assert set(v.pages) == set(dst[1:])
        assert not v.blocks  # log mode serves the request


def test_late_write_into_free_page(pair: Pair) -> None:
    warm(pair)
    pages, _, _ = pair.clean_request("aborted", 4)
    pair.free("decode", pages)
    victim = pages[2]
    pair.dpool.page(victim)[0][:64].fill_(0x11)  # a late RDMA write lands after the free
    pair.decode_free.remove(victim)
    verdicts = pair.decode.on_alloc([victim], "next-owner")
    assert kinds(verdicts) == {("canary", "write_to_free_page")}
    assert verdicts[0].pages == (victim,)


def test_late_write_into_free_page_is_logged_not_enforced() -> None:
    """The page's next owner rewrites it before any read and the late writer is gone: nothing
    can be failed, so even in enforce mode the finding never claims to block."""
    pair = Pair.build("vllm", torch.bfloat16, mode=Mode.ENFORCE)
    pages, _, _ = pair.clean_request("aborted", 4)
    pair.free("decode", pages)
    pair.dpool.page(pages[1])[0][:64].fill_(0x11)
    pair.decode_free.remove(pages[1])
    (verdict,) = pair.decode.on_alloc([pages[1]], "next-owner")
    assert verdict.kind == "write_to_free_page" and not verdict.blocks


def test_per_page_seal_checks_any_run_and_names_the_bad_page(pair: Pair) -> None:
    dst, ticket = pair.reserve("runs", 5)
    pair.prefill_write("runs", dst, ticket)
    checksum = pair.decode._checksum
    assert checksum is not None
    seal = checksum.seal_pages(dst)
    assert Seal.from_wire(seal.to_wire()) == seal
    assert checksum.verify("runs", dst[1:4], seal.run(1, 3)).ok
    pair.dpool.page(dst[2])[-1][-1] ^= 0x01
    verdict = checksum.verify("runs", dst[1:4], seal.run(1, 3))
    assert (verdict.kind, verdict.pages) == ("digest", (dst[2],))
    assert checksum.verify("runs", dst[3:], seal.run(3, 9)).ok  # a run past the end: shorter
    assert checksum.verify("runs", dst, seal.run(1, 9)).kind == "page_count"


def test_flipped_bit_in_transfer(pair: Pair) -> None:
    dst, ticket = pair.reserve("flip", 5)
    _, seal = pair.prefill_write("flip", dst, ticket)
    pair.dpool.page(dst[3])[-1][-1] ^= 0x01
    verdicts = pair.decode.verify_admit(ticket, seal)
    assert kinds(verdicts) == {("checksum", "digest")}


def test_misrouted_transfer(pair: Pair) -> None:
    _, ticket = pair.reserve("mine", 3)
    other, other_ticket = pair.reserve("other", 3)
    _, seal = pair.prefill_write("mine", other, other_ticket)  # written into the wrong pages
    verdicts = pair.decode.verify_admit(ticket, seal)
    assert ("canary", "unwritten_page") in kinds(verdicts)
    assert ("page_tag", "stale_tag") in kinds(verdicts)
    assert ("checksum", "digest") in kinds(verdicts)


def test_page_reallocated_under_running_request(pair: Pair) -> None:
    dst, ticket, verdicts = pair.clean_request("running", 4)
    assert verdicts == []
    assert pair.decode.check_step(ticket) == []
    pair.free("decode", dst[1:2])  # a stale page table frees it early ...
    pair.decode_free.remove(dst[1])
    assert pair.decode.on_alloc([dst[1]], "thief") == []  # ... and it is handed out again
    verdicts = pair.decode.check_step(ticket)
    assert kinds(verdicts) == {("page_tag", "stale_tag")}
    assert verdicts[0].pages == (dst[1],)


def test_late_write_into_page_of_new_owner(pair: Pair) -> None:
    old, old_ticket, _ = pair.clean_request("old", 2)
    new_ticket = pair.reuse(old, "new")
    # The old transfer's late write lands with the old generation.
    pair.dpool.page(old[0])[0].fill_(3)
    pair.dpool.mark_written(old[:1], old_ticket.tags[:1])
    assert kinds(pair.decode.check_step(new_ticket)) == {("page_tag", "stale_tag")}


def test_double_free(pair: Pair) -> None:
    dst, _, _ = pair.clean_request("r", 3)
    assert pair.free("decode", dst) == []
    verdicts = pair.free("decode", dst[:1])
    assert kinds(verdicts) == {("page_tag", "double_free")}


def test_admission_invariant(pair: Pair) -> None:
    assert pair.decode.on_admission("ok", "decode_prealloc", aborted=False, finished=False).ok
    assert pair.decode.on_admission("done", "decode_prealloc", aborted=True, finished=True).ok
    verdict = pair.prefill.on_admission("bad", "prefill_bootstrap", aborted=True, finished=False)
    assert (verdict.detector, verdict.kind, verdict.request_id) == (
        "admission",
        "aborted_admitted",
        "bad",
    )
    assert pair.prefill.counter("aborted_admissions", "prefill_bootstrap") == 1


def test_pool_versus_context() -> None:
    pair = Pair.build("mha", torch.bfloat16)
    report = pair.decode.report_pool(681_280, 1_048_576, 64)
    assert report is not None
    assert report.unsafe_band_tokens == 367_296
    assert round(report.unsafe_share, 2) == 0.35
    closed = pair.decode.report_pool(2_040_000, 1_048_576, 64)
    assert closed is not None and closed.unsafe_band_tokens == 0


def test_enforce_blocks_and_off_skips() -> None:
    enforce = Pair.build("mha", torch.bfloat16, mode=Mode.ENFORCE)
    dst, ticket = enforce.reserve("r", 4)
    _, seal = enforce.prefill_write("r", dst, ticket, written=1)
    verdicts = enforce.decode.verify_admit(ticket, seal)
    assert verdicts and all(v.blocks for v in verdicts)

    off = Pair.build("mha", torch.bfloat16, mode=Mode.OFF)
    dst, ticket = off.reserve("r", 4)
    _, seal = off.prefill_write("r", dst, ticket, written=1)
    assert off.decode.verify_admit(ticket, seal) == []
    for detector in ("canary", "checksum", "page_tag"):
        assert off.decode.counter("verifications_skipped", detector, "mode_off") >= 1
        assert off.decode.counter("verifications", detector) == 0


def test_per_detector_modes() -> None:
    pair = Pair.build("mha", torch.bfloat16, mode={"default": "log", "checksum": "enforce"})
    dst, ticket = pair.reserve("r", 4)
    _, seal = pair.prefill_write("r", dst, ticket, written=1)
    blocking = {v.detector for v in pair.decode.verify_admit(ticket, seal) if v.blocks}
    assert blocking == {"checksum"}


def test_missing_seal_is_a_counted_skip() -> None:
    pair = Pair.build("mla", torch.bfloat16)
    dst, ticket = pair.reserve("r", 2)
    pair.prefill_write("r", dst, ticket)
    assert pair.decode.verify_admit(ticket, None) == []
    assert pair.decode.counter("verifications_skipped", "checksum", "no_seal") == 1


def test_hooks_never_raise_into_the_engine() -> None:
    pair = Pair.build("mha", torch.bfloat16)
    assert pair.decode.on_alloc([10_000], "bad") == []  # a page id outside the pool
    assert pair.decode.seal("bad", [-5]) is None
    assert pair.decode.verify_admit(None, Seal(1, 1)) == []
    assert pair.decode.counter("hook_errors", "alloc") == 1
    assert pair.decode.counter("hook_errors", "seal") == 1
    assert pair.decode.counter("verifications_skipped", "canary", "hook_error") == 1


def test_clean_traffic_has_no_false_positives() -> None:
    """At least 100,000 page verifications over churned pools of every layout."""
    verified_pages = 0
    for kind, dtype in LAYOUTS:
        pair = Pair.build(kind, dtype, pages=256)
        live: list[tuple[list[int], object]] = []
        for i in range(700):
            count = pair.rng.randint(1, 48)
            if len(pair.decode_free) < count or len(pair.prefill_free) < count:
                pages, _ = live.pop(0)
                assert pair.free("decode", pages) == []
                continue
            dst, ticket, verdicts = pair.clean_request(f"{kind}-{i}", count)
            assert verdicts == [], verdicts
            assert pair.decode.check_step(ticket) == []
            verified_pages += 2 * count  # checked at admit and at a decode step
            live.append((dst, ticket))
            if len(live) > 4:
                pages, _ = live.pop(0)
                assert pair.free("decode", pages) == []
        mismatches = [k for k in pair.decode._stats.values if k[0] == "mismatches"]
        assert mismatches == []
    assert verified_pages >= 100_000


# -- the blast radius: whose KV the reader's pages held ------------------------------------


def named(verdict: Verdict) -> dict[str, int]:
    return {s.request_id: s.pages for s in verdict.sources}


def test_incident_names_the_users_whose_pages_were_read(pair: Pair) -> None:
    warm(pair)
    dst, ticket = pair.reserve("rejected", 8)
    _, seal = pair.prefill_write("rejected", dst, ticket, written=1)
    truth = pair.exposed(dst, "rejected")
    verdicts = pair.decode.verify_admit(ticket, seal)
    assert len(verdicts) == 3
    for v in verdicts:
        assert named(v) == truth, v.kind  # exactly the requests, with their page counts
        assert "rejected" not in named(v)
        for source in v.sources:
            assert source.instance  # decode's instance of the earlier user's request
            assert 0 < source.written_at <= time.time()
    assert sum(truth.values()) == len(dst) - 1 - sum(
        1 for p in dst[1:] if p not in pair.holder
    )  # every written page of the read is someone's: the test's record covers the read


def test_a_page_never_written_since_start_up_has_no_source(pair: Pair) -> None:
    dst, ticket = pair.reserve("first", 4)  # a fresh pool: zeros
    _, seal = pair.prefill_write("first", dst, ticket, written=1)
    for v in pair.decode.verify_admit(ticket, seal):
        assert v.sources == () and v.other_sources == 0
        assert "unattributed_pages" not in v.detail


def test_late_write_into_free_page_names_its_writer(pair: Pair) -> None:
    warm(pair)
    pages, ticket, _ = pair.clean_request("aborted", 4)
    pair.free("decode", pages)
    pair.late_write("aborted", pages[2:3], ticket.tags[2:3])  # lands after the free
    pair.decode_free.remove(pages[2])
    (verdict,) = pair.decode.on_alloc(pages[2:3], "next-owner")
    assert verdict.kind == "write_to_free_page"
    # The late writer's finding: the next owner read nothing (it writes the page first).
    assert verdict.request_id == "aborted" and verdict.instance == ticket.instance
    assert verdict.sources == () and verdict.detail["next_owner"] == "next-owner"


def test_late_write_after_reuse_names_the_late_writer(pair: Pair) -> None:
    old, old_ticket, _ = pair.clean_request("old", 2)
    new_ticket = pair.reuse(old, "new")
    pair.late_write("old", old[:1], old_ticket.tags[:1])  # the old transfer, with its tags
    (verdict,) = pair.decode.check_step(new_ticket)
    assert verdict.kind == "stale_tag" and named(verdict) == {"old": 1}


def test_page_reallocated_and_written_names_the_new_owner_never_the_reader(pair: Pair) -> None:
    dst, ticket, _ = pair.clean_request("running", 4)
    pair.free("decode", dst[1:2])  # a stale page table frees it early
    pair.decode_free.remove(dst[1])
    assert pair.decode.on_alloc([dst[1]], "thief") == []
    (before,) = pair.decode.check_step(ticket)
    assert before.sources == ()  # the page still holds the reader's own KV: no source
    thief = pair.decode.on_reserve("thief", [dst[1]])
    assert thief is not None
    pair.prefill_write("thief", [dst[1]], thief)
    pair.decode._reporter._reported.clear()  # report again: once per instance, detector and kind
    (after,) = pair.decode.check_step(ticket)
    assert named(after) == {"thief": 1}


def test_flipped_bit_names_no_source(pair: Pair) -> None:
    warm(pair)
    dst, ticket = pair.reserve("flip", 5)
    _, seal = pair.prefill_write("flip", dst, ticket)
    pair.dpool.page(dst[3])[-1][-1] ^= 0x01
    (verdict,) = pair.decode.verify_admit(ticket, seal)
    assert verdict.kind == "digest" and verdict.sources == ()  # its own pages, corrupted


def test_misrouted_transfer_names_the_pages_earlier_users() -> None:
    pair = Pair.build("mha", torch.bfloat16)
    warm(pair)
    dst, ticket = pair.reserve("mine", 3)
    truth = pair.exposed(dst, "mine")
    other, other_ticket = pair.reserve("other", 3)
    _, seal = pair.prefill_write("mine", other, other_ticket)
    by_kind = {v.kind: v for v in pair.decode.verify_admit(ticket, seal)}
    assert truth
    for kind in ("unwritten_page", "stale_tag", "digest"):
        assert named(by_kind[kind]) == truth


def test_the_top_sixteen_sources_are_named_and_the_rest_counted() -> None:
    pair = Pair.build("mha", torch.bfloat16, pages=64)
    for i in range(20):  # 20 users, users 0-3 with 3 pages, the others 2 and 1
        count = 3 if i < 4 else (2 if i < 10 else 1)
        pages, _, _ = pair.clean_request(f"u{i:02d}", count)
        pair.free("decode", pages)
    pages = [p for p in range(64) if p in pair.holder]
    ticket = pair.take(pages, "reader")
    (verdict, *_) = pair.decode.verify_admit(ticket, None)
    truth = sorted(pair.exposed(pages, "reader").items(), key=lambda kv: (-kv[1], kv[0]))
    assert len(truth) > MAX_EVENT_SOURCES and truth[0][1] > truth[-1][1]
    assert [(s.request_id, s.pages) for s in verdict.sources] == truth[:MAX_EVENT_SOURCES]
    rest = truth[MAX_EVENT_SOURCES:]
    assert verdict.other_sources == len(rest)
    assert verdict.other_source_pages == sum(count for _, count in rest)


def test_a_forgotten_writer_is_unattributed_never_misnamed() -> None:
    pair = Pair.build("mha", torch.bfloat16)
    pair.decode._requests.limit = 2  # remember two requests only
    pages, _, _ = pair.clean_request("early", 2)
    pair.free("decode", pages)
    for i in range(3):  # later requests push "early" out of the table
        later, _, _ = pair.clean_request(f"later-{i}", 1)
        pair.free("decode", later)
    ticket = pair.take(pages, "reader")
    (verdict, *_) = pair.decode.verify_admit(ticket, None)
    assert verdict.sources == () and verdict.detail["unattributed_pages"] == 2


def test_the_seal_names_the_residue_of_a_partly_written_last_page() -> None:
    """Prefill wrote 1 token into a page whose other rows hold an earlier request's KV; the
    reader reads past the sealed page, so it reads that tail: its holder is a source."""
    pair = Pair.build("mha", torch.bfloat16)
    src, _ = pair.alloc("prefill", 2, "earlier")
    fill(pair.ppool, src, pair.rng)
    pair.prefill.seal("earlier", src, tokens=8)  # two full pages of 4 tokens
    pair.free("prefill", src)
    dst, ticket = pair.reserve("rejected", 4)
    pair.prefill_free.remove(src[1])
    assert pair.prefill.on_alloc(src[1:], "rejected") == []
    fill(pair.ppool, src[1:], pair.rng)  # (the whole page: only its bytes' holder matters)
    seal = pair.prefill.seal("rejected", src[1:], tokens=1)
    assert seal is not None and seal.residue == (("earlier", ""),)
    assert Seal.from_wire(seal.to_wire()) == seal
    assert seal.run(0, 1).residue == seal.residue  # a run to the end keeps it
    pair.dpool.mark_written(dst[:1], ticket.tags[:1])
    by_kind = {v.kind: v for v in pair.decode.verify_admit(ticket, seal)}
    assert named(by_kind["page_count"]) == {"earlier": 1}
    assert named(by_kind["stale_tag"]) == {}  # decode's pages were fresh
    full = pair.prefill.seal("third", src[1:], tokens=4)  # a full page leaves no residue
    assert full is not None and full.residue == ()
    partial = pair.prefill.seal("fourth", src[1:], tokens=3)
    assert partial is not None and partial.residue == (("third", ""),)


def test_decode_own_pages_name_their_request(pair: Pair) -> None:
    """Pages decode allocates for a request's own tokens (``extend``) are that request's."""
    dst, ticket, _ = pair.clean_request("talker", 2)
    grown, verdicts = pair.alloc("decode", 2, "talker")
    assert verdicts == []
    pair.decode.extend(ticket, grown)
    fill(pair.dpool, grown, pair.rng)  # its generated tokens
    pair.holder.update(dict.fromkeys(grown, "talker"))
    assert pair.decode.check_step(ticket) == []
    pair.free("decode", [*dst, *grown])
    reader = pair.take(grown, "reader")
    (verdict, *_) = pair.decode.verify_admit(reader, None)
    assert named(verdict) == {"talker": 2} == pair.exposed(grown, "reader")
    assert [s.instance for s in verdict.sources] == [ticket.instance]


def test_the_last_writer_is_remembered_through_unwritten_reuses(pair: Pair) -> None:
    """A page written by one request, then handed out three times and never written again:
    its KV is still that request's, and each reader is told so."""
    dst, _, _ = pair.clean_request("writer", 1)
    pair.free("decode", dst)
    for i in range(4):
        ticket = pair.take(dst, f"reader-{i}")
        (verdict, *_) = pair.decode.verify_admit(ticket, None)
        assert named(verdict) == {"writer": 1}, i
        pair.free("decode", dst)


def test_a_peers_malformed_residue_is_dropped_not_raised() -> None:
    wire = {"page_count": 1, "digest": 7, "residue": [["a", "i"], "junk", [1], ["b", ""]]}
    assert Seal.from_wire(wire).residue == (("a", "i"), ("b", ""))
    assert Seal.from_wire({"page_count": 1, "digest": 7, "residue": None}).residue == ()


def test_late_writer_read_later_is_named_by_the_tags_at_allocation() -> None:
    """On an accelerator a write into a free page is read at the next sync point, after the
    next owner's own write may have retagged the page: the writer is the holder of the tags
    taken at the allocation, never the next owner. (The device path, on a CPU pool.)"""
    pair = Pair.build("mha", torch.bfloat16)
    decode = pair.decode
    assert decode.pool is not None
    device = DevicePages(decode.pool)
    decode._use_state(device)
    decode._on_device = True
    decode.on_free(list(range(decode.pool.num_pages)))
    pages, ticket, _ = pair.clean_request("aborted", 2)
    pair.free("decode", pages)
    pair.late_write("aborted", pages[:1], ticket.tags[:1])
    pair.decode_free.remove(pages[0])
    assert decode.on_alloc(pages[:1], "next-owner") == []  # deferred to the sync point
    reader = decode.on_reserve("next-owner", pages[:1])
    assert reader is not None
    decode.pool.mark_written(pages[:1], reader.tags)  # the next owner's write lands first
    (verdict,) = [v for v in decode.resolve() if v.kind == "write_to_free_page"]
    assert verdict.request_id == "aborted" and verdict.detail["next_owner"] == "next-owner"


def test_each_detector_reports_the_kinds_the_catalogue_names_for_it() -> None:
    """The catalogue's DETECTOR_KINDS is what /metrics initialises: each hooked detector's kinds
    are exactly its entry (a new kind not added there would be exposed only once counted)."""
    from engine_hooks.detectors import Admission, Canary, PageTags, TransferChecksum
    from kvspool import catalogue

    for detector in (Canary, TransferChecksum, PageTags, Admission):
        kinds = {
            value
            for name, value in vars(detector).items()
            if name.isupper() and isinstance(value, str) and value in catalogue.KIND.values
        }
        assert kinds == set(catalogue.DETECTOR_KINDS[detector.name]), detector.name
