"""The fleet pages once: 8 nodes, a Prometheus HA pair, a three-peer Alertmanager cluster.

A leak on one node's decode producer fires KVIntegrityMismatch on both replicas; the webhook gets
exactly one firing notification for the alert group (alertname, node), holding one alert whose
labels carry no ``replica``, and later exactly one resolution. With the peer that sends first
(position 0) killed (kill -9) before the next leak, the page still arrives, once. With one replica
killed as well, the next one arrives, once. Then every dashboard query returns the same series
from VictoriaMetrics (the replicas' remote_write target) as from Prometheus, and ``kvwatch
incidents`` over the 8 journals, or the 8 incidents logs, lists every leak with its node.

The cases run in this order on one bed (the faults accumulate), with the short intervals of
:data:`tests.fleet.bed.SHORT`; tests/fleet/test_fast_path.py runs production intervals.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from demo.stack import Notification
from tests.fleet.bed import PEERS, REPLICAS, REPO, Fleet
from tests.fleet.pages import (
    ALERT,
    expected_labels,
    group,
    notifications_sent,
    peer_position,
    sent_to,
    wait_group,
)
from tests.kvwatch.daemonproc import run_cli

DASHBOARDS = ("kvwatch-overview", "kvwatch-node")
pytestmark = pytest.mark.slow  # real processes: about a minute each, still in make test


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    started = time.monotonic()
    with Fleet(tmp_path_factory.mktemp("fleet")) as running:
        print(f"\nfleet bed up in {running.started_s:.1f} s: {running.intervals.describe()}")
        yield running
    print(f"\nfleet test module wall time {time.monotonic() - started:.1f} s")


def quiet_period(fleet: Fleet) -> float:
    """Long enough for any duplicate to arrive: every later peer's turn (peer_timeout per
    position) and one more group_interval, with a margin."""
    i = fleet.intervals
    return (PEERS - 1) * i.peer_timeout_s + i.group_interval_s + 2


def assert_paged_once(fleet: Fleet, node: str, leaked: float) -> Notification:
    timeout = fleet.intervals.budget_s + (PEERS - 1) * fleet.intervals.peer_timeout_s + 15
    note = wait_group(fleet, node, "firing", timeout)
    print(f"{node}: leak to webhook {note.received - leaked:.2f} s")
    live = fleet.live_replicas()
    fleet.until(
        f"{ALERT} for {node} firing on {live}",
        lambda: all(fleet.firing(replica, ALERT, node) for replica in live),
        fleet.intervals.budget_s,
    )
    time.sleep(quiet_period(fleet))
    firing = group(fleet, node, "firing")
    assert len(firing) == 1, [n.payload for n in firing]
    alerts = firing[0].alerts()
    # Without alert_relabel_configs the group would hold one alert per replica.
    assert [a["labels"] for a in alerts] == [expected_labels(node)], alerts
    return note


def test_a_leak_pages_exactly_once_though_both_replicas_fire_and_resolves_once(
    fleet: Fleet,
) -> None:
    assert fleet.webhook is not None
    assert fleet.webhook.notifications == []  # a clean fleet pages nobody
    for replica in REPLICAS:
        assert len(fleet.active_alertmanagers(replica)) == PEERS
    leaked = fleet.node("node-2").producers["decode"].leak("fleet-leak-1")
    assert_paged_once(fleet, "node-2", leaked)
    for replica in REPLICAS:  # both fired (above), and each sent to every peer
        sent = sent_to(fleet, replica)
        assert len(sent) == PEERS and all(v > 0 for v in sent.values()), (replica, sent)
    window = fleet.intervals.window_per_5m_s or 300
    resolved = wait_group(fleet, "node-2", "resolved", window + fleet.intervals.budget_s + 15)
    print(f"node-2: resolved at the webhook {resolved.received - leaked:.2f} s after the leak")
    time.sleep(quiet_period(fleet))
    assert len(group(fleet, "node-2", "resolved")) == 1
    assert len(group(fleet, "node-2", "firing")) == 1
    assert [a["status"] for a in resolved.alerts()] == ["resolved"]


def test_the_latency_bench_measures_a_page_in_the_fleet(fleet: Fleet) -> None:
    from bench.alert_latency import page_latency

    seconds = page_latency(fleet, fleet.node("node-0"), "fleet-bench-1")
    budget = fleet.intervals.budget_s
    print(
        f"bench: leak to webhook {seconds:.2f} s, {seconds / budget:.2f}x the {budget:g} s budget"
    )
    assert 0 < seconds < 2 * budget + 3  # the budget, late phases and a loaded machine


def test_the_page_arrives_once_with_the_sending_peer_killed(fleet: Fleet) -> None:
    peers = [f"am-{i}" for i in range(PEERS)]
    assert sum(notifications_sent(fleet, am) for am in peers) > 0  # the earlier pages went out
    # The peer at position 0 sends first. Which peer sent an earlier group is no guide: each
    # peer's flush starts when it got the alert, and on a loaded machine a later position's
    # turn can come first (the notification log still keeps that group to one page).
    positions = {am: peer_position(fleet, am) for am in peers}
    sender = min(positions, key=lambda am: positions[am])
    fleet.kill9(sender)  # the peer that would send first: the others must take its turn
    leaked = fleet.node("node-5").producers["decode"].leak("fleet-leak-2")
    assert_paged_once(fleet, "node-5", leaked)
    survivors = [am for am in fleet.live_alertmanagers()]
    assert sender not in survivors and len(survivors) == PEERS - 1


def test_the_page_arrives_once_with_a_replica_killed(fleet: Fleet) -> None:
    fleet.kill9(REPLICAS[0])
    leaked = fleet.node("node-7").producers["decode"].leak("fleet-leak-3")
    assert fleet.live_replicas() == [REPLICAS[1]]
    assert_paged_once(fleet, "node-7", leaked)


# -- long-term storage --------------------------------------------------------------------------


def panel_queries(dashboard: str) -> list[tuple[str, str]]:
    """(panel title, expression) of every target of every panel, rows' panels included."""
    found = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    found.append((panel.get("title", ""), target["expr"]))
            walk(panel.get("panels", []))

    walk(json.loads((REPO / "dashboards" / f"{dashboard}.json").read_text())["panels"])
    return found


