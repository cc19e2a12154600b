"""The files the wheel carries: one list, kvwatch.assets.KINDS, that setup.py copies into it."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from kvwatch import assets
from tests.kvwatch.daemonproc import REPO


def test_every_asset_exists_and_the_sdist_carries_it() -> None:
    sources = [source for files in assets.KINDS.values() for source in files.values()]
    assert all((REPO / source).is_file() for source in sources)
    manifest = (REPO / "MANIFEST.in").read_text()
    patterns = [word for line in manifest.splitlines() if line.startswith("include ")
                for word in line.split()[1:]]  # fmt: skip
    for source in sources:
        assert any(Path(source).match(pattern) for pattern in patterns), source


def test_version_has_one_source() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "kvwatch.__version__"}


def test_export_in_a_checkout_and_no_clobber(tmp_path: Path) -> None:
    written = assets.export("grafana-alerts", tmp_path)
    assert [p.name for p in written] == ["kvwatch-alert-rules.json"]
    with pytest.raises(assets.AssetError, match="exists; pass --force"):
        assets.export("grafana-alerts", tmp_path)
    assets.export("grafana-alerts", tmp_path, force=True)
