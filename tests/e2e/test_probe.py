"""``kvwatch probe`` against minipd: what it reports for each release, and its adaptive sizing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.e2e.server import MiniPD

POOL, DECODE_POOL, CONTEXT = 4096, 16384, 8192
# The transfer timeout outlasts an in-pool prompt's prefill on a slow machine: at 0.5 s the
# probe's 3,072-token timing prompts timed out there (HTTP 500), leaving no expected time.
ARGS = [
    "--pool-tokens", str(POOL), "--decode-pool-tokens", str(DECODE_POOL),
    "--context-length", str(CONTEXT), "--transfer-timeout", "5",
]  # fmt: skip
REPO = Path(__file__).resolve().parents[2]


def probe(url: str, *extra: str) -> tuple[int, dict[str, Any], str]:
    done = subprocess.run(
        [sys.executable, "-m", "kvwatch.cli", "probe", "--url", url, "--json",
         "--pool-tokens", str(POOL), "--context-length", str(CONTEXT),
         "--marker-repeats", "200", *extra],
        capture_output=True, text=True, timeout=300, cwd=REPO, check=False,
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, json.loads(done.stdout), done.stdout + done.stderr


def test_0_5_19_is_vulnerable_leaks_a_marker_and_answers_too_fast(tmp_path: Path) -> None:
    # A wider model, so that prefill costs what it costs in a real engine.
    with MiniPD(["--release", "0.5.19", "--ffn-width", "8192", *ARGS], tmp_path) as pd:
        reports = []
        # "too fast" is a timing judgement (the reply took 0.15-0.19 of the expected time
        # here, the line is at 0.5); on a shared 2-core CI machine one stalled reply can hide
        # it, so two more probes are allowed for that figure. Everything else holds every time.
        for _attempt in range(3):
            code, report, output = probe(pd.url)
            assert code == 3, output
            assert report["status"] == 200
            assert report["leaked_markers"]
            assert POOL < report["prompt_tokens"] <= CONTEXT
            assert "word word" not in output  # the filler is never printed
            reports.append(report)
            if report["too_fast"]:
                break
    assert reports[-1]["too_fast"] is True, reports


def test_0_5_20_and_0_5_22_refuse(tmp_path: Path) -> None:
    for release in ("0.5.20", "0.5.22"):
        (tmp_path / release).mkdir()
        with MiniPD(["--release", release, *ARGS], tmp_path / release) as pd:
            code, report, output = probe(pd.url)
        assert code == 0, output
        assert report["status"] == 400
        assert report["leaked_markers"] == []


def test_enforce_on_0_5_19_fails_the_status_check_and_leaks_nothing(tmp_path: Path) -> None:
    with MiniPD(["--release", "0.5.19", *ARGS], tmp_path, kvwatch="enforce") as pd:
        code, report, output = probe(pd.url)
    assert code == 1, output
    assert report["status"] >= 500
    assert report["leaked_markers"] == []
    assert report["verdict"].startswith("NOT REFUSED")


def test_adaptive_sizing_lands_in_the_band_with_a_different_tokenizer(tmp_path: Path) -> None:
    # Words of "word" become two tokens each ("wor", "d"): the filler must be half as long.
    args = ["--release", "0.5.20", "--tokenizer-piece-bytes", "3", *ARGS]
    with MiniPD(args, tmp_path) as pd:
        code, report, output = probe(pd.url, "--markers", "2")
        # 0.5.20 refuses with 400 and reports no prompt_tokens: size again on 0.5.19's answer.
    assert code == 0, output
    args = ["--release", "0.5.19", "--tokenizer-piece-bytes", "3", *ARGS]
    (tmp_path / "leaky").mkdir()
    with MiniPD(args, tmp_path / "leaky") as pd:
        code, report, output = probe(pd.url, "--markers", "2")
    assert POOL < report["prompt_tokens"] <= CONTEXT, output
    assert report["filler_words"] < (POOL + CONTEXT) // 2 * 0.6  # about half a word per token
    assert abs(report["landed_off_by_tokens"]) < 64
