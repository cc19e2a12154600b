"""``kvwatch export``: the dashboards, alert rules or deploy files installed with kvwatch."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvwatch import assets
from kvwatch.commands.clihelp import add_command, fail


def run(args: argparse.Namespace) -> int:
    try:
        written = assets.export(args.kind, Path(args.directory), force=args.force)
    except assets.AssetError as exc:
        return fail("export", str(exc))
    except OSError as exc:
        return fail("export", f"cannot write to {args.directory}: {exc.strerror or exc}")
    for path in written:
        print(path)
    return 0


def add_parser(commands: Any) -> argparse.ArgumentParser:
    export = add_command(
        commands,
        "export",
        help="write the dashboards, alert rules or deploy files installed with kvwatch",
        description="Copy files that ship in the kvwatch package into a folder:\n"
        + "\n".join(f"  {k:<15} {v}" for k, v in assets.DESCRIPTIONS.items()),
        examples=[
            "kvwatch export rules /etc/prometheus/rules/kvwatch",
            "kvwatch export dashboards ./grafana-dashboards",
            "kvwatch export deploy /tmp/kvwatch-deploy",
        ],
    )
    export.add_argument("kind", choices=sorted(assets.KINDS), help="what to write")
    export.add_argument("directory", metavar="DIR", help="the folder to write into (created)")
    export.add_argument("--force", action="store_true", help="overwrite files already there")

    return export
