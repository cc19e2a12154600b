"""The whole pipeline on one machine: minipd, the kvwatch daemon, Prometheus with kvwatch's
rules, Alertmanager, and a webhook receiver standing in for the pager.

Every server binds 127.0.0.1 on a free port. Used by ``make demo``, the live pipeline test and
the alert latency benchmark. Prometheus and Alertmanager are Debian's packages
(``prometheus``, ``prometheus-alertmanager``); without them the stack runs the rest.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minipd.launch import start as start_minipd
from minipd.launch import stop as stop_minipd

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "alerts" / "kvwatch.rules.yml"
ALERTMANAGER_EXAMPLE = REPO / "alerts" / "alertmanager.example.yml"
PROMETHEUS_BIN = "prometheus"
ALERTMANAGER_BIN = "prometheus-alertmanager"
NODE = "demo-node"
# The incident's shape at minipd's size: the prefill pool is the small one, decode reserves the
# whole prompt, the context sits between them.
PREFILL_POOL, DECODE_POOL, CONTEXT = 16384, 65536, 32768
SERVE_ARGS = [
    "--pool-tokens", str(PREFILL_POOL), "--decode-pool-tokens", str(DECODE_POOL),
    "--context-length", str(CONTEXT), "--page-size", "16",
]  # fmt: skip


def missing_tools() -> list[str]:
    return [b for b in (PROMETHEUS_BIN, ALERTMANAGER_BIN) if shutil.which(b) is None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.load(reply)


@dataclass
class Notification:
    received: float  # time.time() when the POST arrived
    payload: dict[str, Any]

    def alerts(self) -> list[dict[str, Any]]:
        return list(self.payload.get("alerts", []))


class WebhookReceiver:
    """Alertmanager's webhook target: records every POST with the time it arrived."""

    def __init__(self, on_post: Any = None) -> None:
        self.notifications: list[Notification] = []
        self.arrived = threading.Condition()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                note = Notification(time.time(), json.loads(body or b"{}"))
                with receiver.arrived:
                    receiver.notifications.append(note)
                    receiver.arrived.notify_all()
                if on_post is not None:
                    on_post(note)
                self.send_response(200)
                self.end_headers()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(
        self, alertname: str, timeout: float, **match: str
    ) -> tuple[Notification, dict[str, Any]]:
        """The first notification that carries a firing ``alertname`` (with the ``match``
        labels), and that alert."""
        deadline = time.monotonic() + timeout
        want = {"alertname": alertname, **match}
        with self.arrived:
            while True:
                for note in self.notifications:
                    for alert in note.alerts():
                        labels = alert.get("labels", {})
                        if alert["status"] == "firing" and all(
                            labels.get(k) == v for k, v in want.items()
                        ):
                            return note, alert
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {alertname} notification within {timeout:g} s")
                self.arrived.wait(left)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _inhibit_rules() -> str:
    """The example configuration's inhibitions, as text (kept in one place)."""
    lines = ALERTMANAGER_EXAMPLE.read_text().splitlines()
    start = lines.index("inhibit_rules:")
    block = [lines[start]]
    for line in lines[start + 1 :]:
        if line and not line[0].isspace() and not line.startswith("#"):
            break
        block.append(line)
    return "\n".join(block)


