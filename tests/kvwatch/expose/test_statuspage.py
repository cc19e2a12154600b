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

from kvwatch.expose.page import render
from kvwatch.expose.status import Alarm, AlarmSettings
from kvwatch.store import incident as incident_model
from kvwatch.store.state import Producer, State
from tests.kvwatch.daemonproc import REPO, DaemonProcess
from tests.kvwatch.views import as_finding
from tests.kvwatch.writer import spool_module

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
        self.sources: list[str] = []
        self.cells: list[str] = []
        self.text: list[str] = []
        self._in_td = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = {k: v or "" for k, v in attrs}
        if "id" in attributes:
            self.ids[attributes["id"]] = attributes
        if "data-source" in attributes:
            self.sources.append(attributes["data-source"])
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
        "kind": "unwritten_page", "pages": [1, 2], "pages_total": 2, "instance": None,
        "sources": [
            {"request_id": "alice", "instance": "alice#2", "pages": 2, "written_at": 0.0},
            {"request_id": "<b>bob</b>", "instance": None, "pages": 1, "written_at": 0.0},
        ],
        "other_sources": 5, "other_source_pages": 9, "id": 1, "producer": "d", "seq": 1,
        "engine_version": "1", "model": "glm", "mode": "log", "action": "logged",
        "detail": {}, "rank": 0,
    }  # fmt: skip
    grouped = incident_model.group([as_finding(incident)])
    page = render(state, Alarm(AlarmSettings()), grouped)
    assert "<script>alert" not in page and "<b>bob" not in page
    dom = parse(page)
    # No open incident, but a 35% unsafe band: a critical condition (the rule pages critical).
    assert dom.ids["state"]["class"] == "alarm"
    assert "ALARM: unsafe band on prefill (sglang)" in "".join(dom.text)
    assert dom.pool_rows[0]["data-band"] == "367296"
    assert "35% of the window" in "".join(dom.text)
    assert "<script>alert(1)</script>" in dom.cells
    # The latest incident's sources, named, and the count of the unnamed rest.
    assert dom.sources == ["alice", "<b>bob</b>"]
    text = " ".join(dom.text)
    assert "received the KV of 7 other request(s)" in text
    assert "and 5 more request(s): 9 page(s)" in text
    assert "7" in dom.cells  # the table's exposed column
    assert "no" in dom.cells  # not acknowledged


def test_a_request_stopped_before_it_read_received_nobodys_kv() -> None:
    """An enforce-mode finding whose request was failed before it read keeps its sources as
    evidence, but the page says nobody's KV reached it (and counts no exposed request)."""
    incident = {
        "time": time.time(), "node": "n1", "role": "decode", "engine": "minipd",
        "request_id": "r5", "detector": "page_tag", "kind": "stale_tag", "pages": [3],
        "pages_total": 1, "instance": "i-5",
        "sources": [{"request_id": "r1", "instance": "i-1", "pages": 1, "written_at": 0.0}],
        "other_sources": 0, "other_source_pages": 0, "id": 1, "producer": "d", "seq": 1,
        "engine_version": "1", "model": "m", "mode": "enforce", "action": "enforced",
        "detail": {"stopped_before_read": 1}, "rank": 0,
    }  # fmt: skip
    grouped = incident_model.group([as_finding(incident)])
    dom = parse(render(State(), Alarm(AlarmSettings()), grouped))
    text = " ".join(dom.text)
    assert "failed (enforce) before it read: nobody's KV reached it" in text
    assert dom.sources == [] and "r5" in dom.cells


def test_band_after_the_engine_exits_is_stale_not_ok() -> None:
    """An engine gone: the page says no engine reports, and shows the last band as stale,
    never "every reporting engine's pool holds its context" about no engine."""
    state = State()
    state.producers["p"] = Producer(
        name="p", id=1, engine="sglang", role="prefill", model="glm", last_ts=time.time(),
        gauges={"kv_pool_tokens": 681_280, "context_length_tokens": 1_048_576}, retired=True,
    )  # fmt: skip
    page = render(state, Alarm(AlarmSettings()), [])
    dom = parse(page)
    text = "".join(dom.text)
    band = [t for t in dom.text if "reporting engine" in t][-1]  # the check's line
    assert band.startswith("no reporting engine; the last one that reported had an unsafe band")
    assert "stale" in band and "holds its context" not in text
    assert "Last known (stale" in text and dom.pool_rows[0]["data-band"] == "367296"
    del state.producers["p"]
    page = render(state, Alarm(AlarmSettings()), [])
    assert "no reporting engine: no pool or context length to check" in page


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
        # A leak whose reader names its sources, from a real SpoolWriter: the newest incident.
        writer = spool_module().SpoolWriter(daemon.spool, engine="sglang", role="decode")
        writer.write(
            "event",
            {
                "detector": "page_tag", "kind": "stale_tag", "mode": "log", "action": "logged",
                "request_id": "reader-9", "pages": [4, 5], "pages_total": 2,
                "sources": [{"request_id": "user-a", "pages": 2}], "other_sources": 1,
                "other_source_pages": 1,
            },
        )  # fmt: skip
        writer.close()
        while "reader-9" not in urllib.request.urlopen(url, timeout=10).read().decode():
            assert time.monotonic() < deadline, "the leak never reached /"
            time.sleep(0.2)
        dom = parse(browser("--dump-dom", url).stdout)
        assert dom.sources == ["user-a"]
        assert dom.ids["state"]["class"] == "alarm"
        assert "INTEGRITY ALERT" in "".join(dom.text)
        assert [row["data-band"] for row in dom.pool_rows] == ["367296"]
        assert {"rejected-1", "flip-3", "running-4", "reader-9"} <= set(dom.cells)
        findings = " ".join(dom.cells)  # one row per incident, its findings in one cell
        assert all(k in findings for k in ("unwritten_page", "digest", "stale_tag"))
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "statuspage.png"
        shot.unlink(missing_ok=True)
        browser(f"--screenshot={shot}", "--window-size=1100,1000", "--hide-scrollbars", url)
        assert shot.stat().st_size > 10_000
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert b"kvwatch_mismatches_total" in reply.read()
    finally:
        daemon.stop()