def variable_queries(dashboard: str) -> list[tuple[str, str]]:
    """(variable, PromQL) of each label_values() variable: the series it picks from."""
    out = []
    for var in json.loads((REPO / "dashboards" / f"{dashboard}.json").read_text())["templating"][
        "list"
    ]:
        query = var.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", text.strip())
        if match:
            out.append((var["name"], match.group(1)))
    return out


def fill(expr: str, values: dict[str, str]) -> str:
    for name in sorted(values, key=len, reverse=True):  # $__range_s before $__range
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    assert "$" not in expr, expr
    return expr


def label_sets(result: list[dict[str, Any]], *, nan: bool = False) -> list[str]:
    """The series' label sets, those whose value is NaN (``nan``) or the others."""
    return sorted(
        json.dumps(series["metric"], sort_keys=True)
        for series in result
        if (series["value"][1] == "NaN") == nan
    )


def test_every_dashboard_query_returns_the_same_series_from_victoria_metrics(
    fleet: Fleet,
) -> None:
    replica = fleet.live_replicas()[0]
    nodes = sorted(n.name for n in fleet.nodes)
    # A moment both stores hold: VictoriaMetrics receives remote_write batches seconds late.
    at = time.time() - 15
    fleet.until(
        "VictoriaMetrics holds every node's samples",
        lambda: len(fleet.query("victoria-metrics", 'up{job="kvwatch"}', at)) == len(nodes),
        30,
    )
    grafana = {"__rate_interval": "10s", "__interval": "1s", "__range": "1m", "role": ".+"}
    cases: list[tuple[str, str, str]] = []
    for dashboard in DASHBOARDS:
        # The overview across the fleet (its "All"); the node dashboard for each of the 8.
        picks = [".+"] if dashboard == "kvwatch-overview" else nodes
        for node in picks:
            values = {**grafana, "node": node}
            for title, expr in panel_queries(dashboard):
                cases.append((f"{dashboard} / {title} ({node})", expr, fill(expr, values)))
            for name, expr in variable_queries(dashboard):
                cases.append((f"{dashboard} / ${name} ({node})", expr, fill(expr, values)))
    assert len(cases) > 8 * 15
    differ, empty, nans = [], 0, 0
    for where, expr, promql in cases:
        from_prometheus = fleet.query(replica, promql, at)
        from_victoria = fleet.query("victoria-metrics", promql, at)
        prometheus, victoria = label_sets(from_prometheus), label_sets(from_victoria)
        # MetricsQL drops NaN results (0/0 where nothing was verified), Prometheus keeps them:
        # VictoriaMetrics has none, and every other series the same.
        nans += len(label_sets(from_prometheus, nan=True))
        assert not label_sets(from_victoria, nan=True), (where, from_victoria)
        empty += not prometheus
        if prometheus != victoria:
            differ.append(f"{where}: {expr}\n  prometheus {prometheus}\n  victoria   {victoria}")
    print(
        f"{len(cases)} dashboard queries, {len(cases) - empty} with series, the same series in "
        f"both; {nans} NaN series in Prometheus only"
    )
    assert not differ, "\n".join(differ)
    assert empty < len(cases) / 4, f"{empty} of {len(cases)} queries returned nothing"


def test_victoria_metrics_holds_the_alerts_history_without_replica_labels(fleet: Fleet) -> None:
    # ALERTS is written by both replicas; remote_write drops `replica`: one series per alert.
    history = fleet.query("victoria-metrics", f'max_over_time(ALERTS{{alertname="{ALERT}"}}[5m])')
    nodes = [s["metric"]["node"] for s in history]
    assert sorted(nodes) == ["node-0", "node-2", "node-5", "node-7"], history  # node-0: the bench
    assert all("replica" not in s["metric"] for s in history), history


# -- incidents across the fleet -----------------------------------------------------------------


@pytest.mark.parametrize("source", ["--journal", "--incidents-log"])
def test_kvwatch_incidents_lists_every_leak_of_the_fleet_with_its_node(
    fleet: Fleet, source: str
) -> None:
    want = {("node-0", "fleet-bench-1"), ("node-2", "fleet-leak-1"),
            ("node-5", "fleet-leak-2"), ("node-7", "fleet-leak-3")}  # fmt: skip
    listed: set[tuple[str, str]] = set()

    def complete() -> bool:
        nonlocal listed
        if source == "--journal":
            files = [node.daemon.journal for node in fleet.nodes]
        else:  # as `node-*/incidents.jsonl` expands: a node with no incident has no log
            files = sorted(fleet.workdir.glob("node-*/incidents.jsonl"))
            # The daemons append to their logs after their journals commit: a moment.
            if [f.parent.name for f in files] != sorted({node for node, _ in want}):
                return False
        out = run_cli("incidents", *[a for f in files for a in (source, str(f))], "--json")
        assert out.returncode == 0, out.stderr
        rows = json.loads(out.stdout)
        listed = {(row["node"], row["request_id"]) for row in rows}
        assert all(row["role"] == "decode" and row["detectors"] == ["canary"] for row in rows)
        return listed == want

    fleet.until(f"kvwatch incidents {source} x 8 lists the 4 leaks", complete, 15)
    assert listed == want
