"""The Prometheus rules: generated from their source, valid, unit-tested by promtool, documented."""

from __future__ import annotations

import re
from pathlib import Path

from alerts import definitions, generate
from tests.alerts.tooling import ALERTS, REPO, run, tool

RULES = ALERTS / "kvwatch.rules.yml"
UNIT_TESTS = sorted((ALERTS / "tests").glob("*.yml"))


def test_committed_files_match_their_source(tmp_path: Path) -> None:
    """Regenerate into a scratch root and compare byte for byte with what is committed."""
    assert generate.main(["--root", str(tmp_path)]) == 0
    for rel in generate.render():
        fresh = (tmp_path / rel).read_text(encoding="utf-8")
        committed = (REPO / rel).read_text(encoding="utf-8")
        assert committed == fresh, f"{rel} is stale: run `python -m alerts.generate`"
    assert generate.main(["--check"]) == 0


def test_promtool_check_rules() -> None:
    result = run(tool("promtool"), "check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    n_rules = len(definitions.ALERTS) + len(definitions.RECORDING_RULES)
    assert f"SUCCESS: {n_rules} rules found" in result.stdout


def test_prometheus_example_config_loads_the_rules() -> None:
    result = run(tool("promtool"), "check", "config", str(ALERTS / "prometheus.example.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    assert UNIT_TESTS, "no promtool unit tests under alerts/tests/"
    result = run(tool("promtool"), "test", "rules", *map(str, UNIT_TESTS))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "FAILED" not in output
    assert output.count("SUCCESS") == len(UNIT_TESTS), output


def _cases() -> dict[str, set[str]]:
    """alertname -> {"fires", "silent"}: which kinds of promtool cases exist for it."""
    cases: dict[str, set[str]] = {}
    for path in UNIT_TESTS:
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"\s*alertname:\s*(\w+)\s*$", line)
            if not m:
                continue
            following = lines[i + 1].strip()
            kind = "silent" if following == "exp_alerts: []" else "fires"
            if kind == "fires":
                assert following == "exp_alerts:", f"{path.name}:{i + 2}: {following!r}"
                block = "\n".join(lines[i + 2 : i + 30])
                assert "exp_labels:" in block and "exp_annotations:" in block
                assert "description:" in block and "runbook_url:" in block
            cases.setdefault(m.group(1), set()).add(kind)
    return cases


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    cases = _cases()
    for alert in definitions.ALERTS:
        assert cases.get(alert.name) == {"fires", "silent"}, (
            f"{alert.name}: promtool cases {sorted(cases.get(alert.name, ()))}; "
            "need one that fires (labels and annotations checked) and one that must not"
        )
    assert set(cases) <= {a.name for a in definitions.ALERTS}, "tests name an unknown alert"


def test_alerts_follow_the_mixin_conventions() -> None:
    names = [a.name for a in definitions.ALERTS]
    assert len(names) == len(set(names))
    for alert in definitions.ALERTS:
        assert re.fullmatch(r"(?:[A-Z][a-z0-9]*|KV)+", alert.name), alert.name
        assert alert.severity in definitions.SEVERITIES
        assert "{{" not in alert.summary, f"{alert.name}: summary must be fixed text"
        assert "$labels.node" in alert.description, f"{alert.name}: description names no node"
        assert "$value" in alert.description, f"{alert.name}: description has no value"
        assert "role" in alert.description, f"{alert.name}: description names no role"
        assert alert.runbook_url == f"{definitions.RUNBOOK_BASE}#{alert.name.lower()}"
        if alert.severity == "critical" and alert.name in {
            "KVIntegrityMismatch",
            "KVLayoutMismatch",
            "KVAbortedRequestAdmitted",
            "KVSpoolRecordsLost",
        }:
            assert not alert.for_, f"{alert.name} must fire at once"
    required = {
        "KVIntegrityMismatch": "critical",
        "KVLayoutMismatch": "critical",
        "KVPoolSmallerThanContext": "critical",
        "KVAbortedRequestAdmitted": "critical",
        "KVSpoolRecordsLost": "critical",
        "KVEngineReleaseVulnerable": "critical",
        "KVEngineReleaseSkew": "warning",
        "KVDetectorVerifyingNothing": "warning",
        "KVWatchDaemonDown": "warning",
        "KVHooksSilent": "warning",
    }
    severities = {a.name: a.severity for a in definitions.ALERTS}
    for name, severity in required.items():
        assert severities.get(name) == severity, name


def test_runbook_has_a_section_per_alert() -> None:
    text = (ALERTS / "runbook.md").read_text(encoding="utf-8")
    sections = dict(
        (m.group(1), m.group(2))
        for m in re.finditer(r"^## (\S+)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    )
    for alert in definitions.ALERTS:
        body = sections.get(alert.name)
        assert body is not None, f"alerts/runbook.md has no '## {alert.name}' section"
        for part in ("**What it means.**", "Confirm", "**What to do first.**"):
            assert part in body, f"{alert.name}: runbook section lacks {part!r}"
        assert "kvwatch" in body or "```promql" in body
    assert "## Alert latency" in text and "group_wait" in text
    assert "kvwatch incidents --since 1h" in text and "kvwatch check-logs" in text
