"""``python -m minipd demo`` (what ``make demo`` runs): the leaked reply and the records."""

from __future__ import annotations

import subprocess
import sys

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
