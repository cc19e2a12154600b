"""Generate the committed dashboard JSON from the Python definitions.

    python -m dashboards.generate            # rewrite dashboards/*.json
    python -m dashboards.generate --check    # exit 1 if a committed file differs from its source

Grafana imports the files as they are (Dashboards > New > Import) or provisions them from a
directory; ``kvwatch dashboards push`` uploads them through the HTTP API.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from dashboards import node, overview
from kvwatch.assets import generator_main

REPO = Path(__file__).resolve().parent.parent
DASHBOARDS: dict[str, Callable[[], dash.Dashboard]] = {
    "kvwatch-overview.json": overview.build,
    "kvwatch-node.json": node.build,
}


def to_dict(board: dash.Dashboard) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return data


def render() -> dict[Path, str]:
    """Every generated file's path (relative to the repository root) and content."""
    return {
        Path("dashboards") / name: json.dumps(to_dict(build()), indent=2, sort_keys=True) + "\n"
        for name, build in DASHBOARDS.items()
    }


def main(argv: Sequence[str] | None = None) -> int:
    return generator_main(
        argv,
        prog="python -m dashboards.generate",
        description=__doc__,
        render=render,
        root=REPO,
        stale="stale dashboard JSON",
    )


if __name__ == "__main__":
    sys.exit(main())
