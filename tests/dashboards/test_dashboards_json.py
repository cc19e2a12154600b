"""The dashboards: the committed JSON is what the Python code generates, and it is sound Grafana."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

from alerts import definitions
from dashboards import generate
from kvspool import catalogue
from tests.alerts.tooling import tool

REPO = Path(__file__).resolve().parents[2]

#: The public metrics (kvspool's catalogue: every family on /metrics), the recording rules of
#: alerts/kvwatch.rules.yml and Prometheus's ``up``: the dashboards and alerts may use these and
#: nothing else.
PUBLIC_METRICS = (
    set(catalogue.EXPOSED.values()) | {"up"} | {r.record for r in definitions.RECORDING_RULES}
)

PROMQL_WORDS = {
    "sum", "max", "min", "count", "group", "by", "on", "or", "and", "unless", "bool",
    "group_left", "rate", "increase", "time", "vector", "ignoring", "without", "topk", "sort",
    "scalar", "label_replace",
}  # fmt: skip


def _committed() -> dict[str, dict[str, Any]]:
    out = {}
    for rel in generate.render():
        out[rel.name] = json.loads((REPO / rel).read_text(encoding="utf-8"))
    return out


def _panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    panels: list[dict[str, Any]] = []
    for panel in board["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def _exprs(board: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in _panels(board) for t in p.get("targets", [])]


def test_committed_json_matches_the_code(tmp_path: Path) -> None:
    assert generate.main(["--root", str(tmp_path)]) == 0
    for rel in generate.render():
        fresh = (tmp_path / rel).read_text(encoding="utf-8")
        committed = (REPO / rel).read_text(encoding="utf-8")
        assert committed == fresh, f"{rel} is stale: run `python -m dashboards.generate`"
    assert generate.main(["--check"]) == 0


def test_stable_uids_and_variables() -> None:
    boards = _committed()
    assert {b["uid"] for b in boards.values()} == {"kvwatch-overview", "kvwatch-node"}
    for name, board in boards.items():
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource", name
        assert variables["datasource"]["query"] == "prometheus", name
        for var in ("node", "role"):
            assert variables[var]["type"] == "query", (name, var)
            assert variables[var]["datasource"]["uid"] == "${datasource}", (name, var)


def test_panels_are_current_types_on_the_datasource_variable() -> None:
    for name, board in _committed().items():
        panels = _panels(board)
        ids = [p["id"] for p in panels]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        types = {p["type"] for p in panels}
        assert types <= {"row", "timeseries", "stat", "table"}, types
        assert {"timeseries", "stat", "table"} <= types, name
        cells: set[tuple[int, int]] = set()
        for panel in panels:
            pos = panel["gridPos"]
            assert pos["x"] + pos["w"] <= 24, (name, panel["title"])
            mine = {
                (x, y)
                for x in range(pos["x"], pos["x"] + pos["w"])
                for y in range(pos["y"], pos["y"] + pos["h"])
            }
            assert not cells & mine, f"{name}: {panel['title']!r} overlaps another panel"
            cells |= mine
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], (name, panel["title"])
            assert panel.get("description"), (name, panel["title"])
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}"


def test_queries_use_grafana_intervals_and_the_variables() -> None:
    for name, board in _committed().items():
        for expr in _exprs(board):
            for window in re.findall(r"\[([^\]]+)\]", expr):
                assert window in ("$__rate_interval", "$__range"), (name, expr)
            assert "$node" in expr, f"{name}: query ignores the node variable: {expr}"
        assert any("$__rate_interval" in e for e in _exprs(board)), name


def test_queries_use_only_public_metrics() -> None:
    used: set[str] = set()
    exprs = [e for b in _committed().values() for e in _exprs(b)]
    exprs += [a.expr for a in definitions.ALERTS] + [r.expr for r in definitions.RECORDING_RULES]
    for expr in exprs:
        text = re.sub(r'"[^"]*"|`[^`]*`|\{[^}]*\}|\[[^\]]*\]|\([a-z_, ]*\)', " ", expr)
        for token in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
            if token not in PROMQL_WORDS:
                used.add(token)
    assert used <= PUBLIC_METRICS, f"not public metrics: {sorted(used - PUBLIC_METRICS)}"


def test_required_content() -> None:
    boards = _committed()
    overview = "\n".join(_exprs(boards["kvwatch-overview.json"]))
    for metric in (
        "kvwatch_mismatches_total",
        "kvwatch_verifications_total",
        "kvwatch_verifications_skipped_total",
        "kvwatch_kv_pool_tokens",
        "kvwatch_context_length_tokens",
        "kvwatch_unsafe_band_tokens",
        "kvwatch_engine_info",
        "kvwatch_hook_seconds_total",
        "kvwatch_spool_lost_records_total",
        "kvwatch_spool_lag_bytes",
    ):
        assert metric in overview, metric
    assert "sum by (node, role, detector, kind)" in overview
    # At fleet scale: which nodes leak, run a vulnerable release, have a band, verify little.
    titles = {p["title"] for p in _panels(boards["kvwatch-overview.json"])}
    assert {
        "Nodes with mismatches (top 10)",
        "Nodes running a vulnerable release",
        "Unsafe band per model across nodes",
        "Verification coverage per node",
    } <= titles
    assert "topk(10, sum by (node)" in overview
    node = "\n".join(_exprs(boards["kvwatch-node.json"]))
    assert "kvwatch_gpu_memory_bytes" in node and 'node="$node"' in node


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each panel query (variables replaced by sample values) as a rule."""
    promtool = tool("promtool")  # fails (never skips) when promtool is missing
    rules = []
    for name, board in _committed().items():
        for i, expr in enumerate(_exprs(board)):
            concrete = (
                expr.replace("$__rate_interval", "1m")
                .replace("$__range", "1h")
                # Grafana expands a multi-value variable into a regex; a single one stays a string.
                .replace("$node", "n1")
                .replace("$role", "decode")
            )
            assert "$" not in concrete, concrete
            record = f"dashboard:{name.split('.')[0].replace('-', '_')}:q{i}"
            rules.append({"record": record, "expr": concrete})
    path = tmp_path / "panels.rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "panels", "rules": rules}]}))
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
