"""kvwatch inside a real SGLang 0.5.23 PD deployment on CPU: prefill, decode and the smg router
as real processes, KV moved by Mooncake (TCP) or NIXL (UCX over TCP), kvwatch loaded by SGLang
in every scheduler process.

Clean requests: the PD output equals one server's, zero findings on every server, and every
transfer decode admitted was verified against prefill's seal, carried on SGLang's own metadata
row (no ``no_seal`` skip). A KV value changed on prefill after the seal: one checksum finding
naming the request and the page; served in log mode, failed by SGLang's own abort in enforce
mode, and the server goes on serving.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.sglang_pd.bed import (
    KVWATCH_ABORT,
    Bed,
    Process,
    generate_body,
    reference_outputs,
)
from tests.sglang_pd.corrupter import MARK

SPOOL_WAIT_S = 15.0
MAX_TOKENS = 8
DEDUP_TOKENS = 128  # the dedup pair decodes while the pages it freed are handed out again
TEXT = (
    "decode reads what prefill sealed page by page over the wire while the scheduler admits "
    "new work and frees old pages when a request finishes"
)
WORDS = TEXT.split()


def prompt(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(words))


SHARED = prompt(1, 60)
# Mixed lengths: under one page, several pages (one digest per page on the wire), a shared
# prefix (a radix-cache hit on prefill, and on the enforce decode, which runs SGLang's decode
# radix cache; the log decode runs without), and long prompts (over nine pages: one digest for
# all).
CLEAN = [prompt(2, 6), SHARED, SHARED + " " + prompt(3, 25), prompt(4, 40), prompt(5, 150)]


@pytest.fixture(scope="session")
def reference(reference_server: Process) -> list[list[int]]:
    return reference_outputs(reference_server, CLEAN, MAX_TOKENS)


def counter(bed: Bed, server: str, name: str, **labels: str) -> float:
    series = bed.spool(server).latest_counters().get(name, {})
    return sum(v for k, v in series.items() if all(dict(k).get(a) == b for a, b in labels.items()))


def events(bed: Bed, server: str) -> list[dict[str, Any]]:
    return bed.spool(server).events()


def describe(found: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    return [(e["detector"], e["kind"], e["action"]) for e in found]


def settled(bed: Bed, server: str, served: int) -> float:
    """The checksum verifications on a decode server, once they reach ``served`` (the PD
    requests it served: one transfer each) or the wait ends."""
    deadline = time.monotonic() + SPOOL_WAIT_S
    while True:
        sealed = counter(bed, server, "verifications", detector="checksum")
        if sealed >= served or time.monotonic() > deadline:
            return sealed
        time.sleep(0.5)


def test_clean_pd_requests_equal_one_server_with_zero_findings(
    bed: Bed, reference: list[list[int]]
) -> None:
    for text, expected in zip(CLEAN, reference, strict=True):
        served = bed.via_router(text, MAX_TOKENS)
        assert served.status == 200, f"{bed.transport} router: {served.body}"
        assert served.output_ids == expected, f"{bed.transport} router"
        direct = bed.direct("enforce", text, MAX_TOKENS)
        assert direct.status == 200, f"{bed.transport} enforce: {direct.body}"
        assert direct.output_ids == expected, f"{bed.transport} enforce"
    for mode in ("log", "enforce"):
        server = f"decode-{mode}"
        # Every transfer decode served was verified against prefill's seal, no more, no fewer.
        assert settled(bed, server, bed.served[mode]) == bed.served[mode], server
        assert counter(bed, server, "verifications_skipped", reason="no_seal") == 0, server
        # kvwatch's own checks all ran, at page size 1 as at 16 (token slots checked in runs),
        # and none was skipped for any reason (no_pool was page size 1's gap). SGLang's own
        # checksum is off (CUDA-only): its one skip is mode_off.
        for detector in ("canary", "page_tag", "admission"):
            assert counter(bed, server, "verifications", detector=detector) > 0, (server, detector)
        for detector in ("canary", "checksum", "page_tag", "admission"):
            skipped = counter(bed, server, "verifications_skipped", detector=detector)
            assert skipped == 0, (server, detector)
        engine = counter(bed, server, "verifications_skipped", detector="engine_checksum")
        assert engine == counter(
            bed, server, "verifications_skipped", detector="engine_checksum", reason="mode_off"
        ), server
    for server in bed.spools:
        assert describe(events(bed, server)) == [], server
        assert counter(bed, server, "hook_errors") == 0, server
    # kvwatch loaded in every scheduler process (a hello on each spool) and said so in each
    # server's log, where an operator looks.
    for process in bed.servers():
        assert any(r.get("type") == "hello" for r in bed.spool(process.name).records)
        assert "kvwatch: SGLang 0.5.23 plugin loaded, mode=" in process.text(), process.name


def test_requests_aborted_mid_transfer_give_no_finding(
    bed: Bed, reference: list[list[int]]
) -> None:
    """A client that goes away while its KV is in flight: SGLang aborts the request on prefill
    and decode (at whatever stage it reached); the pages it held are freed and reused. Not a
    finding, and the servers go on serving."""
    body = generate_body(prompt(6, 150), 64)
    for _ in range(3):
        with suppress(requests.RequestException):
            requests.post(bed.router.url + "/generate", json=body, timeout=0.3)
    time.sleep(3.0)
    for text, expected in zip(CLEAN[1:3], reference[1:3], strict=True):
        served = bed.via_router(text, MAX_TOKENS)
        assert served.status == 200 and served.output_ids == expected, served.body
    time.sleep(2.0)  # one counter flush
    for server in bed.spools:
        assert describe(events(bed, server)) == [], server
        assert counter(bed, server, "hook_errors") == 0, server
    assert counter(bed, "decode-log", "verifications_skipped", reason="no_seal") == 0


def lines_of(owners: Path) -> list[dict[str, Any]]:
    """SGLang's lines on a decode (``drain_rows``, ``page_owners``), in the order it did them;
    a line still being written (no newline yet) is left for the next read."""
    text = owners.read_text() if owners.exists() else ""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def is_row(line: dict[str, Any]) -> bool:
    """A batch's row (``page_owners``), not an admission (``page_owners``: the row before the
    tree insert's dedup), a reserve or a release (``drain_rows``)."""
    return not {"admitted", "reserved", "released", "outcome"} & set(line)


