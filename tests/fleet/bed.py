"""A fleet on 127.0.0.1: kvwatch daemons, a Prometheus HA pair, an Alertmanager cluster,
VictoriaMetrics and a webhook standing in for the pager. Every part is a real process.

- ``nodes`` nodes, each a real ``kvwatch daemon`` fed by two real ``kvspool.SpoolWriter``
  producers (prefill and decode); Prometheus gives each target its ``node`` label.
- Two Prometheus replicas running ``deploy/prometheus-ha.yml`` with the flags of
  ``deploy/prometheus.default`` (``replica`` prom-a, prom-b), loading ``alerts/kvwatch.rules.yml``.
- Three Alertmanager peers with the flags of ``deploy/prometheus-alertmanager.default`` and the
  routing of ``alerts/alertmanager.example.yml``, its receivers pointed at the webhook.
- VictoriaMetrics with the flags of ``deploy/victoria-metrics.default``, the replicas'
  remote_write target.

The deploy files are the one source of truth: the bed substitutes loopback addresses, temporary
paths and the intervals of :class:`Intervals`, and fails loudly when a value it substitutes is no
longer in the file. Everything starts in parallel; :meth:`Fleet.start` returns once every part
answers its readiness endpoint, the Alertmanager peers see each other and both replicas have
scraped every node.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demo.stack import WebhookReceiver, free_port, http_json
from kvspool.writer import SpoolWriter
from tests.kvwatch.daemonproc import DaemonProcess

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
RULES = REPO / "alerts" / "kvwatch.rules.yml"
ALERTMANAGER_CONFIG = REPO / "alerts" / "alertmanager.example.yml"
PROMETHEUS_BIN, ALERTMANAGER_BIN, VICTORIA_BIN = (
    "prometheus",
    "prometheus-alertmanager",
    "victoria-metrics",
)
REPLICAS = ("prom-a", "prom-b")
PEERS = 3
# A clean fleet: a release past the floor, a pool larger than the context (no unsafe band).
ENGINE, MODEL, VERSION = "sglang", "glm-5.3", "0.5.23"
POOL_TOKENS, CONTEXT_TOKENS, PAGE_TOKENS = 65536, 32768, 64


def missing_tools() -> list[str]:
    return [b for b in (PROMETHEUS_BIN, ALERTMANAGER_BIN, VICTORIA_BIN) if not shutil.which(b)]


@dataclass(frozen=True)
class Intervals:
    """The intervals the bed runs with; the pager's latency budget is their sum."""

    scrape_s: float
    evaluation_s: float
    group_wait_s: float
    group_interval_s: float
    #: Alertmanager's --cluster.peer-timeout: the wait per position before a peer sends.
    peer_timeout_s: float
    #: The rules' range windows ([5m], [10m]) scaled to this many seconds per 5m, so that a leak
    #: resolves within a test; None runs the rules unchanged.
    window_per_5m_s: float | None = None

    @property
    def budget_s(self) -> float:
        """Scrape + evaluation + group_wait: the configured latency of the rule path."""
        return self.scrape_s + self.evaluation_s + self.group_wait_s

    def describe(self) -> str:
        return (
            f"scrape {self.scrape_s:g} s + evaluation {self.evaluation_s:g} s + group_wait "
            f"{self.group_wait_s:g} s = {self.budget_s:g} s (group_interval "
            f"{self.group_interval_s:g} s, peer_timeout {self.peer_timeout_s:g} s)"
        )


#: Short intervals, for the HA cases in seconds rather than minutes. (PEERS - 1) x peer_timeout
#: stays under group_interval, as in production (deploy/README.md: a resolved alert re-fires
#: otherwise).
SHORT = Intervals(1, 1, 1, 6, 2, window_per_5m_s=10)
#: The production budget of deploy/prometheus-ha.yml and alerts/alertmanager.example.yml
#: (15 s + 15 s + 10 s). The group interval is shorter than the example's minute so that an
#: alert Alertmanager failed to merge would show as a second notification within a test.
PRODUCTION = Intervals(15, 15, 10, 10, 2)


def _seconds(value: float) -> str:
    return f"{int(value * 1000)}ms"


# -- the deploy files, rendered -----------------------------------------------------------------


def substitute(text: str, replacements: dict[str, str], *, source: Path) -> str:
    """``text`` with each key replaced; a key missing from ``text`` is an error (the deploy file
    changed under the bed)."""
    for old, new in replacements.items():
        if old not in text:
            raise ValueError(f"{source.name}: {old!r} not found: the fleet bed renders it")
        text = text.replace(old, new)
    return text


