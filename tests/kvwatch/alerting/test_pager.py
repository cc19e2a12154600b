"""The fast path to the pager: the daemon's own alerts, with the labels the rule produces.

Unit tests: the labels and annotations the daemon derives are the ones the real rule file
produces under promtool; the firing, resend, quiet and resolution timing on a clock; the settings.
Live tests: a real daemon fed by a real SpoolWriter, a real Alertmanager and a real Prometheus
(production intervals) running the real rules; one notification for the leak, the fast path's
within group_wait + 3 s, and a dead Alertmanager counted as a failed post.
"""

from __future__ import annotations

import collections
import json
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.core import CounterMetricFamily, Metric

from demo.stack import WebhookReceiver, free_port, http_json
from kvspool import catalogue
from kvspool.writer import SpoolWriter
from kvwatch import config as configuration
from kvwatch.alerting import evaluate as pager_module
from kvwatch.alerting import notify
from kvwatch.alerting.evaluate import (
    ENDS_AT_RESENDS,
    TICK,
    Evaluator,
    alert_labels,
    counter_labels,
    fast_alerts,
    kept_labels,
)
from kvwatch.alerting.notify import MAX_BATCH_AGE, Notifier
from kvwatch.alerting.rules import Alert, Increase
from kvwatch.alerting.templates import alert_annotations, render
from kvwatch.store.state import State
from tests.alerts.tooling import ALERTS, run, tool
from tests.kvwatch.daemonproc import DaemonProcess

RULES = ALERTS / "kvwatch.rules.yml"

# -- which alerts, which labels -------------------------------------------------------------------


def test_the_fast_alerts_are_the_critical_counter_alerts() -> None:
    names = {a.name for a in fast_alerts()}
    assert names == {
        "KVIntegrityMismatch",
        "KVLayoutMismatch",
        "KVAbortedRequestAdmitted",
        "KVSpoolRecordsLost",
    }
    for alert in fast_alerts():
        assert alert.severity == "critical" and not alert.for_
        assert alert.increase is not None and alert.expr == alert.increase.expr


def test_a_rule_grouping_on_a_label_the_daemon_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="not"):
        kept_labels(Increase("mismatches", ("node", "role", "queue"), "5m"))
    with pytest.raises(ValueError, match="without node"):
        kept_labels(Increase("mismatches", ("role",), "5m"))
    with pytest.raises(ValueError, match="not a catalogued counter"):
        counter_labels("spool_lag_bytes")


def _series(alert: Alert) -> dict[str, str]:
    """One series of the alert's counter as /metrics serves it, with the target's labels."""
    assert alert.increase is not None
    labels = {"job": "kvwatch", "instance": "10.0.0.1:29321", "node": "decode-7"}
    for name in counter_labels(alert.increase.counter):
        label = next(
            lab
            for s in (*catalogue.COUNTER_SERIES,)
            for lab in s.labels
            if lab.name == name and s.family.endswith(alert.increase.counter)
        )
        labels[name] = next(v for v in label.sorted_values if v != catalogue.OTHER)
    # A series the alert's own matchers select (KVLayoutMismatch: kind="layout_mismatch").
    labels |= {name: value for name, op, value in alert.increase.where if op == "="}
    assert alert.increase.matches(labels), alert.name
    return labels


