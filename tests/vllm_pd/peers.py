"""The daemon's view of a decode server's spool, for the PD bed (run with the project's .venv:
the bed's vLLM venv has no daemon dependencies).

Ingests the spool into a fresh journal with kvwatch's own spool reader, renders /metrics with
its collector, and prints ``kvwatch_transfer_mismatches_total`` by peer as JSON. With
``--promtool``, also feeds those values to kvwatch's alert rules (``promtool test rules``, a
series per peer that rises from 0 to its value) and prints which peers
``KVTransferPeerMismatches`` names.

Usage: python peers.py SPOOL NODE [--promtool]
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.expose.metrics import KvwatchCollector
from kvwatch.ingest.spool.reader import SpoolReader
from kvwatch.store.journal import Journal

ROOT = Path(__file__).resolve().parents[2]
ALERT = "KVTransferPeerMismatches"


def peers(spool: Path, node: str, work: Path) -> dict[str, float]:
    journal = Journal(work / "journal.db")
    state = journal.load()
    reader = SpoolReader(spool, journal, state, idle_grace=3600.0, node=node)
    reader.clock_past = float("inf")
    reader.poll()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvwatchCollector(state))
    text = generate_latest(registry).decode()
    journal.close()
    family = next(
        f for f in text_string_to_metric_families(text) if f.name == "kvwatch_transfer_mismatches"
    )
    return {s.labels["peer"]: s.value for s in family.samples}


def alerted(values: dict[str, float], node: str, work: Path) -> list[str]:
    """The peers the alert rule names when each peer's counter rose to its value: promtool is
    told to expect no alert, and its report of what fired instead is read."""
    series = [
        f"      - series: 'kvwatch_transfer_mismatches_total"
        f'{{job="kvwatch",node="{node}",peer="{peer}"}}\'\n'
        f"        values: '0x2 {value:g}x10'"
        for peer, value in sorted(values.items())
    ]
    case = work / "case.yml"
    case.write_text(
        f"rule_files:\n  - {ROOT / 'alerts' / 'kvwatch.rules.yml'}\n"
        "evaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n"
        + "\n".join(series)
        + f"\n    alert_rule_test:\n      - eval_time: 5m\n        alertname: {ALERT}\n"
        "        exp_alerts: []\n"
    )
    run = subprocess.run(
        ["promtool", "test", "rules", str(case)], capture_output=True, text=True, check=False
    )
    report = run.stdout + run.stderr
    got = report.split("got:", 1)[1] if "got:" in report else ""
    return sorted(set(re.findall(r'peer="([^"]+)"', got)))


def main(argv: list[str]) -> int:
    spool, node = Path(argv[0]), argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        values = peers(spool, node, Path(tmp))
        out: dict[str, object] = {"peers": values}
        if "--promtool" in argv:
            out["alerted"] = alerted(values, node, Path(tmp))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