def read_default(path: Path) -> dict[str, str]:
    """The variables of a Debian /etc/default file (``NAME=value`` lines, shell quoting)."""
    values = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            words = shlex.split(value)
            values[name.strip()] = words[0] if words else ""
    return values


def flags(path: Path, overrides: dict[str, str | list[str]]) -> list[str]:
    """The ARGS of a Debian default file with some flags' values replaced (a flag given a list
    is repeated). Every flag overridden must be in the file."""
    args = shlex.split(read_default(path)["ARGS"])
    out: list[str] = []
    seen: set[str] = set()
    for arg in args:
        name = arg.split("=", 1)[0]
        if name not in overrides:
            out.append(arg)
        elif name not in seen:
            seen.add(name)
            value = overrides[name]
            out.extend(f"{name}={v}" for v in ([value] if isinstance(value, str) else value))
    missing = set(overrides) - seen
    if missing:
        raise ValueError(f"{path.name}: {sorted(missing)} not in ARGS: the fleet bed sets them")
    return out


def scaled_rules(window_per_5m_s: float | None) -> str:
    """alerts/kvwatch.rules.yml with its range windows scaled (or unchanged)."""
    text = RULES.read_text()
    if window_per_5m_s is None:
        return text

    def scale(match: re.Match[str]) -> str:
        return f"[{_seconds(int(match.group(1)) / 5 * window_per_5m_s)}]"

    scaled, count = re.subn(r"\[(\d+)m\]", scale, text)
    assert count, "no range windows in the rules"
    return (
        f"# tests/fleet/bed.py: the range windows scaled to {window_per_5m_s:g} s per 5m\n{scaled}"
    )


def prometheus_config(intervals: Intervals, victoria_url: str) -> str:
    source = DEPLOY / "prometheus-ha.yml"
    return substitute(
        source.read_text(),
        {
            "scrape_interval: 15s": f"scrape_interval: {_seconds(intervals.scrape_s)}",
            "evaluation_interval: 15s": f"evaluation_interval: {_seconds(intervals.evaluation_s)}",
            "http://victoria-metrics.example:8428": victoria_url,
        },
        source=source,
    )


def daemon_config(intervals: Intervals, node: str, alertmanagers: list[str]) -> str:
    """deploy/kvwatch-fleet.toml for one node: its name, the peers, the scrape interval."""
    source = DEPLOY / "kvwatch-fleet.toml"
    urls = ", ".join(json.dumps(url) for url in alertmanagers)
    return substitute(
        source.read_text(),
        {
            'node = "gpu-node-01"': f"node = {json.dumps(node)}",
            '["http://10.0.0.31:9093", "http://10.0.0.32:9093", "http://10.0.0.33:9093"]': (
                f"[{urls}]"
            ),
            'prometheus_scrape_interval = "15s"': (
                f'prometheus_scrape_interval = "{_seconds(intervals.scrape_s)}"'
            ),
        },
        source=source,
    )


def alertmanager_config(intervals: Intervals, webhook_url: str) -> str:
    """The example's routing tree and inhibitions; the critical route's waits from
    ``intervals``, every receiver the webhook (resolutions included)."""
    source = ALERTMANAGER_CONFIG
    text = source.read_text()
    routing, found, _ = text.partition("\nreceivers:\n")
    if not found:
        raise ValueError(f"{source.name}: no top-level receivers: the fleet bed replaces them")
    routing = substitute(
        routing,
        {
            "      group_wait: 10s\n      group_interval: 1m\n": (
                f"      group_wait: {_seconds(intervals.group_wait_s)}\n"
                f"      group_interval: {_seconds(intervals.group_interval_s)}\n"
            )
        },
        source=source,
    )
    receivers = "".join(
        f"  - name: {name}\n    webhook_configs: [{{url: '{webhook_url}', send_resolved: true}}]\n"
        for name in sorted(set(re.findall(r"receiver: ([\w-]+)", routing)))
    )
    return f"{routing}\nreceivers:\n{receivers}"


# -- nodes ------------------------------------------------------------------------------------


