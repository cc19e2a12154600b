"""``bench/page_size.py``: page size 1 against 16 in one run, alternating rounds, as ratios."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from minipd.launch import child_env

ROOT = Path(__file__).resolve().parents[2]


def test_page_size_one_against_sixteen_prints_its_ratios() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "page_size.py"), "--rounds", "2", "--prompt", "256",
         "--requests", "2", "--batch", "4", "--context", "256", "--steps", "4"],
        capture_output=True, text=True, timeout=300, check=False, env=child_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 alternating rounds" in done.stdout
    for what in ("request's life", "one extend_each a step, batch 4", "a call per started page"):
        line = next(x for x in done.stdout.splitlines() if what in x and "ratio" in x)
        ratio = float(re.search(r"ratio page 1 / page 16 ([\d.]+)", line)[1])  # type: ignore[index]
        assert ratio > 1  # a page per token costs more than a page per 16 tokens
