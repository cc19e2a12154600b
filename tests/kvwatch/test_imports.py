from __future__ import annotations

import pkgutil
import subprocess
import sys

import kvwatch


def _modules() -> list[str]:
    """Every module of the kvwatch package, found by walking it (none listed by hand)."""
    return sorted(info.name for info in pkgutil.walk_packages(kvwatch.__path__, prefix="kvwatch."))


def test_the_walk_finds_every_layer() -> None:
    found = set(_modules())
    for layer in ("ingest", "store", "expose", "alerting", "commands"):
        assert f"kvwatch.{layer}" in found
    assert {"kvwatch.cli", "kvwatch.daemon", "kvwatch.store.incident"} <= found


def test_the_daemon_never_imports_torch_or_the_hooks() -> None:
    code = (
        f"import sys\nfor m in {_modules()!r}: __import__(m)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'engine_hooks', 'numpy')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