def deduplicated(lines: list[dict[str, Any]], rids: list[str]) -> tuple[str, set[int]]:
    """SGLang's own lines show the tree insert's dedup of one admission: each request reserved
    once, both before either ran, and one's row reads pages the other reserved while pages it
    reserved itself are not in its row (freed as duplicates). A prefix matched at reserve time
    (a request after the other was admitted, or a retried transfer) reserves only the rest, or
    twice. Returns the deduplicated request and the pages freed (none: no dedup)."""
    reserves = [(at, line) for at, line in enumerate(lines) if line.get("reserved")]
    reserved = {rid: [(at, set(line["pages"])) for at, line in reserves if line["rid"] == rid]
                for rid in rids}  # fmt: skip
    ran: dict[str, tuple[int, set[int]]] = {}
    for at, line in enumerate(lines):
        if is_row(line) and line["rid"] in rids:
            ran.setdefault(line["rid"], (at, set(line["pages"])))
    if any(len(reserved[rid]) != 1 for rid in rids) or set(ran) != set(rids):
        return "", set()
    if max(reserved[rid][0][0] for rid in rids) > min(ran[rid][0] for rid in rids):
        return "", set()
    for mine, other in (rids, rids[::-1]):
        row, own, theirs = ran[mine][1], reserved[mine][0][1], reserved[other][0][1]
        if row & theirs and own - row:
            return mine, own - row
    return "", set()


def taken_while_running(lines: list[dict[str, Any]], reader: str, freed: set[int]) -> bool:
    """A freed page was handed out again (another request's reserve, or a row that grew onto
    it) before ``reader``'s last row: while it still ran, with its ticket checked every step."""
    last = max((at for at, line in enumerate(lines) if is_row(line) and line["rid"] == reader))
    return any(line["rid"] != reader and freed & set(line["pages"]) for line in lines[:last])


