"""Case 7: privacy. minipd serves prompts that all carry a sentinel word, with the hooks in log
mode and a prompt in the unsafe band (so detection events are written too); the sentinel, its
token id and its token bytes never appear in the spool, the journal, the incidents log, the
daemon's log, /metrics or the status page."""

from __future__ import annotations

import base64
import urllib.request
from pathlib import Path

from minipd import tokenizer
from minipd.launch import generate, start, stop
from tests.reliability.tools import DaemonProcess, wait_for

SENTINEL = "ZqSentinel7Xv3Kp"  # one minipd token (at most 24 bytes)
PREFILL_POOL, DECODE_POOL, CONTEXT = 4096, 16384, 8192
PROMPTS = 12


def needles() -> dict[str, bytes]:
    rows = tokenizer.encode(SENTINEL)
    assert len(rows) == 1
    raw = tokenizer.to_bytes(rows)
    token = tokenizer.token_id(rows[0])
    return {
        "sentinel": SENTINEL.encode(),
        "token_id": str(token).encode(),
        "token_id_hex": f"{token:x}".encode(),
        "token_bytes": raw,
        "token_b64": base64.b64encode(raw).rstrip(b"="),
    }


def scan(where: str, data: bytes, found: list[str]) -> None:
    low = data.lower()
    for name, needle in needles().items():
        if needle.lower() in low:
            found.append(f"{name} in {where}")


def mismatches(text: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvwatch_mismatches_total{")
    )


def test_prompt_sentinel_never_leaves_the_engine(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    daemon = DaemonProcess(
        tmp_path, "--no-nvml", "--idle-grace", "0.3s",
        "--log", f"prefill:sglang:{logs / 'prefill.log'}",
        "--log", f"decode:sglang:{logs / 'decode.log'}",
    )  # fmt: skip
    args = [
        "--release", "0.5.19", "--kvwatch", "log", "--kvwatch-spool", str(spool),
        "--log-dir", str(logs), "--prefill-pool-tokens", str(PREFILL_POOL),
        "--decode-pool-tokens", str(DECODE_POOL), "--context-length", str(CONTEXT),
        "--page-size", "16",
    ]  # fmt: skip
    found: list[str] = []
    proc, url = start(args, tmp_path)
    try:
        daemon.wait_started()
        for i in range(PROMPTS):
            words = 6000 if i == 0 else 20 + i  # the first one in the unsafe band
            text = f"{SENTINEL} " + "word " * words + f"{SENTINEL} repeat {SENTINEL}."
            status, _ = generate(url, text, 8)
            assert status in (200, 400), status
        assert wait_for(lambda: mismatches(daemon.scrape()) > 0, 60), daemon.output()[-2000:]
        # The segments of a live engine stay in the spool (locked): scan them as written.
        segments = [p for p in spool.rglob("*") if p.is_file()]
        assert segments
        for segment in segments:
            scan(f"spool {segment.name}", segment.read_bytes(), found)
        scan("/metrics", daemon.scrape().encode(), found)
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon.port}/", timeout=10) as reply:
            page = reply.read()
        assert b"<html" in page.lower()
        scan("status page", page, found)
    finally:
        stop(proc)
        daemon.stop()
    for path in [*tmp_path.glob("journal.db*"), *tmp_path.glob("incidents.jsonl*")]:
        scan(path.name, path.read_bytes(), found)
    assert (tmp_path / "incidents.jsonl").stat().st_size > 0  # the daemon's incidents log
    scan("daemon log", daemon.log_path.read_bytes(), found)
    assert found == []
    # The scan itself works: it finds the token in a token stream that carries it.
    control: list[str] = []
    scan("control", tokenizer.to_bytes(tokenizer.encode(f"a {SENTINEL} b")), control)
    assert "token_bytes in control" in control
