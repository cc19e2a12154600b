"""Shared helpers for the alert tests: the repository root and the real Prometheus tools.

The tools come from Debian's ``prometheus`` and ``prometheus-alertmanager`` packages (the Makefile
installs them). A missing tool fails the test loudly; it is never a skip.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "alerts"


def tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if path is None:
        pytest.fail(
            f"{name} is not installed: install Debian's "
            f"{'prometheus' if name == 'promtool' else 'prometheus-alertmanager'} package "
            "(the Makefile does); these tests never skip",
            pytrace=False,
        )
    return path


def run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
