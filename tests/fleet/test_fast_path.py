"""The fast path in the fleet, with production intervals (15 s scrape, 15 s evaluation, 10 s
group_wait): each daemon posts its alerts to every Alertmanager peer itself
(deploy/kvwatch-fleet.toml), so a leak pages within group_wait + 3 s instead of up to 40 s; when
both Prometheus replicas fire the same alert later, Alertmanager merges it with the daemon's and
the group still gets exactly one notification.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Iterator

import pytest

from demo.stack import http_json
from tests.fleet.bed import PEERS, PRODUCTION, REPLICAS, Fleet
from tests.fleet.pages import ALERT, expected_labels, group, sent_to, wait_group

pytestmark = pytest.mark.slow  # real processes: about a minute each, still in make test


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    started = time.monotonic()
    with Fleet(tmp_path_factory.mktemp("fleet-fast"), PRODUCTION, fast_path=True) as running:
        print(f"\nfleet bed up in {running.started_s:.1f} s: {running.intervals.describe()}")
        yield running
    print(f"\nfast path module wall time {time.monotonic() - started:.1f} s")


def alerts_in_group(fleet: Fleet, am: str, node: str) -> list[dict[str, str]]:
    """The alerts one Alertmanager peer holds in the (alertname, node) group, by labels."""
    query = urllib.parse.urlencode({"filter": [f'alertname="{ALERT}"', f'node="{node}"']}, True)
    groups = http_json(fleet.urls[am] + "/api/v2/alerts/groups?" + query)
    return [alert["labels"] for g in groups for alert in g["alerts"]]


def test_a_leak_pages_within_group_wait_and_once_when_the_rule_fires_too(fleet: Fleet) -> None:
    intervals = fleet.intervals
    assert fleet.webhook is not None and fleet.webhook.notifications == []
    before = {replica: sum(sent_to(fleet, replica).values()) for replica in REPLICAS}
    leaked = fleet.node("node-4").producers["decode"].leak("fleet-fast-1")
    note = wait_group(fleet, "node-4", "firing", intervals.group_wait_s + 20)
    latency = note.received - leaked
    print(
        f"fast path: leak to webhook {latency:.2f} s (group_wait {intervals.group_wait_s:g} s; "
        f"the rule path's budget {intervals.budget_s:g} s)"
    )
    assert latency <= intervals.group_wait_s + 3
    assert [a["labels"] for a in note.alerts()] == [expected_labels("node-4")]

    # The rule fires on both replicas and each sends it to the peers: the daemon's alert and
    # theirs must be one alert (same labels) in one group on every peer.
    fleet.until(
        f"{ALERT} for node-4 firing on both replicas",
        lambda: all(fleet.firing(replica, ALERT, "node-4") for replica in REPLICAS),
        intervals.scrape_s + 2 * intervals.evaluation_s + 15,
    )
    fleet.until(
        "both replicas sent their alert",
        lambda: all(sum(sent_to(fleet, r).values()) > before[r] for r in REPLICAS),
        intervals.evaluation_s + 10,
    )
    rule_fired = time.time()
    for i in range(PEERS):
        held = alerts_in_group(fleet, f"am-{i}", "node-4")
        assert held == [expected_labels("node-4")], (f"am-{i}", held)
    # A second alert in the group would be notified at the next group_interval; a duplicate
    # from a later peer within its turn.
    time.sleep(intervals.group_interval_s + (PEERS - 1) * intervals.peer_timeout_s + 2)
    firing = group(fleet, "node-4", "firing")
    assert len(firing) == 1, [json.dumps(n.payload)[:500] for n in firing]
    print(
        f"the rule fired on both replicas {rule_fired - leaked:.1f} s after the leak; "
        f"still one notification {time.time() - leaked:.1f} s after it"
    )