def _selector(labels: dict[str, str]) -> str:
    return "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def test_labels_and_annotations_are_the_rules_own_under_promtool(tmp_path: Path) -> None:
    """promtool evaluates the generated rule file on a series shaped like the daemon's; it must
    produce exactly the labels and annotations the daemon derives for the same series."""
    tests = []
    for alert in fast_alerts():
        assert alert.increase is not None
        series = _series(alert)
        values = {k: v for k, v in series.items() if k not in ("job", "instance", "node")}
        labels = alert_labels(alert, series["node"], values, {})
        # The alert's context numbers: a counter by the context's labels rising 2 a minute, so
        # 10 in the window; the daemon computes the same from its samples (growth()).
        inputs = []
        context = {}
        for c in alert.context:
            own = {k: series[k] for k in ("job", "instance", "node")}
            own |= {k: labels[k] for k in c.by if k != "node"}
            inputs.append(
                {"series": catalogue.exposed(c.counter) + _selector(own), "values": "0+2x20"}
            )
            rises = collections.deque(
                (60.0 * minute, 2.0 * minute) for minute in range(11)
            )  # to 10m
            context[c.name] = pager_module.growth(rises, 600.0, c.window_seconds)
        assert context == {c.name: 10.0 for c in alert.context}
        # 1 per minute: at 10m the 5m window holds 5..10, an increase of exactly 5.
        tests.append(
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": catalogue.exposed(alert.increase.counter) + _selector(series),
                        "values": "0+1x20",
                    },
                    *inputs,
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "10m",
                        "alertname": alert.name,
                        "exp_alerts": [
                            {
                                "exp_labels": {k: v for k, v in labels.items() if k != "alertname"},
                                "exp_annotations": alert_annotations(alert, labels, 5.0, context),
                            }
                        ],
                    }
                ],
            }
        )
    path = tmp_path / "fast_path_test.yml"
    path.write_text(json.dumps({"rule_files": [str(RULES)], "tests": tests}))
    result = run(tool("promtool"), "test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    # And a label the daemon got wrong would fail: the same test with one label changed.
    broken = json.loads(path.read_text())
    broken["tests"][0]["alert_rule_test"][0]["exp_alerts"][0]["exp_labels"]["role"] = "prefill"
    path.write_text(json.dumps(broken))
    assert run(tool("promtool"), "test", "rules", str(path)).returncode != 0


def test_external_labels_never_override_the_alerts_own() -> None:
    alert = next(a for a in fast_alerts() if a.name == "KVSpoolRecordsLost")
    labels = alert_labels(alert, "n1", {}, {"cluster": "eu", "role": "ignored-by-rule"})
    assert labels == {
        "alertname": "KVSpoolRecordsLost",
        "severity": "critical",
        "node": "n1",
        "cluster": "eu",
        "role": "ignored-by-rule",  # the rule has no role: Prometheus adds the external label
    }
    mismatch = next(a for a in fast_alerts() if a.name == "KVIntegrityMismatch")
    values = {"role": "decode", "detector": "canary", "kind": "unwritten_page"}
    assert alert_labels(mismatch, "n1", values, {"role": "x"})["role"] == "decode"


def test_templates_render_like_prometheus_and_refuse_the_unknown() -> None:
    labels = {"node": "n1"}
    assert render('{{ $labels.node }} saw {{ $value | printf "%.0f" }}', labels, 2.6) == "n1 saw 3"
    assert render("{{ $value }} / {{$value}}", labels, 3.0) == "3 / 3"
    with pytest.raises(ValueError, match="not supported"):
        render("{{ $value | humanizeDuration }}", labels, 1.0)
    for alert in fast_alerts():  # every fast alert's annotations render
        context = {c.name: 7.0 for c in alert.context}
        for text in alert.annotations.values():
            assert "{{" not in render(text, labels, 1.0, context)
    mismatch = next(a for a in fast_alerts() if a.name == "KVIntegrityMismatch")
    assert "1 affected request(s) (incidents) in that time received the KV of 7 other " in (
        render(
            mismatch.description, labels, 1.0, {"exposed_requests": 7.0, "affected_requests": 1.0}
        )
    )


def test_context_growth_is_the_windows_exact_difference() -> None:
    samples = collections.deque([(0.0, 5.0), (100.0, 8.0), (400.0, 12.0)])
    assert pager_module.growth(samples, 420.0, 300.0) == 4.0  # 8 when the window opened
    young = collections.deque([(0.0, 5.0), (100.0, 8.0)])
    assert pager_module.growth(young, 200.0, 300.0) == 3.0  # younger: from its first sample
    assert pager_module.growth(collections.deque([(0.0, 9.0), (10.0, 2.0)]), 20.0, 300.0) == 0.0
    assert pager_module.growth(collections.deque(), 20.0, 300.0) == 0.0


# -- timing, on a clock ---------------------------------------------------------------------------


class Counters:
    """The daemon's mismatch counter as /metrics would serve it, set by the test as a counters
    record read from the spool would set it."""

    def __init__(self) -> None:
        self.value = 0.0
        self.state = State()

    def set(self, value: float) -> None:
        self.value = value
        self.state.daemon[("spool_records", ())] += 1

    def collect(self) -> list[Metric]:
        family = CounterMetricFamily(
            "kvwatch_mismatches", "help", labels=["detector", "role", "kind"]
        )
        family.add_metric(["checksum", "decode", "digest"], self.value)
        return [family]


def _config(**settings: object) -> configuration.Config:
    return configuration.from_mapping(
        {
            "node": "n1",
            "alertmanager_urls": ["http://127.0.0.1:1"],
            "alertmanager_labels": {"cluster": "eu"},
            **settings,
        }
    )


def _pager(counters: Counters, **settings: object) -> Evaluator:
    return Evaluator(_config(**settings), counters.state, counters.collect)


def _notifier(counters: Counters, **settings: object) -> Notifier:
    return Notifier(_config(**settings), counters.state)


def test_fire_resend_quiet_resolve_like_prometheus() -> None:
    counters = Counters()
    pager = _pager(counters)
    assert pager.evaluate(1000.0) == []  # the baseline: no increase yet
    assert pager.evaluate(1001.0) == []
    counters.set(2)
    [firing] = pager.evaluate(1002.0)
    assert firing["labels"] == {
        "alertname": "KVIntegrityMismatch",
        "severity": "critical",
        "node": "n1",
        "role": "decode",
        "detector": "checksum",
        "kind": "digest",
        "cluster": "eu",
    }
    assert (
        "found 2 KV integrity mismatch(es) of kind digest" in (firing["annotations"]["description"])
    )
    assert firing["startsAt"] == "1970-01-01T00:16:42.000Z"
    assert firing["endsAt"] == "1970-01-01T00:20:42.000Z"  # now + 4 x 1m
    assert pager.evaluate(1030.0) == []  # no resend before the resend delay
    [again] = pager.evaluate(1062.0)
    assert again["startsAt"] == firing["startsAt"]
    assert again["endsAt"] == "1970-01-01T00:21:42.000Z"
    # The rule can resolve from (window - scrape interval) after the last rise: the resends stop
    # well before (a late one would re-open a resolved alert), the last endsAt outlasting it.
    after = 15 + 2 * TICK
    ahead = after + MAX_BATCH_AGE
    last = 0.0
    for t in (1122.0, 1182.0, 1242.0):
        [resent] = pager.evaluate(t)
        last = t
    assert last < 1002 + 300 - ahead <= last + 60
    assert pager.evaluate(1302.0) == []  # quiet: a resend would be due
    assert resent["endsAt"] == pager_module._rfc3339(last + 4 * 60)
    assert last + 4 * 60 > 1002 + 300 + after  # alive in Alertmanager until resolved
    assert pager.evaluate(1002 + 300 + after - 1) == []  # still quiet: the rule may still fire
    [resolved] = pager.evaluate(1002 + 300 + after)
    assert resolved["endsAt"] == pager_module._rfc3339(1002 + 300 + after)
    assert "found 2 KV" in resolved["annotations"]["description"]  # the last value, kept
    assert pager.evaluate(1002 + 300 + after + 30) == []
    assert pager.evaluate(1002 + 300 + after + 60) == [resolved]  # resolved is re-sent
    assert pager.evaluate(1002 + 300 + after + 16 * 60) == []  # ... for 15 minutes
    assert pager.trackers == {}


class LayoutCounters(Counters):
    """A layout mismatch on the same detector: its own alert, never KVIntegrityMismatch's."""

    def collect(self) -> list[Metric]:
        family = CounterMetricFamily(
            "kvwatch_mismatches", "help", labels=["detector", "role", "kind"]
        )
        family.add_metric(["checksum", "decode", "layout_mismatch"], self.value)
        family.add_metric(["checksum", "decode", "digest"], 0.0)
        return [family]


def test_a_layout_mismatch_fires_its_own_alert_and_not_the_leak_alert() -> None:
    counters = LayoutCounters()
    pager = _pager(counters)
    assert pager.evaluate(1000.0) == []
    counters.set(1)
    [firing] = pager.evaluate(1002.0)
    assert firing["labels"]["alertname"] == "KVLayoutMismatch"
    assert firing["labels"]["kind"] == "layout_mismatch"
    assert "read wrongly" in firing["annotations"]["description"]


class ExposingCounters(Counters):
    """The mismatch counter and the node's exposed requests (an alert's context)."""

    def __init__(self) -> None:
        super().__init__()
        self.exposed = 0.0

    def collect(self) -> list[Metric]:
        family = CounterMetricFamily("kvwatch_exposed_requests", "help", labels=["role"])
        family.add_metric(["decode"], self.exposed)
        return [*super().collect(), family]


def test_a_firing_alert_whose_counts_moved_is_re_sent_at_once() -> None:
    """A leak's findings can reach the daemon in two polls: the alert that fired stating 4
    exposed requests is re-sent stating 5 at the next evaluation, not a resend delay later, so
    a notification never holds it beside a newer alert of its group that states 5."""
    counters = ExposingCounters()
    pager = _pager(counters)
    assert pager.evaluate(1000.0) == []
    counters.exposed = 4
    counters.set(2)
    [firing] = pager.evaluate(1002.0)
    assert "received the KV of 4 other request(s)" in firing["annotations"]["description"]
    counters.set(2)  # a record read, nothing moved: no resend before the resend delay
    assert pager.evaluate(1003.0) == []
    counters.exposed = 5
    counters.set(2)
    [again] = pager.evaluate(1004.0)
    assert "received the KV of 5 other request(s)" in again["annotations"]["description"]
    assert again["startsAt"] == firing["startsAt"] and again["labels"] == firing["labels"]
    counters.set(2)
    assert pager.evaluate(1005.0) == []


def test_a_new_rise_while_quiet_fires_again_and_a_reset_counts() -> None:
    counters = Counters()
    pager = _pager(counters)
    pager.evaluate(0.0)
    counters.set(1)
    assert len(pager.evaluate(10.0)) == 1
    assert pager.evaluate(300.0) == []  # quiet
    counters.set(2)
    [firing] = pager.evaluate(301.0)  # a new rise inside the quiet phase: asserted at once
    assert firing["startsAt"] == pager_module._rfc3339(10.0)  # the same episode
    assert "found 2 KV" in firing["annotations"]["description"]
    counters.set(1)  # the counter was reset (a producer restarted): 1 new mismatch
    for tracker in pager.trackers.values():
        tracker.last_sent = 0.0  # make the next resend due
    [resent] = pager.evaluate(303.0)  # 0 -> 1 -> 2 -> 1 is an increase of 3, as in PromQL
    assert "found 3 KV" in resent["annotations"]["description"]
    [resent] = pager.evaluate(363.0)  # the rise at 10 s has left the 5m window
    assert "found 2 KV" in resent["annotations"]["description"]


def test_labels_named_like_log_fields_are_posted() -> None:
    """``event`` or ``level`` are valid label names; the firing log line must not choke on them."""
    counters = Counters()
    pager = _pager(counters, alertmanager_labels={"event": "e", "level": "l", "timestamp": "t"})
    pager.evaluate(0.0)
    counters.set(1)
    [firing] = pager.evaluate(1.0)
    assert firing["labels"]["event"] == "e" and firing["labels"]["level"] == "l"


def test_a_daemon_restart_is_no_increase() -> None:
    counters = Counters()
    counters.set(5)  # the journal already holds 5 mismatches
    pager = _pager(counters)
    assert pager.evaluate(0.0) == [] and pager.evaluate(1.0) == []


def test_without_a_new_record_nothing_is_rendered() -> None:
    """The alerts' counters move only when the reader applies a record: until one arrives (and
    while nothing fires) an evaluation does not render the families."""
    counters = Counters()
    calls = []

    def source() -> list[Metric]:
        calls.append(1)
        return counters.collect()

    pager = Evaluator(
        configuration.from_mapping({"alertmanager_urls": ["http://a:1"]}), counters.state, source
    )
    pager.evaluate(0.0)
    pager.evaluate(1.0)
    assert len(calls) == 1  # the baseline only
    counters.set(1)
    assert len(pager.evaluate(2.0)) == 1 and len(calls) == 2
    pager.evaluate(3.0)
    assert len(calls) == 3  # firing: every evaluation looks


def test_ends_at_covers_four_resends() -> None:
    counters = Counters()
    pager = _pager(counters, alertmanager_resend="30s")
    pager.evaluate(0.0)
    counters.set(1)
    [firing] = pager.evaluate(1.0)
    assert firing["endsAt"] == pager_module._rfc3339(1.0 + ENDS_AT_RESENDS * 30)


def test_the_evaluation_reads_the_one_collector_metrics_serves(tmp_path: Path) -> None:
    """No second collector and no text round trip: the evaluator's source is the collector the
    daemon registers for /metrics, and its samples are the ones /metrics serves."""
    from kvwatch.daemon import Daemon
    from kvwatch.expose.metrics import KvwatchCollector

    (tmp_path / "spool").mkdir()
    config = configuration.from_mapping(
        {
            "spool_dir": str(tmp_path / "spool"),
            "journal": str(tmp_path / "j.db"),
            "nvml": False,
            "alertmanager_urls": ["http://127.0.0.1:1"],
        }
    )
    daemon = Daemon(config)
    try:
        [collector] = [
            c for c in daemon.registry._collector_to_names if isinstance(c, KvwatchCollector)
        ]
        source = daemon.evaluator.source
        assert getattr(source, "__self__", None) is collector
        daemon.state.daemon[("findings", ("canary", "decode", "unwritten_page"))] += 1
        served = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in daemon.registry.collect()
            for s in family.samples
            if s.name in daemon.evaluator.families
        }
        evaluated = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in source()
            for s in family.samples
            if s.name in daemon.evaluator.families
        }
        assert served and evaluated == served
    finally:
        daemon.close()


