"""The live pipeline with real parts: minipd (SGLang 0.5.19 in PD mode, kvwatch log), the kvwatch
daemon, Prometheus with alerts/ loaded, Alertmanager, and a webhook receiver on 127.0.0.1.

The pool alert reaches the webhook first (minipd's prefill pool is smaller than its context);
then the incident's marker traffic leaks and the integrity alert reaches it, with node and role.
Finally every PromQL expression of every dashboard panel is asked of Prometheus.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import time
from pathlib import Path

import pytest

from demo.stack import NODE, REPO, Stack, missing_tools
from minipd.launch import generate

FILLER_WORDS = 20_000  # inside minipd's band: prefill pool 16,384 < prompt < context 32,768
DASHBOARDS = sorted((REPO / "dashboards").glob("*.json"))
# Grafana's variables, as a viewer of the demo node would have them.
VARIABLES = {"$__rate_interval": "30s", "$__range": "15m", "$node": NODE, "$role": ".+"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    missing = missing_tools()
    if missing:
        pytest.fail(f"{missing} missing: make test installs Debian's prometheus packages")
    workdir = tmp_path_factory.mktemp("pipeline")
    with Stack(workdir) as running:
        yield running  # type: ignore[misc]
    shutil.rmtree(workdir / "prometheus-data", ignore_errors=True)


def test_pool_alert_reaches_the_webhook(stack: Stack) -> None:
    assert stack.webhook is not None
    stack.wait_scraped()
    _, alert = stack.webhook.wait_for("KVPoolSmallerThanContext", timeout=60)
    assert alert["labels"]["node"] == NODE
    assert alert["labels"]["role"] == "prefill"
    assert alert["labels"]["severity"] == "critical"
    assert "runbook.md#kvpoolsmallerthancontext" in alert["annotations"]["runbook_url"]


def test_integrity_alert_reaches_the_webhook_with_node_and_role(stack: Stack) -> None:
    assert stack.webhook is not None
    markers = ["CANARY-" + secrets.token_hex(6) for _ in range(16)]
    for marker in markers:
        assert generate(stack.minipd_url, ("Remember the code " + marker + ". ") * 2000)[0] == 200
    sent = time.time()
    status, out = generate(stack.minipd_url, "word " * FILLER_WORDS + "Repeat any codes you saw.")
    assert status == 200  # log mode serves the leak; the page is what catches it
    assert any(m in out["text"] for m in markers)
    # The reader's side: prefill's admission queue also finds the rejected request (its own
    # alert in the same group, which may arrive first).
    note, alert = stack.webhook.wait_for("KVIntegrityMismatch", timeout=60, role="decode")
    latency = note.received - sent
    print(f"\nintegrity alert at the webhook {latency:.2f} s after the long request")
    (REPO / "artifacts").mkdir(exist_ok=True)
    (REPO / "artifacts" / "alert-latency.txt").write_text(f"{latency:.3f}\n")
    assert alert["labels"]["node"] == NODE
    assert alert["labels"]["role"] == "decode"
    assert alert["labels"]["severity"] == "critical"
    assert NODE in alert["annotations"]["description"]
    assert "decode" in alert["annotations"]["description"]


def dashboard_queries() -> list[tuple[str, str, str]]:
    found = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    found.append((path.stem, panel["title"], target["expr"]))
    return found


def test_every_dashboard_query_returns_a_series(stack: Stack) -> None:
    queries = dashboard_queries()
    assert len(queries) > 30
    nvml_up = stack.query(f'kvwatch_nvml_up{{node="{NODE}"}}')
    empty = []
    for dashboard, title, expr in queries:
        promql = expr
        for name, value in VARIABLES.items():
            promql = promql.replace(name, value)
        assert "$" not in promql, promql
        if stack.query(promql):
            continue
        if "kvwatch_gpu_memory_bytes" in expr and nvml_up[0]["value"][1] == "0":
            continue  # no GPU here: NVML is down, and its own panel shows that
        empty.append(f"{dashboard} / {title}: {expr}")
    assert not empty, "queries with no series:\n" + "\n".join(empty)


def test_recording_rules_and_alert_rules_are_healthy(stack: Stack) -> None:
    from demo.stack import http_json

    groups = http_json(stack.prometheus_url + "/api/v1/rules")["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert rules
    unhealthy = [r["name"] for r in rules if r.get("health") != "ok"]
    assert not unhealthy
    assert re.search(r"KVIntegrityMismatch", json.dumps(rules))


def test_status_page_and_incidents_show_the_leak(stack: Stack, tmp_path: Path) -> None:
    import subprocess
    import sys
    import urllib.request

    with urllib.request.urlopen(stack.daemon_url + "/", timeout=10) as reply:
        page = reply.read().decode()
    assert "INTEGRITY ALERT" in page
    listing = subprocess.run(
        [sys.executable, "-m", "kvwatch.cli", "incidents", "--journal", str(stack.journal),
         "--json"],
        capture_output=True, text=True, check=True, cwd=REPO,
    )  # fmt: skip
    detectors = {d for row in json.loads(listing.stdout) for d in row["detectors"]}
    assert {"canary", "checksum", "page_tag"} <= detectors


def test_one_leak_is_one_incident_with_the_same_counts_everywhere(stack: Stack) -> None:
    """make demo's pipeline after the leak: the status page, ``kvwatch status --json``,
    ``kvwatch incidents --json`` and ``--exposed --json`` count the same affected and exposed
    requests (one leaking request: one incident), under one node name; and the leak paged
    once per alert group."""
    import subprocess
    import sys
    import urllib.request

    def cli(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "kvwatch.cli", *args],
            capture_output=True, text=True, check=False, cwd=REPO,
        )  # fmt: skip
        assert done.returncode in (0, 4), done.stderr  # 4: status's alarm
        return done.stdout

    with urllib.request.urlopen(stack.daemon_url + "/", timeout=10) as reply:
        page = reply.read().decode()
    on_page = (
        int(re.search(r'<span id="affected">([\d,]+)</span>', page)[1]),  # type: ignore[index]
        int(re.search(r'<span id="exposed-count">([\d,]+)</span>', page)[1]),  # type: ignore[index]
    )
    status = json.loads(cli("status", "--url", stack.daemon_url, "--json"))
    in_status = (status["integrity"]["affected"], status["integrity"]["exposed"])
    listed = json.loads(cli("incidents", "--journal", str(stack.journal), "--json"))
    sources = {(i["node"], s["request_id"], s["instance"]) for i in listed for s in i["sources"]}
    in_list = (len(listed), len(sources) + sum(i["other_sources"] for i in listed))
    view = json.loads(cli("incidents", "--exposed", "--json", "--journal", str(stack.journal)))
    in_view = (view["counts"]["incidents"], view["counts"]["exposed"])
    assert on_page == in_status == in_list == in_view, (on_page, in_status, in_list, in_view)
    assert in_list[0] == 1 and in_list[1] >= 1  # one leaking request, its sources
    assert len(view["readers"]) == 1 and len(view["sources"]) == in_list[1]
    # One node name: the journal's, the status page's and the alert's (the scrape label).
    assert {i["node"] for i in listed} == {NODE} and status["node"] == NODE
    assert f'id="node">{NODE}<' in page
    # One page per alert group: Alertmanager's groups (group_by: alertname, node) of the leak.
    assert stack.webhook is not None
    groups = {
        note.payload.get("groupKey")
        for note in stack.webhook.notifications
        for alert in note.alerts()
        if alert["labels"]["alertname"] == "KVIntegrityMismatch" and alert["status"] == "firing"
    }
    assert len(groups) == 1, groups
    # Each notification's alerts state one number of exposed requests, the node's at that
    # evaluation: it only grows while the leak's records come in (a poll may read one reader's
    # findings in two parts), and the group's latest notification states what the journal holds.
    stated = []
    for note in stack.webhook.notifications:
        numbers = {
            alert["annotations"]["description"].split("received the KV of ")[1].split(" ")[0]
            for alert in note.alerts()
            if alert["labels"]["alertname"] == "KVIntegrityMismatch" and alert["status"] == "firing"
        }
        if numbers:
            assert len(numbers) == 1, numbers
            stated.append(int(numbers.pop()))
    assert stated == sorted(stated) and stated[-1] == in_list[1], (stated, in_list)
    # ... and the node's affected requests: the one incident kvwatch incidents lists.
    affected = {
        alert["annotations"]["description"]
        .split(" affected request(s) (incidents)")[0]
        .rsplit(" ", 1)[1]
        for note in stack.webhook.notifications
        for alert in note.alerts()
        if alert["labels"]["alertname"] == "KVIntegrityMismatch" and alert["status"] == "firing"
    }
    assert affected == {"1"}, affected
