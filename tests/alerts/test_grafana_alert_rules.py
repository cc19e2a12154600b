"""The Grafana-managed alert rules hold the same alerts as the Prometheus rules.

Both are generated from ``alerts/definitions.py``. These tests prove the two sets agree field by
field, and then run the very promtool unit tests of ``alerts/tests/`` against alert rules rebuilt
from the committed Grafana file: the Grafana expressions (with the recording rules inlined) fire
for the same series, with the same labels and annotations.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from alerts import definitions, generate
from tests.alerts.tooling import ALERTS, REPO, run, tool

GRAFANA_FILE = REPO / generate.GRAFANA_RULES


def _grafana() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(GRAFANA_FILE.read_text(encoding="utf-8"))
    return data


def _prometheus_alerts() -> list[dict[str, Any]]:
    groups = generate.prometheus_rules()["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def _prometheus_records() -> dict[str, str]:
    groups = generate.prometheus_rules()["groups"]
    return {r["record"]: r["expr"] for g in groups for r in g["rules"] if "record" in r}


def _inline(expr: str, records: dict[str, str]) -> str:
    """An independent re-implementation of the inlining: a recording rule name -> (its expr)."""
    for _ in range(len(records) + 1):
        changed = False
        for name in sorted(records, key=len, reverse=True):
            pattern = re.compile(r"(?<![\w:])" + re.escape(name) + r"(?![\w:])")
            if pattern.search(expr):
                inlined = "(" + " ".join(records[name].split()) + ")"
                expr = pattern.sub(lambda _m: inlined, expr)  # noqa: B023 (used at once)
                changed = True
        if not changed:
            return expr
    raise AssertionError("recording rules do not resolve")


def test_file_is_grafana_provisioning_format() -> None:
    data = _grafana()
    assert data["apiVersion"] == 1
    [group] = data["groups"]
    assert {"orgId", "name", "folder", "interval", "rules"} <= set(group)
    uids = [r["uid"] for r in group["rules"]]
    assert len(uids) == len(set(uids))
    for rule in group["rules"]:
        assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", rule["uid"]), rule["uid"]
        refs = [q["refId"] for q in rule["data"]]
        assert rule["condition"] in refs
        query = rule["data"][0]
        assert query["datasourceUid"] == generate.GRAFANA_DATASOURCE_UID
        assert query["model"]["instant"] is True
        assert query["relativeTimeRange"]["from"] > 0
        for expr_query in rule["data"][1:3]:
            assert expr_query["datasourceUid"] == "__expr__"
        _check_context_queries(rule)
        condition = {q["refId"]: q for q in rule["data"]}[rule["condition"]]["model"]
        assert condition["type"] == "math" and condition["expression"] == "$B >= 0 || $B < 0"
        # Grafana interpolates environment variables in labels (and `${...}` in annotations).
        assert all("${" not in v for v in rule["annotations"].values())
        assert all("$" not in v for v in rule["labels"].values())
        assert rule["noDataState"] == "OK" and rule["execErrState"] == "Error"


def _check_context_queries(rule: dict[str, Any]) -> None:
    """A description's second number (definitions.Context): a Prometheus query summed by labels
    the alert's own expression keeps, reduced to its last value, named in the description."""
    [alert] = [a for a in definitions.ALERTS if a.name == rule["title"]]
    extra = rule["data"][3:]
    assert len(extra) == 2 * len(alert.context)
    for query, reduce, context in zip(extra[::2], extra[1::2], alert.context, strict=True):
        assert query["datasourceUid"] == generate.GRAFANA_DATASOURCE_UID
        assert query["model"]["instant"] is True
        by = re.search(r"sum by \(([^)]*)\)", query["model"]["expr"])
        assert by and set(by.group(1).split(", ")) == set(context.by)
        kept = re.search(r"sum by \(([^)]*)\)", rule["data"][0]["model"]["expr"])
        assert kept and set(context.by) <= set(kept.group(1).split(", ")), rule["title"]
        assert (
            reduce["model"]["type"] == "reduce"
            and reduce["model"]["expression"] == (query["refId"])
        )
        assert f"$values.{reduce['refId']}" in rule["annotations"]["description"]


def _to_prometheus_text(title: str, text: str) -> str:
    """A Grafana annotation as the Prometheus one: ``$value`` for the reduce step B, and each
    context query's block (checked above) as the Prometheus ``query`` block."""
    [alert] = [a for a in definitions.ALERTS if a.name == title]
    text = text.replace("$values.B.Value", "$value")
    for ref, context in generate._context_refs(alert):
        marker = "{{ " + context.name + " }}"
        grafana_block = generate.grafana_template(marker, alert)
        assert f"$values.{ref}" in grafana_block
        text = text.replace(grafana_block, generate.prometheus_template(marker, alert))
    return text


def test_same_alerts_as_prometheus() -> None:
    records = _prometheus_records()
    prometheus = _prometheus_alerts()
    grafana = _grafana()["groups"][0]["rules"]
    assert [r["alert"] for r in prometheus] == [r["title"] for r in grafana]
    for prom, graf in zip(prometheus, grafana, strict=True):
        name = prom["alert"]
        expr = graf["data"][0]["model"]["expr"]
        assert expr == _inline(prom["expr"], records), name
        assert not re.search(r"[a-z_]+:[a-z_0-9:]+", expr.replace("[5m]", "")), (
            f"{name}: Grafana expression still uses a recording rule"
        )
        assert graf["labels"] == prom["labels"], name
        assert graf["for"] == prom.get("for", "0s"), name
        annotations = {k: _to_prometheus_text(name, v) for k, v in graf["annotations"].items()}
        assert annotations == prom["annotations"], name


def _as_prometheus(grafana: dict[str, Any]) -> dict[str, Any]:
    """Alerting rules rebuilt from the Grafana rules, as Prometheus would evaluate them."""
    rules = []
    for rule in grafana["groups"][0]["rules"]:
        rebuilt: dict[str, Any] = {"alert": rule["title"], "expr": rule["data"][0]["model"]["expr"]}
        if rule["for"] != "0s":
            rebuilt["for"] = rule["for"]
        rebuilt["labels"] = rule["labels"]
        rebuilt["annotations"] = {
            k: _to_prometheus_text(rule["title"], v) for k, v in rule["annotations"].items()
        }
        rules.append(rebuilt)
    return {"groups": [{"name": "grafana", "rules": rules}]}


def test_grafana_expressions_pass_the_promtool_unit_tests(tmp_path: Path) -> None:
    # JSON is YAML: promtool reads the rebuilt rules from a .yml file next to copies of the tests.
    (tmp_path / "kvwatch.rules.yml").write_text(json.dumps(_as_prometheus(_grafana())))
    (tmp_path / "tests").mkdir()
    copied = []
    for path in sorted((ALERTS / "tests").glob("*.yml")):
        text = path.read_text(encoding="utf-8")
        if "alert_rule_test:" not in text:
            continue  # recording-rule tests: Grafana has no recording rules, it inlines them
        assert "promql_expr_test:" not in text, f"{path.name}: keep recording-rule tests apart"
        shutil.copy(path, tmp_path / "tests" / path.name)
        copied.append(str(tmp_path / "tests" / path.name))
    assert copied
    result = run(tool("promtool"), "test", "rules", *copied)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert output.count("SUCCESS") == len(copied), output
