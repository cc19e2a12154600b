"""The files an operator installs besides the code: dashboards, alert rules, deploy examples.

The wheel carries them under ``kvwatch/assets/`` (pyproject.toml maps them there); a checkout
keeps the one copy at the repository's top level, where the generators write them.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

_PACKAGED: Final = Path(__file__).resolve().parent / "assets"
_CHECKOUT: Final = Path(__file__).resolve().parent.parent

#: kind -> {file name in the wheel's kind folder: path in a checkout}
KINDS: Final[dict[str, dict[str, str]]] = {
    "dashboards": {
        "kvwatch-overview.json": "dashboards/kvwatch-overview.json",
        "kvwatch-node.json": "dashboards/kvwatch-node.json",
    },
    "rules": {
        "kvwatch.rules.yml": "alerts/kvwatch.rules.yml",
        "prometheus.example.yml": "alerts/prometheus.example.yml",
        "alertmanager.example.yml": "alerts/alertmanager.example.yml",
        "runbook.md": "alerts/runbook.md",
    },
    "grafana-alerts": {
        "kvwatch-alert-rules.json": "alerts/grafana/kvwatch-alert-rules.json",
    },
    "deploy": {
        "kvwatch.service": "deploy/kvwatch.service",
        "kvwatch.toml": "deploy/kvwatch.toml",
        "kubernetes.yaml": "deploy/kubernetes.yaml",
        "promtail-incidents.yml": "deploy/promtail-incidents.yml",
    },
    "fleet": {
        "README.md": "deploy/README.md",
        "prometheus-ha.yml": "deploy/prometheus-ha.yml",
        "prometheus.default": "deploy/prometheus.default",
        "prometheus-alertmanager.default": "deploy/prometheus-alertmanager.default",
        "victoria-metrics.default": "deploy/victoria-metrics.default",
        "kvwatch-fleet.toml": "deploy/kvwatch-fleet.toml",
        "targets/alertmanagers.json": "deploy/targets/alertmanagers.json",
        "targets/kvwatch-example.json": "deploy/targets/kvwatch-example.json",
    },
}

DESCRIPTIONS: Final = {
    "dashboards": "the Grafana dashboards' JSON (overview and node)",
    "rules": "Prometheus alert and recording rules, a scrape config and Alertmanager routing",
    "grafana-alerts": "the alert rules as Grafana alerting provisioning (JSON)",
    "deploy": "the systemd unit, the daemon's TOML config, the Kubernetes DaemonSet and a"
    " Promtail config that ships the incidents log to Loki",
    "fleet": "a Prometheus HA pair (with its target files), an Alertmanager cluster's and"
    " VictoriaMetrics' flags, the daemon's fast-path config, and how they fit together",
}


class AssetError(Exception):
    pass


def path(kind: str, name: str) -> Path:
    """Where one file is: in the installed package, else in the checkout."""
    packaged = _PACKAGED / kind / name
    if packaged.is_file():
        return packaged
    checkout = _CHECKOUT / KINDS[kind][name]
    if checkout.is_file():
        return checkout
    raise AssetError(f"{kind}/{name} is missing from this installation ({packaged})")


def directory(kind: str) -> Path:
    """The folder holding every file of ``kind`` (the dashboards push reads a folder)."""
    return path(kind, next(iter(KINDS[kind]))).parent


def export(kind: str, destination: Path, *, force: bool = False) -> list[Path]:
    """Copy every file of ``kind`` into ``destination`` (created); returns the files written."""
    sources = [path(kind, name) for name in KINDS[kind]]
    targets = [destination / name for name in KINDS[kind]]
    clobbered = [str(t) for t in targets if t.exists()]
    if clobbered and not force:
        raise AssetError(f"{clobbered[0]} exists; pass --force to overwrite")
    for source, target in zip(sources, targets, strict=True):
        target.parent.mkdir(parents=True, exist_ok=True)  # a kind may keep files in folders
        shutil.copyfile(source, target)
    return targets


def write_or_check(root: Path, files: Mapping[Any, str], *, check: bool) -> list[str]:
    """Write the generated ``files`` (path under ``root`` -> text), or with ``check`` write
    nothing and return the paths whose file differs (or is missing): the generators' mains."""
    stale = []
    for rel, text in files.items():
        path = root / rel
        if check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(str(rel))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    return stale


def generator_main(
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str | None,
    render: Callable[[], Mapping[Any, str]],
    root: Path,
    stale: str,
) -> int:
    """A generator's command line: write what ``render`` returns under ``--root``, or with
    ``--check`` exit 1 naming the ``stale`` files that differ from it."""
    parser = argparse.ArgumentParser(allow_abbrev=False, prog=prog, description=description)
    parser.add_argument("--root", type=Path, default=root, help="repository root to write under")
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    differing = write_or_check(args.root, render(), check=args.check)
    if differing:
        print(f"{stale}: " + ", ".join(differing) + f"; run `{prog}`", file=sys.stderr)
        return 1
    return 0