@dataclass
class Stack:
    workdir: Path
    release: str = "0.5.19"
    kvwatch: str = "log"
    serve_args: list[str] = field(default_factory=lambda: list(SERVE_ARGS))
    with_prometheus: bool = True
    #: Called with each webhook notification as it arrives (the demo prints pages).
    on_page: Any = None
    procs: dict[str, subprocess.Popen[str]] = field(default_factory=dict)
    minipd_url: str = ""
    daemon_url: str = ""
    prometheus_url: str = ""
    alertmanager_url: str = ""
    webhook: WebhookReceiver | None = None

    @property
    def spool(self) -> Path:
        return self.workdir / "spool"

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"

    @property
    def journal(self) -> Path:
        return self.workdir / "journal.db"

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- start --------------------------------------------------------------------------------

    def start(self) -> None:
        self.spool.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self._start_daemon()
        if self.with_prometheus:
            self.webhook = WebhookReceiver(self.on_page)
            self._start_alertmanager()
            self._start_prometheus()
        proc, self.minipd_url = start_minipd(
            [
                "--release", self.release, "--kvwatch", self.kvwatch,
                "--kvwatch-spool", str(self.spool), "--log-dir", str(self.logs),
                *self.serve_args,
            ],
            self.workdir,
        )  # fmt: skip
        self.procs["minipd"] = proc

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[str]:
        log = (self.workdir / f"{name}.log").open("w")
        proc = subprocess.Popen(
            argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.procs[name] = proc
        return proc

    def _wait(self, name: str, url: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            proc = self.procs[name]
            if proc.poll() is not None:
                log = (self.workdir / f"{name}.log").read_text()[-2000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(url, timeout=2) as reply,
            ):
                if reply.status == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not answer {url} within {timeout:g} s")
            time.sleep(0.1)

    @property
    def daemon_config(self) -> Path:
        return self.workdir / "kvwatch.toml"

    def _start_daemon(self) -> None:
        port = free_port()
        # One node name: the daemon's setting names the node in its journal, incidents, status
        # page and fast-path pages, and the scrape config's target label is the same constant.
        self.daemon_config.write_text(f"node = {json.dumps(NODE)}\n")
        self._spawn(
            "daemon",
            [
                sys.executable, "-m", "kvwatch.cli", "daemon", "--config", str(self.daemon_config),
                "--spool-dir", str(self.spool), "--journal", str(self.journal),
                "--listen", f"127.0.0.1:{port}", "--poll-interval", "0.1s",
                "--log", f"prefill:sglang:{self.logs / 'prefill.log'}",
                "--log", f"decode:sglang:{self.logs / 'decode.log'}",
            ],
        )  # fmt: skip
        self.daemon_url = f"http://127.0.0.1:{port}"
        self._wait("daemon", self.daemon_url + "/metrics")

    def _start_alertmanager(self) -> None:
        assert self.webhook is not None
        port = free_port()
        config = self.workdir / "alertmanager.yml"
        config.write_text(
            "# Generated by demo/stack.py: the example's routing keys and inhibitions, with every\n"
            "# receiver pointed at the local webhook and short waits for a live test.\n"
            "route:\n"
            "  receiver: webhook\n"
            "  group_by: [alertname, node]\n"
            "  group_wait: 1s\n"
            "  group_interval: 1s\n"
            "  repeat_interval: 1h\n"
            "receivers:\n"
            "  - name: webhook\n"
            f"    webhook_configs: [{{url: '{self.webhook.url}', send_resolved: false}}]\n"
            + _inhibit_rules()
            + "\n"
        )
        self._spawn(
            "alertmanager",
            [
                ALERTMANAGER_BIN, f"--config.file={config}",
                f"--storage.path={self.workdir / 'alertmanager-data'}",
                f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
            ],
        )  # fmt: skip
        self.alertmanager_url = f"http://127.0.0.1:{port}"
        self._wait("alertmanager", self.alertmanager_url + "/-/ready")

    def _start_prometheus(self) -> None:
        port = free_port()
        daemon = urllib.parse.urlsplit(self.daemon_url).netloc
        alertmanager = urllib.parse.urlsplit(self.alertmanager_url).netloc
        config = self.workdir / "prometheus.yml"
        config.write_text(
            json.dumps(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(RULES)],
                    "alerting": {
                        "alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]
                    },
                    "scrape_configs": [
                        {
                            "job_name": "kvwatch",
                            "static_configs": [{"targets": [daemon], "labels": {"node": NODE}}],
                        }
                    ],
                },
                indent=2,
            )
        )
        self._spawn(
            "prometheus",
            [
                PROMETHEUS_BIN, f"--config.file={config}",
                f"--storage.tsdb.path={self.workdir / 'prometheus-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                # Under the evaluation interval: every evaluation re-sends each firing alert, so
                # a notification's alerts all carry the same, latest counts (the default 1m
                # keeps an alert's first counts while a newer alert of its group has grown).
                "--rules.alert.resend-delay=500ms",
            ],
        )  # fmt: skip
        self.prometheus_url = f"http://127.0.0.1:{port}"
        self._wait("prometheus", self.prometheus_url + "/-/ready")

    # -- use ----------------------------------------------------------------------------------

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = self.prometheus_url + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        reply = http_json(url)
        if reply.get("status") != "success":
            raise RuntimeError(f"query failed: {promql}: {reply}")
        result: list[dict[str, Any]] = reply["data"]["result"]
        return result

    def wait_scraped(self, timeout: float = 60.0) -> None:
        """Until Prometheus has scraped the daemon and sees the engines' pool gauges."""
        deadline = time.monotonic() + timeout
        while not self.query('kvwatch_kv_pool_tokens{source="hooks"}'):
            if time.monotonic() > deadline:
                raise TimeoutError("Prometheus never saw the engines' pool gauges")
            time.sleep(0.2)

    # -- stop ---------------------------------------------------------------------------------

    def stop(self) -> None:
        minipd = self.procs.pop("minipd", None)
        if minipd is not None:
            stop_minipd(minipd)
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        self.procs.clear()
        if self.webhook is not None:
            self.webhook.close()
            self.webhook = None