class Producer:
    """One engine process's spool writer, reporting cumulative counters like the hooks do."""

    def __init__(self, spool: Path, node: str, role: str) -> None:
        self.role = role
        self.writer = SpoolWriter(
            spool, engine=ENGINE, role=role, model=MODEL, engine_version=VERSION
        )
        # Each simulated node is a host of its own: the hello record names it (as the host name
        # does on a real node); the journals and incidents logs carry the daemon's node setting.
        self.writer.identity["node"] = node
        self.verifications = 0
        self.mismatches = 0
        self.lock = threading.Lock()
        self.writer.write(
            "gauges",
            {
                "gauges": [
                    ["kv_pool_tokens", {}, POOL_TOKENS],
                    ["context_length_tokens", {}, CONTEXT_TOKENS],
                    ["page_size_tokens", {}, PAGE_TOKENS],
                ]
            },
        )

    def _counters_locked(self) -> None:
        detectors = ("canary", "checksum") if self.role == "decode" else ("checksum",)
        series: list[list[Any]] = [
            ["verifications", {"detector": d}, self.verifications] for d in detectors
        ]
        series.append(["hook_seconds", {"hook": "verify"}, self.verifications * 1e-4])
        series.append(
            ["mismatches", {"detector": "canary", "kind": "unwritten_page"}, self.mismatches]
        )
        if not self.writer.write("counters", {"counters": series}):
            raise RuntimeError(f"spool write failed: {dict(self.writer.dropped)}")

    def tick(self, requests: int) -> None:
        """Clean traffic: ``requests`` more requests verified."""
        with self.lock:
            self.verifications += requests
            self._counters_locked()

    def leak(self, request_id: str) -> float:
        """A request read a page nobody wrote: the event and the counter, as the canary hook
        reports it. Returns the time the event was written."""
        with self.lock:
            written = time.time()
            ok = self.writer.write(
                "event",
                {
                    "detector": "canary",
                    "kind": "unwritten_page",
                    "mode": "log",
                    "action": "logged",
                    "request_id": request_id,
                    "pages": [3, 5],
                    "pages_total": 2,
                    "detail": {"unwritten": 2},
                },
            )
            if not ok:
                raise RuntimeError(f"spool write failed: {dict(self.writer.dropped)}")
            self.mismatches += 1
            self._counters_locked()
            return written

    def close(self) -> None:
        self.writer.close()


@dataclass
class Node:
    name: str
    directory: Path
    daemon: DaemonProcess
    producers: dict[str, Producer] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.daemon.port}"


# -- the fleet ----------------------------------------------------------------------------------


