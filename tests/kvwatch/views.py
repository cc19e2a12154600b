"""Everything an operator reads, rendered from a daemon's state and journal: ``/metrics``, the
status page and ``kvwatch incidents`` (table and JSON). A record that broke one of them would
be a record that silences kvwatch for everyone."""

from __future__ import annotations

import io
import math
import re
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from kvspool import Source
from kvwatch.commands import incidents as views
from kvwatch.expose import page
from kvwatch.expose import status as statuspage
from kvwatch.expose.metrics import KvwatchCollector
from kvwatch.store import incident as incidents
from kvwatch.store.incident import Finding
from kvwatch.store.journal import Journal
from kvwatch.store.state import State

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def render_all(state: State, journal: Journal) -> str:
    """Render every view; raises if any fails. Returns the /metrics text, every value finite."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvwatchCollector(state))
    text = generate_latest(registry).decode()
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            assert math.isfinite(float(match.group(3))), line
    rows = incidents.group(journal.incidents())
    alarm = statuspage.alarm(journal, statuspage.AlarmSettings(until_ack=True))
    html = page.render(state, alarm, rows[-20:][::-1], acks=journal.acks())
    assert "<html" in html.lower()
    out = io.StringIO()
    views.render(rows, out, as_json=False)
    views.render(rows, out, as_json=True)
    assert f"{len(rows)} incident(s)" in out.getvalue()
    views.exposure(rows, since=None, until=None)
    return text


def sample(text: str, name: str, labels: str = "") -> float:
    """One sample's value from /metrics text (0 when absent)."""
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) == name and (match.group(2) or "") == labels:
            return float(match.group(3))
    return 0.0


def as_finding(row: dict[str, Any]) -> Finding:
    """A finding written as the views show it (``time``, sources as dicts)."""
    fields = dict(row)
    fields["ts"] = fields.pop("time")
    fields["sources"] = [Source(**source) for source in fields["sources"]]
    return Finding(**fields)
