"""The status page at ``/``: rendered from the daemon's state and journal, checked in Chromium."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest

from kvwatch.state import Producer, State
from kvwatch.statuspage import render
from tests.kvwatch.daemonproc import REPO, DaemonProcess

ARTIFACTS = REPO / "artifacts"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


class Dom(HTMLParser):
    """Element ids, classes and text, enough for assertions without a browser driver."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: dict[str, dict[str, str]] = {}
        self.pool_rows: list[dict[str, str]] = []
        self.cells: list[str] = []
        self.text: list[str] = []
        self._in_td = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = {k: v or "" for k, v in attrs}
        if "id" in attributes:
            self.ids[attributes["id"]] = attributes
        if "pool-row" in attributes.get("class", ""):
            self.pool_rows.append(attributes)
        self._in_td = tag == "td"

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._in_td = False

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._in_td:
            self.cells.append(data)


def parse(html: str) -> Dom:
    dom = Dom()
    dom.feed(html)
    return dom


def test_render_escapes_and_draws_the_band() -> None:
    state = State()
    state.producers["p"] = Producer(
        name="p", id=1, engine="sglang", role="prefill", model="glm", last_ts=time.time(),
        gauges={"kv_pool_tokens": 681_280, "context_length_tokens": 1_048_576},
    )  # fmt: skip
    incident = {
        "time": time.time(), "node": "n1", "role": "decode", "engine": "sglang",
        "request_id": "<script>alert(1)</script>", "detector": "canary",
        "kind": "unwritten_page", "pages": [1, 2], "pages_total": 2,
    }  # fmt: skip
    page = render(state, [incident])
    assert "<script>alert" not in page
    dom = parse(page)
    # No mismatch, but a 35% unsafe band: the headline must not say OK.
    assert dom.ids["state"]["class"] == "warning"
    assert "WARNING: unsafe band on prefill (sglang)" in "".join(dom.text)
    assert dom.pool_rows[0]["data-band"] == "367296"
    assert "35% of the window" in "".join(dom.text)
    assert "<script>alert(1)</script>" in dom.cells


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium is not installed: make test installs Debian's chromium package")
    return path


def browser(*args: str) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True,
            text=True,
            timeout=90,
            check=True,
        )


def test_status_page_in_chromium(tmp_path: Path) -> None:
    # The walkthrough exits at once; a long idle grace keeps its segment (and so its pool
    # gauges) live while a loaded machine takes seconds to start Chromium.
    daemon = DaemonProcess(tmp_path, "--no-nvml", "--idle-grace", "600s")
    try:
        port = daemon.wait_started()
        # A real producer: the walkthrough's hooks write mismatches and the Workers AI pool.
        subprocess.run(
            [sys.executable, "-m", "engine_hooks.walkthrough", "--spool", str(daemon.spool)],
            cwd=REPO, check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + 30
        while "rejected-1" not in urllib.request.urlopen(url, timeout=10).read().decode():
            assert time.monotonic() < deadline, "the walkthrough's incidents never reached /"
            time.sleep(0.2)
        dom = parse(browser("--dump-dom", url).stdout)
        assert dom.ids["state"]["class"] == "alarm"
        assert "INTEGRITY ALERT" in "".join(dom.text)
        assert [row["data-band"] for row in dom.pool_rows] == ["367296"]
        assert {"rejected-1", "flip-3", "running-4"} <= set(dom.cells)
        assert {"unwritten_page", "digest", "stale_tag"} <= set(dom.cells)
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "statuspage.png"
        shot.unlink(missing_ok=True)
        browser(f"--screenshot={shot}", "--window-size=1100,1000", "--hide-scrollbars", url)
        assert shot.stat().st_size > 10_000
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert b"kvwatch_mismatches_total" in reply.read()
    finally:
        daemon.stop()
