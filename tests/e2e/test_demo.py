"""``python -m minipd demo`` (what ``make demo`` runs): the leaked reply and the records."""

from __future__ import annotations

import re
import subprocess
import sys

from minipd.launch import child_env


def test_demo_shows_the_leak_and_the_detectors_records() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "minipd", "demo"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=child_env(),
    )
    out = done.stdout
    assert done.returncode == 0, done.stderr[-2000:]
    assert "HTTP 200" in out and "prompt_tokens=20005" in out
    assert "other users' codes in the reply: ['CANARY-" in out
    for line in (
        "detector=canary",
        "detector=checksum",
        "detector=page_tag",
        "kind=unwritten_page",
    ):
        assert line in out


def test_make_demo_prints_the_disclosure_view_after_the_leak() -> None:
    """``make demo`` (``python -m demo``): after the leaked reply, the disclosure view from the
    journal: readers, sources, counts."""
    done = subprocess.run(
        [sys.executable, "-m", "demo", "--no-hold"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=child_env(),
    )
    out = done.stdout
    assert done.returncode == 0, done.stderr[-2000:]
    leak = out.index("other users' codes in the reply: ['CANARY-")
    view = out.index("== kvwatch incidents --exposed")
    assert leak < view
    shown = out[view:]
    assert "READERS: requests that received other requests' KV" in shown
    assert "SOURCES: requests whose KV was received" in shown
    assert " reader(s), " in shown and " named source(s) and " in shown
    # One leaking request: one incident, and the same affected and exposed counts in the list,
    # the disclosure view and kvwatch status.
    listing = out[out.index("== kvwatch incidents (what") : view]
    found = re.search(r"(\d+) exposed request\(s\), (\d+) incident\(s\)", listing)
    assert found and found[2] == "1", listing
    exposed = found[1]
    assert f"1 incident(s) (affected requests), {exposed} exposed request(s)" in shown
    status = out[out.index("== kvwatch status") :]
    assert f"INTEGRITY ALERT: 1 affected request(s), {exposed} exposed request(s)" in status
    # One page per alert group: the pool alert (hooks and log series) and the leak's five
    # detector alerts each print once.
    assert out.count("PAGE  KVPoolSmallerThanContext") == 1
    assert out.count("PAGE  KVIntegrityMismatch") == 1
    # The page's counts, as last printed for its group (its first notification may hold
    # prefill's alert alone; a resend with decode's prints "now: ..."): the same numbers.
    said = re.findall(
        r"(\d+) affected request\(s\) \(incidents\) in that time received the KV of (\d+) ", out
    )
    assert said and said[-1] == ("1", exposed), said
