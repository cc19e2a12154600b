"""The deploy/ examples are valid for the tools that run them: promtool, amtool, VictoriaMetrics'
own flag parser, and the settings the fleet bed relies on are the ones an operator copies."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.alerts.tooling import tool
from tests.fleet import bed
from tests.fleet.bed import DEPLOY, REPO, Intervals, flags, read_default


def duration_s(text: str) -> float:
    """A Go/Prometheus duration (1m, 15s, 500ms, 1h30m) in seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
    assert parts and "".join(n + u for n, u in parts) == text, text
    return sum(float(n) * units[u] for n, u in parts)


def etc_prometheus(tmp_path: Path) -> Path:
    """/etc/prometheus as an operator lays it out: the HA config, the rules, the target files."""
    etc = tmp_path / "etc-prometheus"
    shutil.copytree(DEPLOY / "targets", etc / "targets")
    shutil.copy(DEPLOY / "prometheus-ha.yml", etc)
    shutil.copy(REPO / "alerts" / "kvwatch.rules.yml", etc)
    return etc


def test_promtool_accepts_the_ha_config_with_its_rules_and_targets(tmp_path: Path) -> None:
    etc = etc_prometheus(tmp_path)
    out = subprocess.run(
        [tool("promtool"), "check", "config", str(etc / "prometheus-ha.yml")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WARNING" not in out.stdout + out.stderr  # every file_sd file is there


def test_promtool_rejects_a_broken_target_file(tmp_path: Path) -> None:
    etc = etc_prometheus(tmp_path)
    (etc / "targets" / "kvwatch-broken.json").write_text('[{"targets": "10.0.0.1:29321"}]')
    out = subprocess.run(
        [tool("promtool"), "check", "config", str(etc / "prometheus-ha.yml")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode != 0, out.stdout


def test_promtool_accepts_the_config_the_bed_renders(tmp_path: Path) -> None:
    etc = etc_prometheus(tmp_path)
    (etc / "prometheus-ha.yml").write_text(
        bed.prometheus_config(bed.SHORT, "http://127.0.0.1:8428")
    )
    (etc / "kvwatch.rules.yml").write_text(bed.scaled_rules(bed.SHORT.window_per_5m_s))
    out = subprocess.run(
        [tool("promtool"), "check", "config", str(etc / "prometheus-ha.yml")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rules = (etc / "kvwatch.rules.yml").read_text()
    assert "[10000ms]" in rules and "[20000ms]" in rules and "m]" not in rules


def test_both_replicas_drop_only_the_replica_label_for_alerts_and_remote_write() -> None:
    text = (DEPLOY / "prometheus-ha.yml").read_text()
    assert "replica: ${PROMETHEUS_REPLICA}" in text
    drops = re.findall(r"- action: labeldrop\n\s+regex: (\S+)", text)
    assert drops == ["replica", "replica"]  # alert_relabel_configs, write_relabel_configs
    default = read_default(DEPLOY / "prometheus.default")
    assert "--enable-feature=expand-external-labels" in shlex.split(default["ARGS"])
    # Every evaluation re-sends the firing alerts: a page's alerts state the same counts.
    resend = [
        a for a in shlex.split(default["ARGS"]) if a.startswith("--rules.alert.resend-delay=")
    ]
    assert resend == ["--rules.alert.resend-delay=10s"]
    config = (DEPLOY / "prometheus-ha.yml").read_text()
    assert re.search(r"evaluation_interval: 15s", config)
    assert default["PROMETHEUS_REPLICA"]


def test_amtool_accepts_the_alertmanager_config_the_bed_renders(tmp_path: Path) -> None:
    config = tmp_path / "alertmanager.yml"
    config.write_text(bed.alertmanager_config(bed.SHORT, "http://127.0.0.1:9/"))
    out = subprocess.run(
        [tool("amtool"), "check-config", str(config)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "group_interval: 6000ms" in config.read_text()


def test_the_alertmanager_flags_parse(tmp_path: Path) -> None:
    """Debian's prometheus-alertmanager knows every flag of the example's ARGS (an unknown one
    fails even with --help); the fleet bed runs them, with loopback addresses."""
    config = tmp_path / "alertmanager.yml"
    shutil.copy(REPO / "alerts" / "alertmanager.example.yml", config)
    argv = flags(
        DEPLOY / "prometheus-alertmanager.default",
        {"--config.file": str(config), "--storage.path": str(tmp_path / "data")},
    )
    out = subprocess.run(
        [tool("prometheus-alertmanager"), *argv, "--help"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    bogus = subprocess.run(
        [tool("prometheus-alertmanager"), *argv, "--cluster.no-such-flag=1", "--help"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert bogus.returncode != 0


def test_a_resolved_alert_cannot_refire_from_a_waiting_peer() -> None:
    """Alertmanager (0.25, and upstream issue 2447) re-sends a stale firing notification after a
    resolution when a peer's turn, (peers - 1) x --cluster.peer-timeout, outlasts a
    group_interval: it flushed before the resolution arrived and checks the notification log
    after another peer logged it. Every route of the example, and the bed, keep under it."""
    args = shlex.split(read_default(DEPLOY / "prometheus-alertmanager.default")["ARGS"])
    peers = [a for a in args if a.startswith("--cluster.peer=")]
    timeout = next(a for a in args if a.startswith("--cluster.peer-timeout="))
    turn_s = (len(peers) - 1) * duration_s(timeout.split("=", 1)[1])
    routes = (REPO / "alerts" / "alertmanager.example.yml").read_text()
    intervals = [duration_s(v) for v in re.findall(r"group_interval: (\S+)", routes)]
    assert len(peers) == 3 and intervals
    assert turn_s < min(intervals), (turn_s, intervals)
    for ran in (bed.SHORT, bed.PRODUCTION):
        assert (bed.PEERS - 1) * ran.peer_timeout_s < ran.group_interval_s, ran


@pytest.mark.parametrize("intervals", [bed.SHORT, bed.PRODUCTION])
def test_the_bed_renders_its_intervals(intervals: Intervals) -> None:
    text = bed.prometheus_config(intervals, "http://127.0.0.1:1")
    assert f"scrape_interval: {int(intervals.scrape_s * 1000)}ms" in text
    assert f"evaluation_interval: {int(intervals.evaluation_s * 1000)}ms" in text
    assert "victoria-metrics.example" not in text


def test_victoria_metrics_accepts_the_flags(tmp_path: Path) -> None:
    argv = flags(
        DEPLOY / "victoria-metrics.default",
        {"-storageDataPath": str(tmp_path / "vm"), "-httpListenAddr": "127.0.0.1:0"},
    )
    binary = shutil.which(bed.VICTORIA_BIN)
    if binary is None:
        pytest.fail("victoria-metrics is not installed: make tools installs it", pytrace=False)
    out = subprocess.run(
        [binary, *argv, "-version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_flag_the_bed_sets_must_be_in_the_deploy_file(tmp_path: Path) -> None:
    default = tmp_path / "x.default"
    default.write_text('ARGS="--a=1 --b=2"\n')
    assert flags(default, {"--a": "3", "--b": ["4", "5"]}) == ["--a=3", "--b=4", "--b=5"]
    with pytest.raises(ValueError, match="--c"):
        flags(default, {"--c": "1"})
    with pytest.raises(ValueError, match="not found"):
        bed.substitute("scrape_interval: 30s", {"scrape_interval: 15s": "x"}, source=default)