# -- settings -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"alertmanager_urls": ["am:9093"]}, r"not an http\(s\) URL"),
        ({"alertmanager_urls": "http://a:9093"}, "expected a list"),
        ({"alertmanager_labels": {"replica": "a"}}, "leave out 'replica'"),
        ({"alertmanager_labels": {"node": "x"}}, "set by the alert itself"),
        ({"alertmanager_labels": {"9x": "x"}}, "not a Prometheus label name"),
        ({"alertmanager_labels": {"cluster": 1}}, "must be a string"),
        ({"alertmanager_resend": 60}, "no unit"),
        ({"alertmanager_enabled": "false"}, "expected true or false"),
        ({"prometheus_scrape_interval": "soon"}, "not a duration"),
    ],
)
def test_bad_settings_are_one_line_errors(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(configuration.ConfigError, match=message):
        configuration.from_mapping(settings)


def test_disabled_or_without_urls_it_posts_nothing() -> None:
    counters = Counters()
    for settings in ({"alertmanager_enabled": False}, {"alertmanager_urls": []}):
        notifier = _notifier(counters, **settings)
        assert not notifier.enabled
        notifier.start()  # starts no thread
        assert notifier._threads == []


def test_basic_auth_needs_a_readable_password_file(tmp_path: Path) -> None:
    counters = Counters()
    with pytest.raises(configuration.ConfigError, match="needs alertmanager_password_file"):
        _notifier(counters, alertmanager_username="kv")
    with pytest.raises(configuration.ConfigError, match="cannot read it"):
        _notifier(counters, alertmanager_username="kv", alertmanager_password_file=str(tmp_path))
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    notifier = _notifier(
        counters, alertmanager_username="kv", alertmanager_password_file=str(secret)
    )
    assert notifier._headers["Authorization"] == "Basic a3Y6czNjcmV0"


# -- sending, over real HTTP ----------------------------------------------------------------------


def test_posts_every_alertmanager_counts_failures_and_drops_the_oldest_when_full() -> None:
    """A real HTTP server stands in for one Alertmanager, a closed port for a dead one; a
    server that stalls fills its queue and the oldest batches are dropped (counted)."""
    received: list[Any] = []
    release = threading.Event()

    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, json.loads(body)))
            if self.server.server_address[1] == stalled.server_address[1]:
                release.wait(10)
            self.send_response(200)
            self.end_headers()

    live = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    stalled = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    for server in (live, stalled):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    counters = Counters()
    state = counters.state
    config = configuration.from_mapping(
        {
            "node": "n1",
            "alertmanager_urls": [
                f"http://127.0.0.1:{live.server_address[1]}",
                f"http://127.0.0.1:{free_port()}",  # nothing listens: refused
                f"http://127.0.0.1:{stalled.server_address[1]}/",
            ],
            "alertmanager_timeout": "20s",
        }
    )
    notifier = Notifier(config, state)
    pager = Evaluator(config, state, counters.collect, notifier.send)
    pager.start()
    notifier.start()
    try:
        counters.set(1)
        pager.wake()
        deadline = time.monotonic() + 10
        while len(received) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [path for path, _ in received] == ["/api/v2/alerts"] * 2
        # A batch that waited longer than MAX_BATCH_AGE is not sent (it could re-open an alert
        # Prometheus resolved meanwhile), only counted.
        stale = (time.monotonic() - MAX_BATCH_AGE - 1, received[0][1])
        notifier._queues[0].put(stale)
        _wait(
            "the stale batch dropped",
            lambda: state.daemon.get(("alertmanager_posts", ("dropped",))),
            10,
        )
        assert len(received) == 2
        assert received[0][1][0]["labels"]["alertname"] == "KVIntegrityMismatch"
        # The stalled server holds its sender; more batches than the queue holds pile up.
        for i in range(notify.QUEUE_BATCHES + 5):
            counters.set(2 + i)
            for tracker in pager.trackers.values():
                tracker.last_sent = 0.0  # due again at once
            batch = pager.evaluate(time.time())
            assert batch
            notifier.send(batch)
    finally:
        release.set()
        pager.close()
        notifier.close()
        live.shutdown()
        stalled.shutdown()
    posts = {k[1][0]: v for k, v in state.daemon.items() if k[0] == "alertmanager_posts"}
    assert posts["failed"] >= 1
    assert posts["sent"] >= 2
    assert posts["dropped"] >= 5


