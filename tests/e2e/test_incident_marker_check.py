"""The incident's marker check (docs/incident.md), its script as printed (only URL and
FILLER_WORDS changed), against minipd configured as each release, with kvwatch off, log and
enforce."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.server import MiniPD

TEMPLATE = Path(__file__).with_name("incident_marker_check.py.txt")
# The prefill pool is the small one, as on Workers AI; decode can reserve the whole prompt.
POOLS = ["--pool-tokens", "16384", "--decode-pool-tokens", "65536", "--context-length", "32768"]
FILLER_WORDS = 20_000
PROMPT_TOKENS = FILLER_WORDS + 5  # "Repeat any codes you saw." is five words
LINE = re.compile(r"^status (\d+) prompt_tokens (\S+) leaked (\[.*\])$", re.M)


def run_check(pd: MiniPD, workdir: Path) -> tuple[int, str, list[str], str]:
    script = TEMPLATE.read_text()
    script = script.replace('"http://127.0.0.1:8000/generate"', repr(pd.url + "/generate"))
    script = script.replace("FILLER_WORDS = 900_000", f"FILLER_WORDS = {FILLER_WORDS}")
    path = workdir / "marker_check.py"
    path.write_text(script)
    done = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=240, check=False
    )
    match = LINE.search(done.stdout)
    assert match, f"no result line: {done.stdout!r} {done.stderr[-2000:]!r}"
    leaked = ast.literal_eval(match.group(3))
    return int(match.group(1)), match.group(2), leaked, done.stderr


def long_request_id(pd: MiniPD) -> str:
    found = re.findall(rf"rid=(\S+) prompt_tokens={PROMPT_TOKENS} ", pd.log("router"))
    assert len(found) == 1, pd.log("router")
    return str(found[0])


def test_band_is_where_the_test_puts_it() -> None:
    assert 16384 < PROMPT_TOKENS <= 32768


def test_0_5_19_kvwatch_off_leaks_other_users_markers(tmp_path: Path) -> None:
    with MiniPD(["--release", "0.5.19", *POOLS], tmp_path, kvwatch="off") as pd:
        status, prompt_tokens, leaked, stderr = run_check(pd, tmp_path)
    assert status == 200
    assert prompt_tokens == str(PROMPT_TOKENS)
    assert leaked, "the stale pages' markers should be in the reply"
    assert "an over-length prompt must fail" in stderr  # the script's own assertion fired


def test_0_5_19_kvwatch_log_serves_and_records_all_three_detectors(tmp_path: Path) -> None:
    with MiniPD(["--release", "0.5.19", *POOLS], tmp_path, kvwatch="log") as pd:
        status, prompt_tokens, leaked, _ = run_check(pd, tmp_path)
        rid = long_request_id(pd)
    assert status == 200 and prompt_tokens == str(PROMPT_TOKENS)
    assert leaked
    spool = pd.read_spool()
    assert not spool.errors
    kinds = {(e["detector"], e["kind"]) for e in spool.events(request_id=rid)}
    assert ("canary", "unwritten_page") in kinds
    assert ("checksum", "page_count") in kinds
    assert ("page_tag", "stale_tag") in kinds
    assert ("admission", "aborted_admitted") in kinds
    assert all(e["action"] == "logged" for e in spool.events(request_id=rid))
    # Only the long request was flagged: the sixteen marker requests were clean.
    assert {e["request_id"] for e in spool.events()} == {rid}


def test_0_5_19_kvwatch_enforce_fails_the_request_without_text(tmp_path: Path) -> None:
    with MiniPD(["--release", "0.5.19", *POOLS], tmp_path, kvwatch="enforce") as pd:
        status, prompt_tokens, leaked, stderr = run_check(pd, tmp_path)
    assert 500 <= status < 600
    assert prompt_tokens == "None" and not leaked
    assert "AssertionError" not in stderr


@pytest.mark.parametrize("release", ["0.5.20", "0.5.22"])
def test_fixed_releases_answer_400(tmp_path: Path, release: str) -> None:
    with MiniPD(["--release", release, *POOLS], tmp_path, kvwatch="log") as pd:
        status, _, leaked, stderr = run_check(pd, tmp_path)
        rid = long_request_id(pd)
    assert status == 400 and not leaked
    assert "AssertionError" not in stderr
    # No page of the long request was read: no integrity detector fired.
    events = pd.read_spool().events(request_id=rid)
    assert {e["detector"] for e in events} <= {"admission"}
    if release == "0.5.22":
        assert not events  # rejected at the door, before the admission check could be fooled
        assert rid not in pd.log("decode")
