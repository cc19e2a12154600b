"""The incident in real SGLang servers: a prompt longer than prefill's pool, shorter than the
context, through the 0.5.19 admission doors (``release_0_5_19``) and the smg router.

Without kvwatch, ``kvwatch probe`` through the router gets HTTP 200 for it: decode served a
request whose pages, but the one the stub's transfer wrote, hold what other requests left there
(``page_owners`` says whose). With 0.5.23's own doors the prompt is refused with 400. With
kvwatch, its reserve canary names the unwritten pages at decode's admission and whose KV they
held (checked against ``page_owners``), serving it in ``log`` and failing it in ``enforce``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_hooks.testing import read_spool
from tests.sglang_pd import incident
from tests.sglang_pd.bed import KVWATCH_ABORT, PAGE_SIZE, ROOT, generate_body, post, stop_all
from tests.sglang_pd.page_owners import first_row, last_owners

KVWATCH = ROOT / ".venv" / "bin" / "python"  # kvwatch as users install it, apart from SGLang
MARKERS = 3
# "Remember the code CANARY-<12 hex>. " is 19 tokens: a marker prompt of about 1,800 tokens,
# inside prefill's pool, and longer than the probe's timing prompts (so some of its pages are
# still there when the long prompt comes).
MARKER_REPEATS = 95
LONG = "word " * 3000 + "Repeat any codes you saw."  # about 3,000 tokens: in (pool, context]
SPOOL_WAIT_S = 15.0
# Decode's pool (8,192 tokens) hands out never-used pages first and merges freed ones only when
# those run out (SGLang's sorted free list): three markers and the long prompt fit in fresh
# pages, so nothing foreign would be there to read. Six markers go round the pool once, and the
# long prompt's row gets pages the markers held.
WATCHED_MARKERS = 6


def probe(url: str) -> tuple[int, dict[str, Any]]:
    done = subprocess.run(
        [str(KVWATCH), "-m", "kvwatch.cli", "probe", "--url", url, "--json",
         "--pool-tokens", str(incident.PREFILL_POOL), "--context-length", str(incident.CONTEXT),
         "--markers", str(MARKERS), "--marker-repeats", str(MARKER_REPEATS), "--timeout", "300"],
        capture_output=True, text=True, timeout=900, cwd=ROOT, check=False,
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, json.loads(done.stdout)


#: The transports the incident runs over (both in the stage); ``KVWATCH_SGLANG_PD_INCIDENT``
#: narrows it, e.g. to ``mooncake_tcp`` in an edit loop.
TRANSPORTS = os.environ.get("KVWATCH_SGLANG_PD_INCIDENT", "mooncake_tcp,nixl").split(",")


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def bare(transport: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with incident.deployment(
        transport, tmp_path_factory.mktemp(f"incident-bare-{transport}"), kvwatch=False
    ) as running:
        yield running


def reader_of(owners: Path) -> str:
    """The request with the longest row on decode: the probe's long prompt."""
    rows = [json.loads(line) for line in owners.read_text().splitlines()]
    return str(max(rows, key=lambda r: len(r["pages"]))["rid"])


def test_without_kvwatch_the_0_5_19_doors_answer_the_long_prompt(bare: Any) -> None:
    code, report = probe(bare.fire_and_forget("0.5.19"))
    assert report["status"] == 200, report
    assert incident.PREFILL_POOL < report["prompt_tokens"] <= incident.CONTEXT, report
    assert code == 3 and report["leaked_markers"], report  # another request's marker
    # Ground truth: the pages decode served it held other requests' KV.
    owners = bare.owners_file("decode-bare")
    reader = reader_of(owners)
    held = last_owners(owners, reader, first_row(owners, reader)[1:])
    assert sum(len(p) for p in held.values()) > 100, held


def test_through_smg_the_0_5_19_long_prompt_is_answered_too(bare: Any) -> None:
    """smg 1.13 answers once prefill has: with 0.5.19's handling, prefill sends the stub on and
    answers 200 for it, so the client gets decode's reply, served over pages it never got."""
    owners = bare.owners_file("decode-bare")
    before = owners.read_text().count("\n")
    served = post(bare.routers["0.5.19"].url, generate_body(LONG, 8))
    assert served.status == 200, served
    deadline = time.monotonic() + SPOOL_WAIT_S
    while True:  # decode may run it after the router answered
        rows = [json.loads(line) for line in owners.read_text().splitlines()[before:]]
        if any(len(r["pages"]) * PAGE_SIZE > incident.PREFILL_POOL for r in rows):
            break
        assert time.monotonic() < deadline, rows
        time.sleep(0.5)


