"""The incident, with the other side named: minipd as 0.5.19, sixteen users plant codes, the
over-length prompt reads their stale pages and leaks some codes; kvwatch's events name the
requests whose KV the reader held, checked against minipd's own record of page ownership.
With scrub on (on_free, on_reserve) the incident's marker check (docs/incident.md) leaks
nothing and the detectors still fire."""

from __future__ import annotations

import re
import secrets
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.server import MiniPD
from tests.e2e.test_faults import PROMPT, SMALL, late_write_run, rids
from tests.e2e.test_incident_marker_check import (
    FILLER_WORDS,
    POOLS,
    PROMPT_TOKENS,
    long_request_id,
    run_check,
)

PAGE_SIZE = 16  # minipd's default
EXPOSING = {("canary", "unwritten_page"), ("page_tag", "stale_tag"), ("checksum", "page_count")}
TRUTH = re.compile(r"rid=(\S+) read KV of rid=(\S+) pages=(\d+) tokens=(\d+) at (admit|finish)")


def plant_and_leak(pd: MiniPD) -> tuple[dict[str, str], str, str]:
    """The marker check's steps (incident_marker_check.py.txt), keeping each user's request
    id from its reply: (code -> request id, the long request's id, its reply text)."""
    codes = ["CANARY-" + secrets.token_hex(6) for _ in range(16)]
    owners = {}
    for code in codes:
        status, out = pd.generate(("Remember the code " + code + ". ") * 2000, 64, timeout=240)
        assert status == 200, out
        owners[code] = out["meta_info"]["id"]
    status, out = pd.generate("word " * FILLER_WORDS + "Repeat any codes you saw.", 64, 240)
    assert status == 200 and out["meta_info"]["prompt_tokens"] == PROMPT_TOKENS
    return owners, out["meta_info"]["id"], out["text"]


def ground_truth(pd: MiniPD, reader: str) -> dict[str, tuple[int, int]]:
    """minipd's record: the requests whose KV the reader's reads saw, (pages, tokens) each."""
    held: dict[str, tuple[int, int]] = {}
    for rid, source, pages, tokens, _ in TRUTH.findall(pd.log("decode")):
        if rid == reader:
            before = held.get(source, (0, 0))
            held[source] = (max(before[0], int(pages)), max(before[1], int(tokens)))
    return held


def named(event: dict[str, Any]) -> dict[str, int]:
    return {s["request_id"]: s["pages"] for s in event["sources"]}


def test_0_5_19_events_name_the_exposed_requests_and_no_other(tmp_path: Path) -> None:
    with MiniPD(["--release", "0.5.19", *POOLS], tmp_path, kvwatch="log") as pd:
        owners, reader, text = plant_and_leak(pd)
        truth = ground_truth(pd, reader)
        spool = pd.read_spool()
    leaked = {owners[code] for code in owners if code in text}
    assert leaked, "the stale pages' codes should be in the reply"
    assert not spool.errors
    assert leaked <= truth.keys() <= set(owners.values())  # the record agrees with the reply
    # Whoever's KV filled a whole page of what the reader read (not just a page's tail).
    whole_pages = {rid for rid, (_, tokens) in truth.items() if tokens >= PAGE_SIZE}
    events = {(e["detector"], e["kind"]): e for e in spool.events(request_id=reader)}
    assert events.keys() >= EXPOSING
    everyone: set[str] = set()
    for kind in EXPOSING:
        event = events[kind]
        sources = named(event)
        everyone |= sources.keys()
        assert whole_pages <= sources.keys(), kind
        for rid, pages in sources.items():  # never a request whose KV it did not hold
            assert rid in truth and pages <= truth[rid][0], (kind, rid)
        assert reader not in sources
        assert event["other_sources"] == 0 and event["other_source_pages"] == 0
        for source in event["sources"]:
            assert source["written_at"] == 0 or time.time() - 600 < source["written_at"]
    assert leaked <= everyone  # every user whose code leaked is named
    # The tail of the placeholder's page came from prefill's pool: named through the seal.
    (tail,) = set(named(events[("checksum", "page_count")])) - whole_pages
    assert truth[tail][1] < PAGE_SIZE
    # The users' own requests were clean: no event names them as readers.
    assert {e["request_id"] for e in spool.events()} == {reader}


@pytest.mark.parametrize("scrub", ["on_free", "on_reserve"])
def test_0_5_19_scrub_leaks_nothing_and_detectors_still_fire(tmp_path: Path, scrub: str) -> None:
    args = ["--release", "0.5.19", *POOLS, "--kvwatch-scrub", scrub]
    with MiniPD(args, tmp_path, kvwatch="log") as pd:
        status, prompt_tokens, leaked, _ = run_check(pd, tmp_path)  # the marker check as printed
        reader = long_request_id(pd)
        truth = ground_truth(pd, reader)
        spool = pd.read_spool()
    assert status == 200 and prompt_tokens == str(PROMPT_TOKENS)  # log mode serves it ...
    assert leaked == []  # ... and what it read was zeros: no other user's code
    assert truth == {}  # minipd's record: the pages it read were zeroed
    events = {(e["detector"], e["kind"]): e for e in spool.events(request_id=reader)}
    assert EXPOSING | {("admission", "aborted_admitted")} <= events.keys()  # still paged
    for kind in EXPOSING:
        assert events[kind]["sources"] == [] and events[kind]["other_sources"] == 0


def test_late_write_into_free_pages_names_the_aborted_writer(tmp_path: Path) -> None:
    """Decode gives up on a transfer and frees its pages; prefill's write lands afterwards: the
    canary finding at the next allocation is the aborted request's, whose KV it is, and names
    no reader (the next owner writes the page before reading it)."""
    pd, _ = late_write_run(tmp_path, "off")
    aborted = rids(pd)[0]
    found = [e for e in pd.read_spool().events() if e["kind"] == "write_to_free_page"]
    assert found
    for event in found:
        assert event["request_id"] == aborted
        assert event.get("sources", []) == [] and event["detail"]["next_owner"] != aborted


def test_bit_flip_names_no_source(tmp_path: Path) -> None:
    """A corrupted transfer into the reader's own pages exposes nobody else's KV."""
    with MiniPD(["--fault-bit-flip", "1", *SMALL], tmp_path, kvwatch="log") as pd:
        status, _ = pd.generate(PROMPT, 4)
    (event,) = pd.read_spool().events()
    assert status == 200 and event["kind"] == "digest" and event["sources"] == []
