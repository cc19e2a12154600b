"""What the webhook, the replicas and the peers say about a page: the fleet tests' helpers."""

from __future__ import annotations

import re
import urllib.request

from demo.stack import Notification
from tests.fleet.bed import Fleet

ALERT = "KVIntegrityMismatch"


def group(fleet: Fleet, node: str, status: str) -> list[Notification]:
    """The webhook notifications of the (alertname, node) group with this status."""
    assert fleet.webhook is not None
    return [
        note
        for note in list(fleet.webhook.notifications)
        if note.payload.get("groupLabels") == {"alertname": ALERT, "node": node}
        and note.payload.get("status") == status
    ]


def wait_group(fleet: Fleet, node: str, status: str, timeout: float) -> Notification:
    fleet.until(
        f"a {status} {ALERT} notification for {node}",
        lambda: bool(group(fleet, node, status)),
        timeout,
    )
    return group(fleet, node, status)[0]


def expected_labels(node: str) -> dict[str, str]:
    """The rule's labels for the leak the bed plants: no ``replica``, nothing else."""
    return {
        "alertname": ALERT, "node": node, "role": "decode", "detector": "canary",
        "kind": "unwritten_page", "severity": "critical",
    }  # fmt: skip


def sent_to(fleet: Fleet, replica: str) -> dict[str, float]:
    """prometheus_notifications_sent_total per Alertmanager, from the replica's own /metrics."""
    with urllib.request.urlopen(fleet.urls[replica] + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = re.findall(r'prometheus_notifications_sent_total\{alertmanager="([^"]+)"\} (\S+)', text)
    return {url: float(value) for url, value in found}


def _peer_sample(fleet: Fleet, am: str, pattern: str) -> float | None:
    with urllib.request.urlopen(fleet.urls[am] + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else None


def notifications_sent(fleet: Fleet, am: str) -> float:
    """alertmanager_notifications_total for the webhook integration, from the peer's /metrics."""
    found = _peer_sample(
        fleet, am, r'^alertmanager_notifications_total\{integration="webhook"\} (\S+)'
    )
    return found or 0.0


def peer_position(fleet: Fleet, am: str) -> int:
    """alertmanager_peer_position: the peer's place in the cluster's send order (0 sends first,
    position N waits N x peer_timeout and sends only if the notification log has no entry)."""
    found = _peer_sample(fleet, am, r"^alertmanager_peer_position (\S+)")
    assert found is not None, f"{am} exports no alertmanager_peer_position"
    return int(found)
