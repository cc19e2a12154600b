"""The real daemon, end to end: a real producer, real HTTP, the real CLI, SIGTERM."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.ingest.nvml import Nvml
from tests.kvwatch.daemonproc import DaemonProcess, run_cli
from tests.kvwatch.writer import spool_module

SGLANG_LINE = (
    "[2026-09-01 12:00:00 TP0] max_total_num_tokens=681280, chunked_prefill_size=8192,"
    " max_prefill_tokens=16384, max_running_requests=48, context_len=1048576,"
    " available_gpu_mem=12.34 GB\n"
)


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def wait_for(daemon: DaemonProcess, name: str, value: float, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = daemon.scrape()
        if samples(text, name).get((), None) == value or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def kvwatch(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args)


@pytest.fixture
def daemon(tmp_path: Path) -> DaemonProcess:
    (tmp_path / "spool").mkdir()
    log = tmp_path / "prefill.log"
    log.write_text("\x1b[32mINFO\x1b[0m server starting\n")
    proc = DaemonProcess(tmp_path, "--log", f"prefill:sglang:{log}")
    proc.wait_started()
    return proc


def test_daemon_end_to_end(daemon: DaemonProcess, tmp_path: Path) -> None:
    writer = spool_module().SpoolWriter(
        daemon.spool, engine="sglang", role="decode", model="glm-5.3", engine_version="0.5.19"
    )
    writer.write(
        "gauges",
        {
            "gauges": [
                ["kv_pool_tokens", {}, 681280],
                ["context_length_tokens", {}, 1048576],
                ["page_size_tokens", {}, 64],
            ]
        },
    )
    for i, (detector, kind) in enumerate(
        [("canary", "unwritten_page"), ("checksum", "digest"), ("canary", "unwritten_page")]
    ):
        writer.write(
            "event",
            {
                "detector": detector,
                "kind": kind,
                "mode": "log",
                "action": "logged",
                "request_id": f"req-{i}",
                "pages": [10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
                "pages_total": 300,
                "detail": {},
            },
        )
    writer.write("counters", {"counters": [["verifications", {"detector": "canary"}, 3]]})
    with (tmp_path / "prefill.log").open("a") as handle:
        handle.write(SGLANG_LINE)

    text = wait_for(daemon, "kvwatch_spool_records_total", 6.0)
    assert samples(text, "kvwatch_spool_records_total") == {(): 6.0}
    assert samples(text, "kvwatch_producers") == {(): 1.0}
    incidents = samples(text, "kvwatch_findings_total")
    decode_canary = (("detector", "canary"), ("kind", "unwritten_page"), ("role", "decode"))
    assert incidents[decode_canary] == 2.0
    band = samples(text, "kvwatch_unsafe_band_tokens")
    assert (
        band[
            (
                ("engine", "sglang"),
                ("model", "glm-5.3"),
                ("rank", "0"),
                ("role", "decode"),
                ("source", "hooks"),
            )
        ]
        == 367296.0
    )
    log_band = [v for k, v in band.items() if ("source", "log") in k]
    assert log_band == [367296.0]
    info = samples(text, "kvwatch_engine_info")
    assert any(("version", "0.5.19") in k for k in info)
    assert samples(text, "kvwatch_nvml_up") == {(): 1.0 if Nvml(True).up else 0.0}
    success = samples(text, "kvwatch_collector_success")
    assert success[(("collector", "spool"),)] == 1.0
    assert success[(("collector", "logs"),)] == 1.0
    assert samples(text, "process_resident_memory_bytes")

    # kvwatch incidents, while the daemon runs (WAL: readers never block the writer).
    table = kvwatch("incidents", "--journal", str(daemon.journal))
    assert table.returncode == 0, table.stderr
    assert "req-0" in table.stdout and "req-2" in table.stdout
    assert "(300 pages)" in table.stdout
    assert "3 incident(s)" in table.stdout
    as_json = kvwatch(
        "incidents",
        "--journal",
        str(daemon.journal),
        "--json",
        "--detector",
        "checksum",
        "--since",
        "1h",
    )
    rows = json.loads(as_json.stdout)  # incidents, each with its (matching) findings
    assert [(r["request_id"], r["findings"][0]["kind"], r["role"]) for r in rows] == [
        ("req-1", "digest", "decode")
    ]
    assert rows[0]["findings"][0]["pages"][:2] == [10, 11] and rows[0]["pages_total"] == 300
    none = kvwatch("incidents", "--journal", str(daemon.journal), "--since", "0s")
    assert "0 incident(s)" in none.stdout

    writer.close()
    assert daemon.stop() == 0
    events = [e["event"] for e in daemon.events()]
    assert events[-1] == "daemon.stopped"
    assert "daemon.stopping" in events
    # Logs are JSON, one object a line, and carry no request ids but in the one line per
    # incident (its id, request and node: what on-call greps for), once per incident.
    opened = []
    for line in daemon.output().splitlines():
        entry = json.loads(line)
        assert entry["level"]
        if entry["event"] == "spool.incident":
            opened.append(entry["request_id"])
        else:
            assert "req-" not in line
    assert sorted(opened) == ["req-0", "req-1", "req-2"]  # the table's 3 incidents


def test_bad_config_is_a_clear_error(tmp_path: Path) -> None:
    config = tmp_path / "kvwatch.toml"
    config.write_text('listen = "nowhere"\n')
    result = kvwatch("daemon", "--config", str(config))
    assert result.returncode == 2
    assert "listen: expected HOST:PORT or :PORT" in result.stderr


def test_incidents_without_a_journal_is_a_clear_error(tmp_path: Path) -> None:
    result = kvwatch("incidents", "--journal", str(tmp_path / "none.db"))
    assert result.returncode == 1  # a runtime fault, not a usage error
    assert "no journal" in result.stderr


def test_journal_path_that_is_a_directory_is_a_clear_error(tmp_path: Path) -> None:
    result = kvwatch("daemon", "--journal", str(tmp_path), "--spool-dir", str(tmp_path / "s"))
    assert result.returncode == 1
    assert result.stderr.startswith(f"kvwatch daemon: journal {tmp_path} is a directory")


def test_port_in_use_is_a_clear_error(daemon: DaemonProcess, tmp_path: Path) -> None:
    second = kvwatch(
        "daemon",
        "--journal",
        str(tmp_path / "other.db"),
        "--spool-dir",
        str(tmp_path / "other-spool"),
        "--listen",
        f"127.0.0.1:{daemon.port}",
        "--no-nvml",
    )
    assert second.returncode == 1
    assert "daemon.listen_failed" in second.stdout + second.stderr
    assert daemon.stop() == 0
