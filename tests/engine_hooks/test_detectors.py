"""Every failure class is caught in MHA, MLA and vLLM-layout pools, in bf16, fp16 and fp8;
clean traffic gives zero mismatches."""

from __future__ import annotations

import pytest
import torch

from engine_hooks import Mode, Seal
from tests.engine_hooks.harness import Pair

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
    checksum = pair.decode.checksum
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
    pair.free("decode", old)
    for page in old:
        pair.decode_free.remove(page)
    assert pair.decode.on_alloc(old, "new") == []
    new_ticket = pair.decode.on_reserve("new", old)
    assert new_ticket is not None
    _, seal = pair.prefill_write("new", old, new_ticket)
    assert pair.decode.verify_admit(new_ticket, seal) == []
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
    assert pair.prefill.stats.get("aborted_admissions", "prefill_bootstrap") == 1


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
        assert off.decode.stats.get("verifications_skipped", detector, "mode_off") >= 1
        assert off.decode.stats.get("verifications", detector) == 0


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
    assert pair.decode.stats.get("verifications_skipped", "checksum", "no_seal") == 1


def test_hooks_never_raise_into_the_engine() -> None:
    pair = Pair.build("mha", torch.bfloat16)
    assert pair.decode.on_alloc([10_000], "bad") == []  # a page id outside the pool
    assert pair.decode.seal("bad", [-5]) is None
    assert pair.decode.verify_admit(None, Seal(1, 1)) == []
    assert pair.decode.stats.get("hook_errors", "alloc") == 1
    assert pair.decode.stats.get("hook_errors", "seal") == 1
    assert pair.decode.stats.get("verifications_skipped", "canary", "hook_error") == 1


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
        mismatches = [k for k in pair.decode.stats.values if k[0] == "mismatches"]
        assert mismatches == []
    assert verified_pages >= 100_000
