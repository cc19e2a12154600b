"""Every dashboard panel returns data from a real Prometheus scraping several real daemons.

Three nodes, each a real ``kvwatch daemon`` fed by real SpoolWriter producers: node-a runs the
incident's setup (SGLang 0.5.19 in PD mode, prefill pool smaller than the context) and leaks;
node-b runs 0.5.23 cleanly; node-c runs vLLM unified. Prometheus loads the real rules and scrapes
the three with their ``node`` target labels. Every query of every panel (the overview with all
nodes, the node dashboard for each node) must return series, and the node variable must list
the three nodes.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from demo.stack import free_port, http_json
from kvspool.writer import SpoolWriter
from tests.alerts.tooling import ALERTS, tool
from tests.dashboards.panels import (
    NEEDS_A_GPU,
    ask,
    concrete,
    label_values,
    panel_queries,
    variable_queries,
)
from tests.kvwatch.daemonproc import DaemonProcess

NODES = ("node-a", "node-b", "node-c")
#: (role, engine, version, model, pool, context) of the engines on each node.
ENGINES = {
    "node-a": [
        ("prefill", "sglang", "0.5.19", "glm", 16384, 32768),  # the incident: a band of 16,384
        ("decode", "sglang", "0.5.19", "glm", 65536, 32768),
    ],
    "node-b": [
        ("prefill", "sglang", "0.5.23", "glm", 65536, 32768),
        ("decode", "sglang", "0.5.23", "glm", 65536, 32768),
    ],
    "node-c": [("unified", "vllm", "0.33.0", "qwen", 40960, 32768)],
}
RATE_INTERVAL = "10s"


@dataclass
class Fleet:
    prometheus: str
    started: float
    writers: dict[str, list[SpoolWriter]]


def _counters(role: str, verified: int, *, leak: bool) -> dict[str, object]:
    series: list[list[object]] = [
        ["verifications", {"detector": "checksum"}, verified],
        ["verifications_skipped", {"detector": "canary", "reason": "mode_off"}, verified // 2],
        ["hook_seconds", {"hook": "verify"}, verified / 1000],
    ]
    if leak and role == "decode":
        series.append(["mismatches", {"detector": "checksum", "kind": "digest"}, 2])
        series.append(["aborted_admissions", {"queue": "decode_prealloc"}, 1])
    return {"counters": series}


def _wait(what: str, check: object, timeout: float) -> None:
    assert callable(check)
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.25)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet-dashboards")
    daemons: dict[str, DaemonProcess] = {}
    prometheus: subprocess.Popen[bytes] | None = None
    writers: dict[str, list[SpoolWriter]] = {}
    try:
        for node in NODES:
            (tmp / node).mkdir()
            daemons[node] = DaemonProcess(tmp / node, "--no-nvml")
            daemons[node].spool.mkdir(exist_ok=True)
        ports = {node: daemon.wait_started() for node, daemon in daemons.items()}
        port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(
            json.dumps(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(ALERTS / "kvwatch.rules.yml")],
                    "scrape_configs": [
                        {
                            "job_name": "kvwatch",
                            "static_configs": [
                                {"targets": [f"127.0.0.1:{ports[n]}"], "labels": {"node": n}}
                                for n in NODES
                            ],
                        }
                    ],
                }
            )
        )
        prometheus = subprocess.Popen(
            [
                tool("prometheus"),
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'prometheus-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=(tmp / "prometheus.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        started = time.time()
        for node in NODES:
            writers[node] = []
            for role, engine, version, model, pool, context in ENGINES[node]:
                writer = SpoolWriter(
                    daemons[node].spool,
                    engine=engine,
                    role=role,
                    model=model,
                    engine_version=version,
                )
                gauges = [
                    ["kv_pool_tokens", {}, pool],
                    ["context_length_tokens", {}, context],
                    ["page_size_tokens", {}, 16],
                ]
                assert writer.write("gauges", {"gauges": gauges})
                assert writer.write("counters", _counters(role, 10, leak=False))
                writers[node].append(writer)

        def scraped() -> bool:
            try:
                up = ask(url, 'kvwatch_kv_pool_tokens{source="hooks"}', instant=True, start=0,
                         end=time.time())  # fmt: skip
            except OSError:
                return False
            return {s["metric"]["node"] for s in up} == set(NODES)

        _wait("Prometheus scraping the three daemons' engines", scraped, 60)
        for node in NODES:  # traffic, and on node-a the leak
            for writer, (role, *_) in zip(writers[node], ENGINES[node], strict=True):
                assert writer.write("counters", _counters(role, 50, leak=node == "node-a"))

        def leaked() -> bool:
            now = time.time()
            return bool(ask(url, "kvwatch_mismatches_total > 0", instant=True, start=0, end=now))

        _wait("Prometheus seeing node-a's leak", leaked, 30)
        time.sleep(3.0)  # a few more scrapes and rule evaluations after it
        yield Fleet(url, started, writers)
    finally:
        for node_writers in writers.values():
            for writer in node_writers:
                writer.close()
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(15)
        for daemon in daemons.values():
            daemon.stop()


def _variables(node: str, elapsed: float) -> dict[str, str]:
    return {
        "$__rate_interval": RATE_INTERVAL,
        "$__range": f"{int(elapsed) + 60}s",
        "$node": node,
        "$role": ".*",  # the variables' "All"
    }


def test_the_node_variable_lists_every_node(fleet: Fleet) -> None:
    queries = [(b, n, q) for b, n, q in variable_queries() if n == "node"]
    assert {b for b, _, _ in queries} == {"kvwatch-overview", "kvwatch-node"}
    for _, _, query in queries:
        assert sorted(label_values(fleet.prometheus, query, {})) == list(NODES)
    for board, name, query in variable_queries():
        if name == "role":
            for node in NODES:
                variables = {"$node": node}
                roles = label_values(fleet.prometheus, query, variables)
                assert roles == sorted({e[0] for e in ENGINES[node]}), (board, node)


def test_every_overview_panel_returns_data_for_the_fleet(fleet: Fleet) -> None:
    end = time.time()
    variables = _variables(".*", end - fleet.started)
    empty = []
    queries = [q for q in panel_queries() if q.board == "kvwatch-overview"]
    assert len(queries) > 20
    for query in queries:
        expr = concrete(query.expr, variables)
        if not ask(fleet.prometheus, expr, instant=query.instant, start=fleet.started, end=end):
            empty.append(f"{query.panel}: {expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_the_fleet_panels_name_the_right_nodes(fleet: Fleet) -> None:
    end = time.time()
    variables = _variables(".*", end - fleet.started)
    by_title = {q.panel: q for q in panel_queries() if q.board == "kvwatch-overview"}

    def nodes(title: str) -> set[str]:
        query = by_title[title]
        expr = concrete(query.expr, variables)
        series = ask(fleet.prometheus, expr, instant=True, start=fleet.started, end=end)
        return {s["metric"].get("node", "") for s in series}

    assert nodes("Nodes with mismatches (top 10)") == {"node-a"}
    assert nodes("Nodes running a vulnerable release") == {"node-a"}
    assert nodes("Verification coverage per node") == set(NODES)
    assert http_json(fleet.prometheus + "/api/v1/status/config")["status"] == "success"


@pytest.mark.parametrize("node", NODES)
def test_every_node_panel_returns_data_for_each_node(fleet: Fleet, node: str) -> None:
    end = time.time()
    variables = _variables(node, end - fleet.started)
    empty = []
    for query in panel_queries():
        if query.board != "kvwatch-node" or (query.board, query.panel) in NEEDS_A_GPU:
            continue
        expr = concrete(query.expr, variables)
        if not ask(fleet.prometheus, expr, instant=query.instant, start=fleet.started, end=end):
            empty.append(f"{query.panel}: {expr}")
    assert not empty, f"{node}: panels without data:\n" + "\n".join(empty)
