"""alerts/alertmanager.example.yml: amtool accepts it and it routes kvwatch's alerts by severity."""

from __future__ import annotations

import pytest

from alerts import definitions
from tests.alerts.tooling import ALERTS, run, tool

CONFIG = ALERTS / "alertmanager.example.yml"
RECEIVER = {"critical": "kvwatch-pagerduty", "warning": "kvwatch-chat", "info": "kvwatch-chat"}


def test_amtool_check_config() -> None:
    result = run(tool("amtool"), "check-config", str(CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    assert "inhibit rules" in result.stdout


@pytest.mark.parametrize("alert", definitions.ALERTS, ids=lambda a: a.name)
def test_every_alert_routes_by_severity(alert: definitions.Alert) -> None:
    result = run(
        tool("amtool"),
        "config",
        "routes",
        "test",
        f"--config.file={CONFIG}",
        f"--verify.receivers={RECEIVER[alert.severity]}",
        f"alertname={alert.name}",
        f"severity={alert.severity}",
        "node=n1",
        "role=decode",
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_grouping_and_inhibition_are_present() -> None:
    text = CONFIG.read_text(encoding="utf-8")
    assert "group_by: [alertname, node]" in text
    assert "inhibit_rules:" in text and "equal: [node]" in text
    assert "pagerduty_configs:" in text and "webhook_configs:" in text