def test_the_decode_radix_cache_dedup_of_one_admission_gives_no_finding(bed: Bed) -> None:
    """Two requests with one prompt (about 300 tokens), reserved on decode before either is
    admitted and admitted together: SGLang's tree insert frees the second one's duplicate pages
    and points its row at the first one's. While the two still decode, the freed pages are
    handed out again (decode's pool is small, ``RADIX_POOL_TOKENS``, and requests come): the
    second one's ticket, checked every step, must follow its row and not the freed pages (it
    once gave a false ``page_tag/stale_tag``). Every page a row reads holds the right KV: no
    finding. Each step is read from SGLang's reserves and rows, never assumed
    (:func:`deduplicated`, :func:`taken_while_running`): the two are sent at once (one prefill
    batch, one transfer poll on decode), tried again with a fresh prompt when decode admitted
    them apart or a transfer was retried."""
    server = "decode-enforce"  # the decode radix cache is on there
    owners = bed.owners("enforce")
    before = len(events(bed, server))
    for attempt in range(4):
        text = f"dedup {attempt} " + prompt(20 + attempt, 240)
        rids = [f"dedup-{bed.transport}-{attempt}-{k}" for k in range(2)]
        retried = len(bed.retried)
        with ThreadPoolExecutor(3) as pool:
            sent = [pool.submit(bed.direct, "enforce", text, DEDUP_TOKENS, rid) for rid in rids]
            deadline = time.monotonic() + SPOOL_WAIT_S
            reader, freed = "", set()
            while not freed and time.monotonic() < deadline and not all(f.done() for f in sent):
                time.sleep(0.05)
                reader, freed = deduplicated(lines_of(owners), rids)
            # Requests while the two decode: they (or the two's own decode pages) take what
            # the dedup freed once the never-used pages run out.
            for k in range(3 if freed else 0):
                rid = f"after-{bed.transport}-{attempt}-{k}"
                taker = bed.direct("enforce", f"after {k} " + prompt(30 + k, 240), 8, rid=rid)
                assert taker.status == 200, taker.body
                if all(f.done() for f in sent):
                    break
            replies = [reply.result() for reply in sent]
        assert [r.status for r in replies] == [200, 200], replies
        assert replies[0].output_ids == replies[1].output_ids
        lines = lines_of(owners)
        if len(bed.retried) > retried:
            continue  # a transfer retried: its reserve is not the dedup's
        reader, freed = deduplicated(lines, rids)
        if freed and taken_while_running(lines, reader, freed):
            break
    else:
        pytest.fail("no same-prompt pair deduplicated whose freed pages were taken while it ran")
    time.sleep(1.0)  # one spool flush
    assert describe(events(bed, server)[before:]) == []
    assert counter(bed, server, "hook_errors") == 0


def corrupted(bed: Bed, mode: str, words: int) -> tuple[Any, list[dict[str, Any]]]:
    server = f"decode-{mode}"
    before = len(events(bed, server))
    # A prompt no other request shares, under nine pages: the wire carries one digest per page.
    rid = f"{MARK}-{bed.transport}-{mode}"
    served = bed.direct(mode, f"{mode} " + prompt(11, words), MAX_TOKENS, rid=rid)
    assert f"corrupt_after_seal: changed one KV value of {rid}" in bed.prefill(mode).server.text()
    deadline = time.monotonic() + SPOOL_WAIT_S
    while True:
        new = events(bed, server)[before:]
        if new or time.monotonic() > deadline:
            return served, new
        time.sleep(0.5)


def test_kv_corrupted_after_the_seal_is_caught_and_served_in_log_mode(bed: Bed) -> None:
    served, new = corrupted(bed, "log", 40)
    assert served.status == 200, served.body  # log mode records and serves
    assert describe(new) == [("checksum", "digest", "logged")], new
    assert new[0]["request_id"] == f"{MARK}-{bed.transport}-log"
    assert_names_the_page(bed, "log", new[0])


def assert_names_the_page(bed: Bed, mode: str, event: dict[str, Any]) -> None:
    """The one page that differs, named (at page size 1 the prompt's slots are more than the
    wire's per-page digests: one digest for all, every slot named)."""
    assert len(event["pages"]) == 1 or bed.page_size(mode) == 1, event


def test_kv_corrupted_after_the_seal_fails_the_request_in_enforce_mode(
    bed: Bed, reference: list[list[int]]
) -> None:
    served, new = corrupted(bed, "enforce", 45)
    assert served.status != 200 and KVWATCH_ABORT in served.body, served
    assert describe(new) == [("checksum", "digest", "enforced")], new
    assert new[0]["request_id"] == f"{MARK}-{bed.transport}-enforce"
    assert_names_the_page(bed, "enforce", new[0])
    # The server goes on serving clean PD traffic.
    again = bed.direct("enforce", CLEAN[1], MAX_TOKENS)
    assert again.status == 200 and again.output_ids == reference[1], again.body


def test_prefill_stays_clean_and_no_transport_retry_hid_a_finding(bed: Bed) -> None:
    for prefill in bed.prefills.values():
        name = prefill.server.name
        assert describe(events(bed, name)) == [], name
        assert counter(bed, name, "hook_errors") == 0, name
    if bed.retried:
        print(f"transport failures retried ({bed.transport}): {bed.retried}")
