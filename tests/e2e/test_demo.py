"""``python -m minipd demo`` (what ``make demo`` runs): the leaked reply and the records."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from demo.stack import REPO
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


def test_make_demo_prints_the_disclosure_view_after_the_leak(tmp_path: Path) -> None:
    """``make demo`` (``python -m demo``) not on a terminal: after the leaked reply, the
    disclosure view from the journal (readers, sources, counts); then it stays up, the URLs and
    commands it printed answer as printed (from the checkout, where ``make demo`` runs), and
    SIGTERM stops it all."""
    log = tmp_path / "demo.out"
    with log.open("w") as stdout:
        proc = subprocess.Popen(
            [sys.executable, "-m", "demo"], stdin=subprocess.DEVNULL, stdout=stdout,
            stderr=subprocess.STDOUT, cwd=REPO, env=child_env(),
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while "Everything is still running" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        out = log.read_text()
        where = out[out.index("== Where to look") :]
        url = re.search(r"status page\s+(\S+)", where)
        assert url, where
        with urllib.request.urlopen(url[1], timeout=10) as page:
            assert page.status == 200
        printed = {
            name: re.search(rf"^    {name}\s{{2,}}(.+)$", where, re.M) for name in
            ("incidents", "exposed requests", "status")
        }  # fmt: skip
        for name, line in printed.items():
            assert line, (name, where)
            argv = shlex.split(line[1])
            assert not argv[0].startswith("kvwatch"), argv  # not on the PATH: its real path
            ran = subprocess.run(
                argv, cwd=REPO, capture_output=True, text=True, timeout=60, check=False
            )
            assert ran.returncode == (4 if name == "status" else 0), (argv, ran.stderr)  # 4: alarm
            assert "Traceback" not in ran.stderr, ran.stderr
            if name == "incidents":
                assert "1 incident(s)" in ran.stdout, ran.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert "stopped." in out, out[-2000:]
    try:
        urllib.request.urlopen(url[1], timeout=5)
        raise AssertionError("the status page answers after SIGTERM")
    except OSError:
        pass
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
