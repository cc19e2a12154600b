"""End to end with minipd: records its hooks write show up in /metrics and `kvwatch incidents`.

minipd runs as SGLang 0.5.19 in PD mode (admits a rejected request into the handoff) with the
hooks in log mode; one prompt in the unsafe band makes decode read pages prefill never wrote.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from minipd.launch import generate, start, stop
from tests.kvwatch.daemonproc import REPO, DaemonProcess
from tests.kvwatch.test_daemon import samples

PREFILL_POOL, DECODE_POOL, CONTEXT = 4096, 16384, 8192


def test_minipd_hooks_reach_metrics_and_incidents(tmp_path: Path) -> None:
    spool, logs = tmp_path / "spool", tmp_path / "logs"
    spool.mkdir()
    logs.mkdir()
    daemon = DaemonProcess(
        tmp_path,
        "--no-nvml",
        "--log",
        f"prefill:sglang:{logs / 'prefill.log'}",
        "--log",
        f"decode:sglang:{logs / 'decode.log'}",
    )
    args = [
        "--release", "0.5.19", "--kvwatch", "log", "--kvwatch-spool", str(spool),
        "--log-dir", str(logs), "--prefill-pool-tokens", str(PREFILL_POOL),
        "--decode-pool-tokens", str(DECODE_POOL), "--context-length", str(CONTEXT),
        "--page-size", "16",
    ]  # fmt: skip
    proc, url = start(args, tmp_path)
    try:
        daemon.wait_started()
        status, _ = generate(url, "word " * 6000 + "Repeat any codes you saw.", 8)
        assert status == 200  # the vulnerable release answers a prompt it should have rejected
        deadline = time.monotonic() + 60
        mismatches: dict[tuple[tuple[str, str], ...], float] = {}
        while time.monotonic() < deadline:
            text = daemon.scrape()
            mismatches = {
                k: v for k, v in samples(text, "kvwatch_mismatches_total").items() if v > 0
            }
            incidents = samples(text, "kvwatch_findings_total")
            # prefill's findings can land a scrape before decode's: wait for the reader's
            decode = any(("role", "decode") in k for k in mismatches)
            if decode and any(v > 0 for v in incidents.values()):
                break
            time.sleep(0.2)
        assert mismatches, "no mismatch reached /metrics"
        assert any(("role", "decode") in k for k in mismatches)
        bands = samples(text, "kvwatch_unsafe_band_tokens")
        assert any(v == CONTEXT - PREFILL_POOL for v in bands.values()), bands
        command = [sys.executable, "-m", "kvwatch.cli", "incidents", "--json"]
        listed = subprocess.run(
            [*command, "--journal", str(daemon.journal)],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
        rows = json.loads(listed.stdout)
        assert rows and all(r["engine"] == "minipd" for r in rows)
        assert "decode" in {r["role"] for r in rows}
        assert any({"canary", "page_tag", "checksum"} & set(r["detectors"]) for r in rows)
    finally:
        stop(proc)
        daemon.stop()
