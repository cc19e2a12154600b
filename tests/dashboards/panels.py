"""Every panel query and variable query of the committed dashboards, asked of a real Prometheus
as Grafana would ask it (a range query for a time series, an instant one for a table), with the
dashboard variables replaced by concrete values. Shared by the dashboards' live test and the
fleet test bed."""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((REPO / "dashboards").glob("kvwatch-*.json"))

#: Panels that cannot return data on a machine without NVIDIA GPUs (NVML absent): the daemon
#: serves no kvwatch_gpu_memory_bytes series there. Listed, not skipped silently.
NEEDS_A_GPU = {("kvwatch-node", "GPU memory")}


@dataclass(frozen=True)
class PanelQuery:
    board: str  # the file's stem, e.g. kvwatch-overview
    panel: str
    expr: str
    instant: bool


def panel_queries() -> list[PanelQuery]:
    found = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text(encoding="utf-8"))
        panels = [p for top in board["panels"] for p in (top, *top.get("panels", []))]
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    instant = bool(target.get("instant")) and not target.get("range")
                    found.append(PanelQuery(path.stem, panel["title"], target["expr"], instant))
    return found


def variable_queries() -> list[tuple[str, str, str]]:
    """(board, variable name, query) of every query variable."""
    found = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text(encoding="utf-8"))
        for variable in board["templating"]["list"]:
            if variable["type"] == "query":
                query = variable["query"]
                text = query if isinstance(query, str) else query.get("query", "")
                found.append((path.stem, variable["name"], text))
    return found


def concrete(expr: str, variables: dict[str, str]) -> str:
    """``expr`` with Grafana's variables replaced; every ``$`` must be one of them."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace(name, variables[name])
    if "$" in expr:
        raise ValueError(f"a variable is left in {expr!r}")
    return expr


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return json.load(reply)


def ask(prometheus: str, expr: str, *, instant: bool, start: float, end: float) -> list[Any]:
    """The series ``expr`` returns: at ``end`` (instant), or over [start, end] every second."""
    if instant:
        params = {"query": expr, "time": f"{end:.3f}"}
        url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode(params)}"
    else:
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": "1"}
        url = f"{prometheus}/api/v1/query_range?{urllib.parse.urlencode(params)}"
    reply = _get(url)
    if reply.get("status") != "success":
        raise RuntimeError(f"{expr}: {reply}")
    result: list[Any] = reply["data"]["result"]
    return result


_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


def label_values(prometheus: str, query: str, variables: dict[str, str]) -> list[str]:
    """What Grafana's ``label_values(selector, label)`` lists, from Prometheus's label API."""
    match = _LABEL_VALUES.match(query.strip())
    if match is None:
        raise ValueError(f"not a label_values() query: {query!r}")
    selector = concrete(match.group("selector"), variables)
    params = urllib.parse.urlencode({"match[]": selector})
    reply = _get(f"{prometheus}/api/v1/label/{match.group('label')}/values?{params}")
    values: list[str] = reply["data"]
    return values
