"""The incident in real SGLang servers: a prompt longer than prefill's pool, shorter than the
context, through the 0.5.19 admission doors (``release_0_5_19``) and the smg router.

Without kvwatch, ``kvwatch probe`` through the router gets HTTP 200 for it and another
request's marker back: decode served a request whose pages, but the one the stub's transfer
wrote, hold what other requests left there (``page_owners`` says whose). With 0.5.23's own doors
the prompt is refused with 400. With kvwatch, the same probe through the router: its reserve
canary names the unwritten pages at decode's admission and whose KV they held (checked against
``page_owners``), serving it in ``log`` and failing it in ``enforce``, where nothing leaks.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from engine_hooks.testing import read_spool
from tests.sglang_pd import incident
from tests.sglang_pd.bed import ROOT, generate_body, post, stop_all
from tests.sglang_pd.page_owners import first_row, last_owners

KVWATCH = ROOT / ".venv" / "bin" / "python"  # kvwatch as users install it, apart from SGLang
MARKERS = 3
# "Remember the code CANARY-<12 hex>. " is 19 tokens: a marker prompt of about 900 tokens (57
# pages), inside prefill's pool, where the long prompt's pages will be (``incident.DECODE_POOL``).
MARKER_REPEATS = 47
LONG = "word " * 1500 + "Repeat any codes you saw."  # about 1,500 tokens: in (pool, context]
#: Half the long prompt's row (97 pages of 16): that many of its pages, at least, held
#: another request's KV, and kvwatch names at least that many unwritten.
MOST_PAGES = 48
SPOOL_WAIT_S = 15.0
DOOR = ("admission", "aborted_admitted")  # prefill's record of a request rejected at intake


def probe(url: str) -> tuple[int, dict[str, Any]]:
    done = subprocess.run(
        [str(KVWATCH), "-m", "kvwatch.cli", "probe", "--url", url, "--json",
         "--pool-tokens", str(incident.PREFILL_POOL), "--context-length", str(incident.CONTEXT),
         "--markers", str(MARKERS), "--marker-repeats", str(MARKER_REPEATS), "--timeout", "300"],
        capture_output=True, text=True, timeout=900, cwd=ROOT, check=False,
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, json.loads(done.stdout)


#: The transports kvwatch's incident tests run over (both in the stage);
#: ``KVWATCH_SGLANG_PD_INCIDENT`` narrows it, e.g. to ``mooncake_tcp`` in an edit loop.
TRANSPORTS = os.environ.get("KVWATCH_SGLANG_PD_INCIDENT", "mooncake_tcp,nixl").split(",")
#: The deployment without kvwatch runs once, over Mooncake (the incident's own transport): what
#: it shows is 0.5.19's admission on decode and 0.5.23's refusal at prefill's intake, neither of
#: which the transport takes part in (one deployment less in the stage's time budget).
BARE_TRANSPORT = "mooncake_tcp" if "mooncake_tcp" in TRANSPORTS else TRANSPORTS[0]
#: The deployments up now: each fixture stops the others first (one at a time on the machine).
_up: list[incident.Deployment] = []


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@contextmanager
def alone(transport: str, workdir: Path, *, kvwatch: bool) -> Iterator[incident.Deployment]:
    """The incident's deployment, once every other one is stopped."""
    for other in _up:
        stop_all(other.processes())
    with incident.deployment(transport, workdir, kvwatch=kvwatch) as running:
        _up.append(running)
        try:
            yield running
        finally:
            _up.remove(running)


