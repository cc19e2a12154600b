"""Shared by the install tests: the built wheel and clean venvs made from it, once a session."""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwatch import __version__
from tests.dashboards.test_dashboards_push import FakeGrafana, _handler

REPO = Path(__file__).resolve().parents[2]
#: What the Makefile's dist target runs (test_readme checks that it still does).
BUILD = ["-m", "build", "--outdir"]


def run(
    argv: list[str], cwd: Path, timeout: float = 600, check: bool = True
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["NO_PROXY"] = "127.0.0.1,localhost"
    result = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and result.returncode != 0:
        pytest.fail(f"{argv} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What ``make dist`` builds: a wheel and an sdist, from this checkout."""
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, *BUILD, str(out), str(REPO)], cwd=out)
    return out


def wheel(dist: Path) -> Path:
    (found,) = dist.glob(f"kvwatch-{__version__}-*.whl")
    return found


def venv(root: Path, *packages: str) -> Path:
    run([sys.executable, "-m", "venv", str(root)], cwd=root.parent)
    pip = [str(root / "bin" / "python"), "-m", "pip", "install", "-q"]
    for group in packages:
        run([*pip, *group.split()], cwd=root.parent)
    return root / "bin"


@pytest.fixture(scope="session")
def shared() -> Iterator[Path]:
    """A folder every user may read, for the venvs: the two-user tests run the daemon and the
    engines as users who cannot enter pytest's own temporary folder (mode 0700)."""
    path = Path(tempfile.mkdtemp(prefix="kvwatch-install-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def plain(dist: Path, shared: Path) -> Path:
    """A venv with only the wheel and its dependencies: no torch."""
    return venv(shared / "plain", str(wheel(dist)))


@pytest.fixture
def empty(tmp_path: Path) -> Path:
    folder = tmp_path / "empty"
    folder.mkdir()
    return folder


@pytest.fixture(scope="session")
def engine(dist: Path, shared: Path) -> Path:
    """The engine's side: torch first and pinned (the CPU build on this machine's disk, as the
    Makefile installs it), then the wheel with its ``engine`` extra."""
    return venv(shared / "engine", "torch==2.13.0", f"{wheel(dist)}[engine]")


@pytest.fixture
def grafana() -> Iterator[FakeGrafana]:
    state = FakeGrafana()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