# -- live: a real daemon, Alertmanager and Prometheus --------------------------------------------

GROUP_WAIT = 2.0
NODE = "decode-3"


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url}: process exited {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


def _query(prometheus: str, promql: str) -> list[dict[str, Any]]:
    reply = http_json(prometheus + "/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
    assert reply["status"] == "success", reply
    result: list[dict[str, Any]] = reply["data"]["result"]
    return result


def _wait(what: str, check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise TimeoutError(what)


@pytest.fixture
def live(tmp_path: Path) -> Iterator[dict[str, Any]]:
    procs: list[subprocess.Popen[bytes]] = []
    webhook = WebhookReceiver()
    daemon: DaemonProcess | None = None
    try:
        am_port = free_port()
        am_config = tmp_path / "alertmanager.yml"
        am_config.write_text(
            "route:\n"
            "  receiver: webhook\n"
            "  group_by: [alertname, node]\n"
            f"  group_wait: {GROUP_WAIT:g}s\n"
            "  group_interval: 2s\n"
            "  repeat_interval: 1h\n"
            "receivers:\n"
            "  - name: webhook\n"
            f"    webhook_configs: [{{url: '{webhook.url}', send_resolved: true}}]\n"
        )
        am = _start(
            [
                tool("prometheus-alertmanager"),
                f"--config.file={am_config}",
                f"--storage.path={tmp_path / 'am-data'}",
                f"--web.listen-address=127.0.0.1:{am_port}",
                "--cluster.listen-address=",
            ],
            tmp_path / "alertmanager.log",
        )
        procs.append(am)
        am_url = f"http://127.0.0.1:{am_port}"
        _ready(am_url + "/-/ready", am)
        settings = tmp_path / "kvwatch.toml"
        settings.write_text(
            f'node = "{NODE}"\n'
            # The real one, and a peer that is down: posted to both, the failure counted.
            f'alertmanager_urls = ["{am_url}", "http://127.0.0.1:{free_port()}"]\n'
            'alertmanager_labels = { cluster = "test" }\n'
            'alertmanager_timeout = "2s"\n'
        )
        daemon = DaemonProcess(tmp_path, "--config", str(settings), "--no-nvml")
        daemon.spool.mkdir(exist_ok=True)
        daemon_port = daemon.wait_started()
        prom_port = free_port()
        prom_config = tmp_path / "prometheus.yml"
        prom_config.write_text(
            json.dumps(
                {
                    # Production intervals: the rule alone pages 15-30 s after the leak.
                    "global": {
                        "scrape_interval": "15s",
                        "evaluation_interval": "15s",
                        "external_labels": {"cluster": "test", "replica": "a"},
                    },
                    "rule_files": [str(RULES)],
                    "alerting": {
                        "alert_relabel_configs": [{"action": "labeldrop", "regex": "replica"}],
                        "alertmanagers": [
                            {"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}
                        ],
                    },
                    "scrape_configs": [
                        {
                            "job_name": "kvwatch",
                            "static_configs": [
                                {
                                    "targets": [f"127.0.0.1:{daemon_port}"],
                                    "labels": {"node": NODE},
                                }
                            ],
                        }
                    ],
                }
            )
        )
        prom = _start(
            [
                tool("prometheus"),
                f"--config.file={prom_config}",
                f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
            tmp_path / "prometheus.log",
        )
        procs.append(prom)
        prom_url = f"http://127.0.0.1:{prom_port}"
        _ready(prom_url + "/-/ready", prom)
        yield {
            "webhook": webhook,
            "daemon": daemon,
            "alertmanager": am_url,
            "prometheus": prom_url,
        }
    finally:
        if daemon is not None:
            daemon.stop()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(15)
        webhook.close()


def _sent_by(prometheus: str) -> float:
    """Alerts Prometheus sent to Alertmanager, from its own /metrics."""
    with urllib.request.urlopen(prometheus + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("prometheus_notifications_sent_total")
    )


def _notified(webhook: WebhookReceiver, alertname: str) -> list[dict[str, Any]]:
    return [
        alert
        for note in list(webhook.notifications)
        for alert in note.alerts()
        if alert["labels"].get("alertname") == alertname
    ]


@pytest.mark.slow
def test_one_notification_for_the_daemon_and_the_rule_and_the_fast_one_first(
    live: dict[str, Any],
) -> None:
    webhook: WebhookReceiver = live["webhook"]
    prometheus: str = live["prometheus"]
    daemon: DaemonProcess = live["daemon"]
    # Prometheus must hold a sample from before the leak, or its increase() never sees one.
    _wait("first scrape", lambda: _query(prometheus, 'up{job="kvwatch"} == 1'), 40)
    writer = SpoolWriter(daemon.spool, engine="sglang", role="decode", model="m")
    assert writer.write("counters", {"counters": [["verifications", {"detector": "checksum"}, 4]]})
    time.sleep(1.0)
    leaked = time.time()
    assert writer.write(
        "counters",
        {
            "counters": [
                ["verifications", {"detector": "checksum"}, 5],
                ["mismatches", {"detector": "checksum", "kind": "digest"}, 1],
            ]
        },
    )
    note, fast = webhook.wait_for("KVIntegrityMismatch", timeout=GROUP_WAIT + 10)
    latency = note.received - leaked
    print(f"\nfast path: leak to webhook {latency:.2f} s (group_wait {GROUP_WAIT:g} s)")
    assert latency <= GROUP_WAIT + 3.0
    # The rule fires too (15 s scrape, 15 s evaluation) and Prometheus sends it ...
    rule = _wait(
        "the rule firing",
        lambda: [
            a
            for a in http_json(prometheus + "/api/v1/alerts")["data"]["alerts"]
            if a["labels"]["alertname"] == "KVIntegrityMismatch" and a["state"] == "firing"
        ],
        60,
    )[0]
    _wait("Prometheus's notification sent", lambda: _sent_by(prometheus) > 0, 30)
    # ... with the labels the daemon posted (external labels, replica dropped): one alert.
    expected = {**rule["labels"], "cluster": "test"}
    assert fast["labels"] == expected
    alerts = http_json(
        live["alertmanager"] + "/api/v2/alerts?filter=alertname%3DKVIntegrityMismatch"
    )
    assert len(alerts) == 1 and alerts[0]["labels"] == expected
    time.sleep(2.0 + 3.0)  # a group_interval and more: a second notification would be here
    assert len(_notified(webhook, "KVIntegrityMismatch")) == 1, webhook.notifications
    scraped = daemon.scrape()
    assert 'kvwatch_alertmanager_posts_total{result="sent"} 1.0' in scraped
    assert 'kvwatch_alertmanager_posts_total{result="failed"} 1.0' in scraped
    writer.close()


TLS = Path(__file__).parents[1] / "tls"
#: bcrypt (cost 4) of "kvwatch-test", for Alertmanager's web config (test-only credentials).
BCRYPT = "$2b$04$Mksv6INlmQmCrKSCFE1viuXdcx2M6BVH52LAMKun6JjSac7h.F5RK"


def test_posts_over_tls_with_basic_auth_to_a_real_alertmanager(tmp_path: Path) -> None:
    """Alertmanager behind its own TLS and basic auth (``--web.config.file``): the daemon's post
    arrives with the right password and the test CA; a wrong password is a counted failure."""
    port = free_port()
    web = tmp_path / "web.yml"
    web.write_text(
        "tls_server_config:\n"
        f"  cert_file: {TLS / 'server.crt'}\n"
        f"  key_file: {TLS / 'server.key'}\n"
        "basic_auth_users:\n"
        f"  kv: '{BCRYPT}'\n"
    )
    config = tmp_path / "am.yml"
    config.write_text("route: {receiver: none}\nreceivers: [{name: none}]\n")
    am = _start(
        [
            tool("prometheus-alertmanager"),
            f"--config.file={config}",
            f"--web.config.file={web}",
            f"--storage.path={tmp_path / 'am-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        tmp_path / "alertmanager.log",
    )
    right, wrong = tmp_path / "right", tmp_path / "wrong"
    right.write_text("kvwatch-test\n")
    wrong.write_text("guess\n")
    try:
        url = f"https://127.0.0.1:{port}"
        settings = {
            "node": "n1",
            "alertmanager_urls": [url],
            "alertmanager_ca_file": str(TLS / "ca.crt"),
            "alertmanager_username": "kv",
        }
        counters = Counters()
        pager = _pager(counters, **settings)
        pager.evaluate(0.0)
        counters.set(1)
        [alert] = pager.evaluate(time.time())
        good = _notifier(counters, **settings, alertmanager_password_file=str(right))
        deadline = time.monotonic() + 30
        while True:  # until Alertmanager answers over TLS
            try:
                good.post(url, [alert])
                break
            except OSError:
                assert am.poll() is None, (tmp_path / "alertmanager.log").read_text()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        bad = _notifier(counters, **settings, alertmanager_password_file=str(wrong))
        with pytest.raises(urllib.error.HTTPError, match="401"):
            bad.post(url, [alert])
        request = urllib.request.Request(
            url + "/api/v2/alerts", headers={"Authorization": good._headers["Authorization"]}
        )
        with urllib.request.urlopen(request, timeout=10, context=good._tls) as reply:
            held = json.load(reply)
        assert [a["labels"] for a in held] == [alert["labels"]]
        # Through the sender thread: the refusal is counted, not raised.
        bad.start()
        paging = Evaluator(_config(**settings), counters.state, counters.collect, bad.send)
        paging.start()
        counters.set(2)
        paging.wake()
        _wait(
            "a failed post",
            lambda: bad.state.daemon.get(("alertmanager_posts", ("failed",))),
            15,
        )
        paging.close()
        bad.close()
    finally:
        am.terminate()
        am.wait(15)