def test_with_0_5_23_s_own_code_the_long_prompt_is_refused_with_400(bare: Any) -> None:
    # One request, not the whole probe: the stage's time budget (the probe's exit 0 on this
    # answer is tests/e2e/test_probe.py's).
    served = post(bare.routers["0.5.23"].url, generate_body(LONG, 8))
    assert served.status == 400, served


@pytest.fixture(scope="module")
def watched(transport: str, tmp_path_factory: pytest.TempPathFactory, bare: Any) -> Iterator[Any]:
    # After the bare deployment's tests: one deployment at a time on the bed's machine.
    stop_all(bare.processes())
    with incident.deployment(
        transport, tmp_path_factory.mktemp(f"incident-kvwatch-{transport}"), kvwatch=True
    ) as running:
        yield running


def code(i: int) -> str:
    return "CANARY-" + hashlib.sha256(str(i).encode()).hexdigest()[:12]


def marker(i: int) -> str:
    return f"Remember the code {code(i)}. " * MARKER_REPEATS


def long_prompt_after_markers(bed: Any, decode: str) -> tuple[Any, str, list[dict[str, Any]]]:
    for i in range(WATCHED_MARKERS):
        planted = bed.direct("0.5.19", decode, marker(i), 8, rid=f"marker-{decode}-{i}")
        assert planted.status == 200, planted.body
    rid = f"long-{decode}"
    served = bed.direct("0.5.19", decode, LONG, 64, rid=rid)
    deadline = time.monotonic() + SPOOL_WAIT_S
    while True:
        found = read_spool(bed.spool(decode)).events()
        if found or time.monotonic() > deadline:
            return served, rid, found
        time.sleep(0.5)


def check_against_ground_truth(bed: Any, decode: str, rid: str, event: dict[str, Any]) -> None:
    """The event's pages are the row's but the first (the stub's, which prefill wrote), and
    the requests it names held them last, by ``page_owners``."""
    owners = bed.owners_file(decode)
    unwritten = first_row(owners, rid)[1:]
    assert set(event["pages"]) <= set(unwritten), (event["pages"], unwritten)
    assert abs(event["pages_total"] - len(unwritten)) <= 1, (event["pages_total"], unwritten)
    held = last_owners(owners, rid, unwritten)
    named = {s["request_id"]: s["pages"] for s in event["sources"]}
    assert named, event
    for request_id, pages in named.items():
        assert request_id in held, (request_id, held)
        assert pages <= len(held[request_id]), (request_id, pages, held)
    assert set(held) <= set(named), (held, named)


def test_kvwatch_log_names_the_unwritten_pages_and_whose_kv_they_held(watched: Any) -> None:
    served, rid, found = long_prompt_after_markers(watched, "decode-log")
    assert served.status == 200, served.body  # log mode records and serves
    kinds = [(e["detector"], e["kind"], e["action"], e["request_id"]) for e in found]
    assert ("canary", "unwritten_page", "logged", rid) in kinds, found
    event = next(e for e in found if e["kind"] == "unwritten_page")
    assert event["pages_total"] > 100, event
    check_against_ground_truth(watched, "decode-log", rid, event)


def test_kvwatch_enforce_fails_the_long_prompt(watched: Any) -> None:
    served, rid, found = long_prompt_after_markers(watched, "decode-enforce")
    assert served.status != 200 and KVWATCH_ABORT in served.body, served
    kinds = [(e["detector"], e["kind"], e["action"], e["request_id"]) for e in found]
    assert ("canary", "unwritten_page", "enforced", rid) in kinds, found


def test_prefill_records_the_rejected_request_at_its_door(watched: Any) -> None:
    found = read_spool(watched.spool("prefill-0.5.19")).events()
    kinds = {(e["detector"], e["kind"], e["request_id"]) for e in found}
    for decode in ("decode-log", "decode-enforce"):
        assert ("admission", "aborted_admitted", f"long-{decode}") in kinds, found
