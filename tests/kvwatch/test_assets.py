"""The files the wheel carries: one list in pyproject.toml, the same in kvwatch.assets."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from kvwatch import assets
from tests.kvwatch.daemonproc import REPO


def test_pyproject_maps_exactly_the_assets() -> None:
    build = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["hatch"]["build"]
    mapped = build["targets"]["wheel"]["force-include"]
    expected = {
        source: f"kvwatch/assets/{kind}/{name}"
        for kind, files in assets.KINDS.items()
        for name, source in files.items()
    }
    assert mapped == expected
    assert all((REPO / source).is_file() for source in mapped)


def test_version_has_one_source() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["hatch"]["version"]["path"] == "kvwatch/__init__.py"


def test_export_in_a_checkout_and_no_clobber(tmp_path: Path) -> None:
    written = assets.export("grafana-alerts", tmp_path)
    assert [p.name for p in written] == ["kvwatch-alert-rules.json"]
    with pytest.raises(assets.AssetError, match="exists; pass --force"):
        assets.export("grafana-alerts", tmp_path)
    assets.export("grafana-alerts", tmp_path, force=True)
