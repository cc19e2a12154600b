"""Injected faults: each is caught by at least one detector, and the record names it."""

from __future__ import annotations

import re
import time
from pathlib import Path

from tests.e2e.server import MiniPD

# 64 decode pages of 16 tokens: a few requests cycle the whole free list.
SMALL = ["--pool-tokens", "1024", "--context-length", "2048", "--page-size", "16"]
PROMPT = "alpha beta gamma delta " * 64  # 256 tokens: 16 pages


def rids(pd: MiniPD) -> list[str]:
    return re.findall(r"rid=(\S+) prompt_tokens=", pd.log("router"))


def caught(pd: MiniPD) -> set[tuple[str, str, str]]:
    return {(e["detector"], e["kind"], e["request_id"]) for e in pd.read_spool().events()}


def late_write_run(tmp_path: Path, deferred: str) -> tuple[MiniPD, list[int]]:
    args = [
        "--release", "0.5.22", "--deferred-release", deferred, "--transfer-timeout", "0.4",
        "--fault-late-write", "1", "--fault-late-write-delay", "1.2", *SMALL,
    ]  # fmt: skip
    with MiniPD(args, tmp_path, kvwatch="log") as pd:
        statuses = [pd.generate(PROMPT, 4)[0]]  # times out: decode gives up on the transfer
        time.sleep(2.0)  # ... and prefill's write lands afterwards
        # Cycle the FIFO free list so that the aborted request's pages are handed out again.
        statuses += [pd.generate(PROMPT, 4)[0] for _ in range(5)]
    return pd, statuses


def test_late_write_after_abort_without_deferred_release(tmp_path: Path) -> None:
    pd, statuses = late_write_run(tmp_path, "off")
    assert statuses[0] == 500 and statuses[1:] == [200] * 5
    found = {(d, k) for d, k, _ in caught(pd)}
    assert ("canary", "write_to_free_page") in found
    aborted = rids(pd)[0]  # the late writer's finding, not the page's next owner's
    assert all(r == aborted for d, k, r in caught(pd) if k == "write_to_free_page")


def test_late_write_is_harmless_with_deferred_release(tmp_path: Path) -> None:
    pd, statuses = late_write_run(tmp_path, "on")
    assert statuses[0] == 500 and statuses[1:] == [200] * 5
    assert not caught(pd)
    assert "late transfer drained; held pages released" in pd.log("decode")


def test_dropped_page_write(tmp_path: Path) -> None:
    with MiniPD(["--fault-drop-page", "1", *SMALL], tmp_path, kvwatch="log") as pd:
        status, _ = pd.generate(PROMPT, 4)
        rid = rids(pd)[0]
    assert status == 200
    found = caught(pd)
    assert ("canary", "unwritten_page", rid) in found
    assert ("page_tag", "stale_tag", rid) in found
    assert ("checksum", "digest", rid) in found


def test_bit_flip_in_transfer(tmp_path: Path) -> None:
    with MiniPD(["--fault-bit-flip", "1", *SMALL], tmp_path, kvwatch="log") as pd:
        status, _ = pd.generate(PROMPT, 4)
        rid = rids(pd)[0]
    assert status == 200
    assert caught(pd) == {("checksum", "digest", rid)}


def test_bit_flip_enforced_fails_the_request(tmp_path: Path) -> None:
    with MiniPD(["--fault-bit-flip", "2", *SMALL], tmp_path, kvwatch="enforce") as pd:
        first, _ = pd.generate(PROMPT, 4)
        second, body = pd.generate(PROMPT, 4)
    assert first == 200
    assert second == 500 and "text" not in body and "kvwatch" in body["error"]["message"]
    events = pd.read_spool().events(detector="checksum")
    assert [e["action"] for e in events] == ["enforced"]


def test_double_free(tmp_path: Path) -> None:
    with MiniPD(["--fault-double-free", "1", *SMALL], tmp_path, kvwatch="log") as pd:
        statuses = [pd.generate(PROMPT, 4)[0] for _ in range(2)]
    assert statuses == [200, 200]
    assert ("page_tag", "double_free") in {(d, k) for d, k, _ in caught(pd)}