@dataclass
class Fleet:
    workdir: Path
    intervals: Intervals = SHORT
    nodes_count: int = 8
    #: Each daemon posts its alerts to the Alertmanager peers itself (deploy/kvwatch-fleet.toml).
    fast_path: bool = False
    nodes: list[Node] = field(default_factory=list)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    webhook: WebhookReceiver | None = None
    started_s: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _ticker: threading.Thread | None = None

    def __enter__(self) -> Fleet:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def alertmanagers(self) -> list[str]:
        return [self.urls[f"am-{i}"] for i in range(PEERS)]

    @property
    def prometheus(self) -> list[str]:
        return [self.urls[r] for r in REPLICAS]

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    # -- start --------------------------------------------------------------------------------

    def start(self) -> None:
        began = time.monotonic()
        missing = missing_tools()
        if missing:
            raise RuntimeError(f"{missing} missing: make tools installs Debian's packages")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.webhook = WebhookReceiver()
        for name in (*REPLICAS, *(f"am-{i}" for i in range(PEERS)), "victoria-metrics"):
            self.urls[name] = f"http://127.0.0.1:{free_port()}"
        self._start_daemons()
        self._start_alertmanagers()
        self._start_victoria_metrics()
        self._start_prometheus()
        for node in self.nodes:  # the daemons started first: by now most are up
            node.daemon.wait_started(60)
        self._write_targets()
        self._start_producers()
        for name in (*(f"am-{i}" for i in range(PEERS)), *REPLICAS):
            self._wait_ready(name, "/-/ready")
        self._wait_ready("victoria-metrics", "/health")
        self.wait_peers(PEERS)
        self.wait_scraped()
        self.started_s = time.monotonic() - began

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        with (self.workdir / f"{name}.log").open("wb") as log:
            self.procs[name] = subprocess.Popen(
                argv, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})}, start_new_session=True,
            )  # fmt: skip

    def _start_daemons(self) -> None:
        for i in range(self.nodes_count):
            name = f"node-{i}"
            directory = self.workdir / name
            directory.mkdir()
            # Each simulated node is a host of its own: its daemon's node setting names it.
            config = directory / "kvwatch.toml"
            if self.fast_path:
                config.write_text(daemon_config(self.intervals, name, self.alertmanagers))
            else:
                config.write_text(f"node = {json.dumps(name)}\n")
            extra = ["--config", str(config)]
            daemon = DaemonProcess(
                directory, "--no-nvml", "--poll-interval", "0.2s", "--log-format", "json",
                *extra,
            )  # fmt: skip
            self.nodes.append(Node(name, directory, daemon))

    def _start_alertmanagers(self) -> None:
        assert self.webhook is not None
        config = self.workdir / "alertmanager.yml"
        config.write_text(alertmanager_config(self.intervals, self.webhook.url))
        gossip = [f"127.0.0.1:{free_port()}" for _ in range(PEERS)]
        for i in range(PEERS):
            name = f"am-{i}"
            argv = flags(
                DEPLOY / "prometheus-alertmanager.default",
                {
                    "--config.file": str(config),
                    "--storage.path": str(self.workdir / f"{name}-data"),
                    "--web.listen-address": urllib.parse.urlsplit(self.urls[name]).netloc,
                    "--cluster.listen-address": gossip[i],
                    "--cluster.advertise-address": gossip[i],
                    "--cluster.peer": gossip,
                    "--cluster.peer-timeout": _seconds(self.intervals.peer_timeout_s),
                    "--cluster.settle-timeout": "2s",
                },
            )
            # Loopback gossip, quicker than the defaults so that a test needs seconds, not
            # minutes, to see the peers join and a killed one fail.
            argv += [
                "--cluster.gossip-interval=50ms", "--cluster.pushpull-interval=2s",
                "--cluster.probe-interval=200ms", "--cluster.probe-timeout=100ms",
            ]  # fmt: skip
            self._spawn(name, [ALERTMANAGER_BIN, *argv])

    def _start_victoria_metrics(self) -> None:
        argv = flags(
            DEPLOY / "victoria-metrics.default",
            {
                "-storageDataPath": str(self.workdir / "victoria-metrics-data"),
                "-httpListenAddr": urllib.parse.urlsplit(self.urls["victoria-metrics"]).netloc,
                "-dedup.minScrapeInterval": _seconds(self.intervals.scrape_s),
            },
        )
        # Samples are queryable 2 s after they arrive rather than 30 s (the default allows for
        # slow writers): the test compares moments seconds old.
        argv.append("-search.latencyOffset=2s")
        self._spawn("victoria-metrics", [VICTORIA_BIN, *argv])

    def _start_prometheus(self) -> None:
        (self.workdir / "targets").mkdir()
        (self.workdir / "targets" / "alertmanagers.json").write_text(
            json.dumps([{"targets": [urllib.parse.urlsplit(u).netloc for u in self.alertmanagers]}])
        )
        (self.workdir / "kvwatch.rules.yml").write_text(
            scaled_rules(self.intervals.window_per_5m_s)
        )
        config = self.workdir / "prometheus-ha.yml"
        config.write_text(prometheus_config(self.intervals, self.urls["victoria-metrics"]))
        defaults = read_default(DEPLOY / "prometheus.default")
        assert defaults["PROMETHEUS_REPLICA"] == REPLICAS[0], defaults
        for replica in REPLICAS:
            argv = flags(
                DEPLOY / "prometheus.default",
                {
                    "--config.file": str(config),
                    "--storage.tsdb.path": str(self.workdir / f"{replica}-data"),
                    "--web.listen-address": urllib.parse.urlsplit(self.urls[replica]).netloc,
                    # As the file's 10 s to 15 s evaluations: under the bed's evaluation interval.
                    "--rules.alert.resend-delay": _seconds(self.intervals.evaluation_s * 2 / 3),
                },
            )
            self._spawn(replica, [PROMETHEUS_BIN, *argv], env={"PROMETHEUS_REPLICA": replica})

    def _write_targets(self) -> None:
        groups = [{"targets": [n.target], "labels": {"node": n.name}} for n in self.nodes]
        tmp = self.workdir / "targets" / ".kvwatch-fleet.json.new"
        tmp.write_text(json.dumps(groups, indent=1))
        tmp.rename(self.workdir / "targets" / "kvwatch-fleet.json")  # file SD reads it whole

    def _start_producers(self) -> None:
        for node in self.nodes:
            for role in ("prefill", "decode"):
                node.producers[role] = Producer(node.daemon.spool, node.name, role)
        self._ticker = threading.Thread(target=self._tick, daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        """Clean traffic on every producer, each second."""
        while not self._stop.wait(1.0):
            for node in self.nodes:
                for producer in node.producers.values():
                    producer.tick(10)

    # -- waiting ------------------------------------------------------------------------------

    def _log_tail(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")[-3000:]

    def _wait_ready(self, name: str, path: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            proc = self.procs[name]
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode}:\n{self._log_tail(name)}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(self.urls[name] + path, timeout=2) as reply,
            ):
                if reply.status == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not ready in {timeout:g} s:\n{self._log_tail(name)}")
            time.sleep(0.05)

    def until(self, what: str, check: Callable[[], bool], timeout: float) -> float:
        """Poll ``check`` until true; the seconds it took. A timeout names ``what``."""
        began = time.monotonic()
        while not check():
            if time.monotonic() - began > timeout:
                raise TimeoutError(f"{what}: not within {timeout:g} s")
            time.sleep(0.05)
        return time.monotonic() - began

    def peers(self, am: str) -> int:
        return len(http_json(self.urls[am] + "/api/v2/status")["cluster"]["peers"])

    def live_alertmanagers(self) -> list[str]:
        return [f"am-{i}" for i in range(PEERS) if self.procs[f"am-{i}"].poll() is None]

    def wait_peers(self, count: int, timeout: float = 30.0) -> None:
        live = self.live_alertmanagers()
        self.until(
            f"{count} Alertmanager peers in the cluster",
            lambda: all(self.peers(am) == count for am in live),
            timeout,
        )

    def live_replicas(self) -> list[str]:
        return [r for r in REPLICAS if self.procs[r].poll() is None]

    def query(self, replica: str, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query to a replica (or to victoria-metrics)."""
        params = {"query": promql, **({"time": f"{at:.3f}"} if at is not None else {})}
        reply = http_json(self.urls[replica] + "/api/v1/query?" + urllib.parse.urlencode(params))
        if reply.get("status") != "success":
            raise RuntimeError(f"{replica}: query failed: {promql}: {reply}")
        result: list[dict[str, Any]] = reply["data"]["result"]
        return result

    def wait_scraped(self, timeout: float | None = None) -> None:
        """Until every live replica has scraped every node and discovered every peer."""
        timeout = timeout or 3 * self.intervals.scrape_s + 30
        want = len(self.nodes)

        def scraped() -> bool:
            for replica in self.live_replicas():
                up = self.query(replica, 'count(up{job="kvwatch"} == 1)')
                if not up or int(float(up[0]["value"][1])) != want:
                    return False
                if len(self.active_alertmanagers(replica)) != PEERS:
                    return False
            return True

        self.until("every replica scraped every node", scraped, timeout)

    def active_alertmanagers(self, replica: str) -> list[str]:
        reply = http_json(self.urls[replica] + "/api/v1/alertmanagers")
        return [am["url"] for am in reply["data"]["activeAlertmanagers"]]

    def firing(self, replica: str, alertname: str, node: str) -> list[dict[str, Any]]:
        alerts = http_json(self.urls[replica] + "/api/v1/alerts")["data"]["alerts"]
        return [
            a
            for a in alerts
            if a["labels"].get("alertname") == alertname
            and a["labels"].get("node") == node
            and a["state"] == "firing"
        ]

    # -- faults -------------------------------------------------------------------------------

    def kill9(self, name: str) -> None:
        proc = self.procs[name]
        proc.kill()
        proc.wait(10)

    # -- stop ---------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(5)
        for node in self.nodes:
            for producer in node.producers.values():
                producer.close()
        # Prometheus first: it flushes its remote_write queue to VictoriaMetrics as it stops,
        # and would wait a minute for one that is gone. Then the Alertmanager peers one by one:
        # a peer leaving the cluster waits 10 s for acknowledgements from peers leaving too.
        first = [self.procs[r] for r in REPLICAS if r in self.procs]
        peers = [[self.procs[f"am-{i}"]] for i in range(PEERS) if f"am-{i}" in self.procs]
        rest = [p for p in self.procs.values() if p not in first and [p] not in peers]
        for procs in (first, *peers, [*rest, *(node.daemon.proc for node in self.nodes)]):
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(5)
        for node in self.nodes:
            node.daemon.stop()  # closes its log (the process has exited)
        if self.webhook is not None:
            self.webhook.close()
