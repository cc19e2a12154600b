"""kvwatch's command line as another user, wherever the checkout lives.

A test that runs the CLI as another uid (``setpriv``) cannot use the checkout's venv: under a
0700 folder (a clone under ``/root``) that user may not enter it, and ``python -m kvwatch.cli``
fails with ``No module named 'kvwatch'``. :func:`python` builds, once per test session, a venv in
a world-readable temporary folder holding this checkout's ``kvwatch`` and ``kvspool`` and the
installed distributions they depend on (copied from the running environment: no network, no
build), and removes it at exit.
"""

from __future__ import annotations

import atexit
import functools
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: What the CLI imports: the daemon's side of the wheel.
PACKAGES = ("kvwatch", "kvspool")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")


def _requirements(name: str) -> list[str]:
    """The distributions ``name`` needs, extras left out."""
    found = []
    for requirement in metadata.requires(name) or ():
        if "extra" in requirement.partition(";")[2]:
            continue  # an optional extra's
        match = _NAME.match(requirement)
        if match:
            found.append(match.group(0))
    return found


def _closure(name: str) -> dict[str, metadata.Distribution]:
    todo, seen = _requirements(name), dict[str, metadata.Distribution]()
    while todo:
        wanted = todo.pop()
        key = re.sub(r"[-_.]+", "-", wanted).lower()
        if key in seen:
            continue
        try:
            seen[key] = metadata.distribution(wanted)
        except metadata.PackageNotFoundError:
            continue  # a marker that does not apply here (another platform or Python)
        todo.extend(_requirements(wanted))
    return seen


@functools.cache
def python() -> Path:
    """A Python interpreter every user may run, with kvwatch importable."""
    root = Path(tempfile.mkdtemp(prefix="kvwatch-anyuser-"))
    atexit.register(shutil.rmtree, root, True)
    root.chmod(0o755)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    paths = sysconfig.get_paths(vars={"base": str(root / "venv"), "platbase": str(root / "venv")})
    site = Path(paths["purelib"])
    for package in PACKAGES:
        shutil.copytree(
            REPO / package, site / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    for dist in _closure("kvwatch").values():
        for file in dist.files or ():
            source = Path(str(dist.locate_file(file)))
            if not source.is_file() or "__pycache__" in file.parts or file.parts[0] == "..":
                continue
            target = site / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue  # bin/python: chmod would follow it to the system's interpreter
        path.chmod(path.stat().st_mode | (0o555 if path.is_dir() else 0o444))
    return root / "venv" / "bin" / "python"


def cli(
    *args: str, user: int = 65534, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``kvwatch ARGS`` as ``user`` (its group the same number, no supplementary groups)."""
    interpreter = python()
    return subprocess.run(
        ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups",
         str(interpreter), "-m", "kvwatch.cli", *args],
        cwd=interpreter.parents[2],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "NO_PROXY": "127.0.0.1,localhost", **(env or {})},
    )  # fmt: skip
