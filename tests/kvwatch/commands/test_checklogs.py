from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvwatch.cli import main
from kvwatch.commands import check_logs as checklogs

PRESET_VULNERABLE = (
    "prefill: max_total_num_tokens=681280, context_len=1048576\n"
    "decode: max_total_num_tokens=681280, context_len=1048576\n"
)
PRESET_FIXED = (
    "prefill: max_total_num_tokens=2040000, context_len=1048576\n"
    "decode: max_total_num_tokens=2040000, context_len=1048576\n"
)


def test_incident_startup_lines_give_its_unsafe_band(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pasted = tmp_path / "glm.txt"
    pasted.write_text(PRESET_VULNERABLE)
    assert main(["check-logs", str(pasted)]) == 1
    out = capsys.readouterr().out
    assert "367,296" in out and "35.0%" in out
    assert "681,281..1,048,576" in out
    rows = checklogs.check_files([str(pasted)])
    assert [(r.role, r.band_tokens) for r in rows] == [("decode", 367296), ("prefill", 367296)]
    assert rows[0].band_share == pytest.approx(0.3503, abs=1e-4)


def test_incident_pool_raised_closes_the_band(tmp_path: Path) -> None:
    pasted = tmp_path / "glm-fixed.txt"
    pasted.write_text(PRESET_FIXED)
    assert main(["check-logs", str(pasted)]) == 0
    assert all(r.band_tokens == 0 for r in checklogs.check_files([str(pasted)]))


def test_mixed_roles_engines_and_json(tmp_path: Path) -> None:
    prefill = tmp_path / "node1-prefill.log"
    prefill.write_text(
        "[2026-09-01 12:00:00 TP0] max_total_num_tokens=681280, chunked_prefill_size=8192,"
        " context_len=1048576, available_gpu_mem=12.34 GB\n"
        "[2026-09-01 12:00:00 TP1] max_total_num_tokens=690000, context_len=1048576\n"
        "# restart with the fixed configuration\n"
        "[2026-09-01 13:00:00 TP0] max_total_num_tokens=2040000, context_len=1048576\n"
        "[2026-09-01 13:00:00 TP1] max_total_num_tokens=2050000, context_len=1048576\n"
    )
    decode = tmp_path / "node2-decode.log"
    decode.write_text(
        "INFO GPU KV cache size: 100,000 tokens\n"
        "INFO Maximum concurrency for 131,072 tokens per request: 0.76x\n"
    )
    empty = tmp_path / "node3.log"
    empty.write_text("nothing here\n")
    result = subprocess.run(
        [sys.executable, "-m", "kvwatch.cli", "check-logs", "--json", str(prefill), str(decode)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1
    payload = json.loads(result.stdout)
    assert payload["ok"] is False
    by_node = {Path(n["node"]).name: n for n in payload["nodes"]}
    assert by_node["node1-prefill.log"]["band_tokens"] == 0
    assert by_node["node1-prefill.log"]["ranks"] == 2
    assert by_node["node1-prefill.log"]["pool_tokens"] == 2040000
    assert by_node["node2-decode.log"]["role"] == "decode"
    assert by_node["node2-decode.log"]["band_tokens"] == 31072
    # A log with no start-up line cannot pass the gate.
    assert main(["check-logs", str(empty)]) == 2
    assert main(["check-logs", str(tmp_path / "missing.log")]) == 2


def test_smallest_band_for_the_probe(tmp_path: Path) -> None:
    pasted = tmp_path / "glm.txt"
    pasted.write_text(PRESET_VULNERABLE)
    assert checklogs.smallest_band_from_files([str(pasted)]) == (681280, 1048576)