@pytest.fixture(scope="module")
def bare(transport: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    workdir = tmp_path_factory.mktemp(f"incident-bare-{transport}")
    with alone(transport, workdir, kvwatch=False) as running:
        yield running


#: The tests of the deployment without kvwatch: over BARE_TRANSPORT alone.
over_bare_transport = pytest.mark.parametrize("transport", [BARE_TRANSPORT], indirect=True)


def reader_of(owners: Path) -> str:
    """The request with the longest row on decode: the probe's long prompt."""
    rows = [json.loads(line) for line in owners.read_text().splitlines()]
    return str(max(rows, key=lambda r: len(r["pages"]))["rid"])


@over_bare_transport
def test_without_kvwatch_the_marker_test_leaks_through_the_router(bare: Any) -> None:
    """smg 1.13 answers once prefill has: with 0.5.19's handling, prefill sends the stub on and
    answers 200 for it, so the client gets decode's reply, served over pages it never got."""
    code, report = probe(bare.routers["0.5.19"].url)
    assert report["status"] == 200, report
    assert incident.PREFILL_POOL < report["prompt_tokens"] <= incident.CONTEXT, report
    assert code == 3 and report["leaked_markers"], report  # another request's marker
    # Ground truth: the pages decode served it held other requests' KV.
    owners = bare.owners_file("decode-bare")
    reader = reader_of(owners)
    held = last_owners(owners, reader, first_row(owners, reader)[1:])
    assert sum(len(p) for p in held.values()) > MOST_PAGES, held


@over_bare_transport
def test_with_0_5_23_s_own_code_the_long_prompt_is_refused_with_400(bare: Any) -> None:
    # One request, not the whole probe: the stage's time budget (the probe's exit 0 on this
    # answer is tests/e2e/test_probe.py's).
    served = post(bare.routers["0.5.23"].url, generate_body(LONG, 8))
    assert served.status == 400, served


@pytest.fixture(scope="module")
def watched(transport: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    workdir = tmp_path_factory.mktemp(f"incident-kvwatch-{transport}")
    with alone(transport, workdir, kvwatch=True) as running:
        yield running


def findings(bed: Any, decode: str) -> list[dict[str, Any]]:
    """The decode's findings, once there are any or the wait ends."""
    deadline = time.monotonic() + SPOOL_WAIT_S
    while True:
        found = read_spool(bed.spool(decode)).events()
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def rejected_at_prefill(bed: Any) -> int:
    """How many requests prefill's door saw rejected at intake and admitted all the same (by
    count: through smg each server names a request with its own id)."""
    found = read_spool(bed.spool("prefill-0.5.19")).events()
    return sum((e["detector"], e["kind"]) == DOOR for e in found)


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
    code, report = probe(watched.routers["decode-log"].url)
    # Log mode serves it (exit 3 or 1: the reserve canary's NaN stamps, left in the pages
    # nobody wrote, may garble what the model recites of their KV).
    assert report["status"] == 200 and code in (1, 3), report
    rid = reader_of(watched.owners_file("decode-log"))  # ground truth: the longest row
    found = findings(watched, "decode-log")
    assert {e["request_id"] for e in found} == {rid}, found  # nothing on any other request
    kinds = [(e["detector"], e["kind"], e["action"]) for e in found]
    assert ("canary", "unwritten_page", "logged") in kinds, found
    event = next(e for e in found if e["kind"] == "unwritten_page")
    assert event["pages_total"] > MOST_PAGES, event
    check_against_ground_truth(watched, "decode-log", rid, event)
    assert rejected_at_prefill(watched) == 1  # prefill's door recorded it too, and only it


def test_kvwatch_enforce_fails_the_long_prompt_and_nothing_leaks(watched: Any) -> None:
    code, report = probe(watched.routers["decode-enforce"].url)
    # A server error (probe exit 1): the engine let the prompt through, but decode served
    # nothing of what the pages held.
    assert report["status"] >= 500 and code == 1 and not report["leaked_markers"], report
    # smg retries a failed request (--retry-max-retries, 5 by default): each attempt is a new
    # request, rejected at prefill's intake, reserved anew on decode and failed again. Every
    # one of them, and nothing else, has the canary's finding.
    deadline = time.monotonic() + SPOOL_WAIT_S
    while True:  # the last attempt's records may trail the probe's answer
        attempts = rejected_at_prefill(watched) - 1  # the log probe's long prompt was the first
        found = findings(watched, "decode-enforce")
        if len({e["request_id"] for e in found}) >= attempts or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert attempts >= 1 and {e["action"] for e in found} == {"enforced"}, found
    canary = [e for e in found if (e["detector"], e["kind"]) == ("canary", "unwritten_page")]
    assert len(canary) == attempts == len({e["request_id"] for e in found}), (attempts, found)
    assert all(e["pages_total"] > MOST_PAGES for e in canary), canary
    print(f"\n{watched.transport}: the router tried the long prompt {attempts} times")
