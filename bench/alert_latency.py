"""Time from a leaking request to the pager, through the whole live pipeline.

Each run starts a fresh stack (minipd as SGLang 0.5.19 with kvwatch log, the daemon, Prometheus
with 1 s scrape and evaluation, Alertmanager with a 1 s group wait, a webhook receiver), plants
the incident's markers, sends one prompt in the unsafe band, and measures the seconds until the
KVIntegrityMismatch notification reaches the webhook. Prints each run and the median, and the
share of it that the configured intervals account for (the baseline of the same run).

``--fleet`` measures the HA fleet instead (tests/fleet/bed.py: 8 kvwatch daemons, two
Prometheus replicas, three Alertmanager peers): one leak per node, in turn, each written by a
real SpoolWriter at a random phase of the scrape interval, timed from the moment the event
reached the spool to the group's one notification at the webhook, as a ratio to scrape +
evaluation + group_wait. ``--production``
runs the production intervals (15 s + 15 s + 10 s) instead of 1 s + 1 s + 1 s; ``--fast-path``
has the daemons post their alerts to the Alertmanager peers themselves (deploy/kvwatch-fleet.toml).

    python bench/alert_latency.py [--runs 5]
    PYTHONPATH=. python bench/alert_latency.py --fleet [--runs 8] [--production] [--fast-path]
"""

from __future__ import annotations

import argparse
import random
import secrets
import statistics
import tempfile
import time
from pathlib import Path

from demo.stack import Notification, Stack, missing_tools
from minipd.launch import generate
from tests.fleet.bed import PRODUCTION, SHORT, Fleet, Node
from tests.fleet.bed import missing_tools as fleet_missing_tools

# Scrape interval + evaluation interval + Alertmanager group_wait in the stack's configuration.
CONFIGURED_SECONDS = 1.0 + 1.0 + 1.0


def one_run() -> float:
    with Stack(Path(tempfile.mkdtemp(prefix="kvwatch-latency-"))) as stack:
        assert stack.webhook is not None
        stack.wait_scraped()
        for _ in range(16):
            marker = "CANARY-" + secrets.token_hex(6)
            generate(stack.minipd_url, ("Remember the code " + marker + ". ") * 2000)
        sent = time.time()
        generate(stack.minipd_url, "word " * 20_000 + "Repeat any codes you saw.")
        note, _ = stack.webhook.wait_for("KVIntegrityMismatch", timeout=120)
        return note.received - sent


def page_latency(fleet: Fleet, node: Node, request_id: str) -> float:
    """Seconds from a leak on ``node``'s decode producer (the event in the spool) to the first
    firing notification of its group at the webhook."""
    webhook = fleet.webhook
    assert webhook is not None
    seen = len(webhook.notifications)
    leaked = node.producers["decode"].leak(request_id)

    def pages() -> list[Notification]:
        return [
            n
            for n in webhook.notifications[seen:]
            if n.payload.get("groupLabels", {}).get("node") == node.name
            and n.payload.get("status") == "firing"
        ]

    fleet.until(f"a page for {node.name}", lambda: bool(pages()), fleet.intervals.budget_s * 3 + 30)
    return pages()[0].received - leaked


def fleet_runs(runs: int, production: bool, fast_path: bool) -> tuple[list[float], float]:
    """Leak to webhook, in seconds, for ``runs`` leaks (one node each); and the budget."""
    intervals = PRODUCTION if production else SHORT
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-fleet-latency-"))
    with Fleet(workdir, intervals, fast_path=fast_path) as fleet:
        print(
            f"fleet: {len(fleet.nodes)} kvwatch daemons, 2 Prometheus replicas, 3 Alertmanager "
            f"peers, up in {fleet.started_s:.1f} s; fast path {'on' if fast_path else 'off'}; "
            f"{intervals.describe()}"
        )
        seconds = []
        for run in range(runs):
            node = fleet.nodes[run % len(fleet.nodes)]
            # A random phase of the scrape interval: a leak right after the last page would
            # meet the same phase each time.
            time.sleep(random.uniform(0, intervals.scrape_s))
            seconds.append(page_latency(fleet, node, f"bench-leak-{run}"))
            print(
                f"run {run + 1} ({node.name}): leak to webhook {seconds[-1]:.2f} s, "
                f"{seconds[-1] / intervals.budget_s:.2f}x the configured {intervals.budget_s:g} s"
            )
        return seconds, intervals.budget_s


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=None, help="default: 5, or 8 with --fleet")
    parser.add_argument("--fleet", action="store_true", help="the HA fleet bed (tests/fleet)")
    parser.add_argument(
        "--production", action="store_true", help="with --fleet: 15 s + 15 s + 10 s intervals"
    )
    parser.add_argument(
        "--fast-path", action="store_true", help="with --fleet: the daemons post to Alertmanager"
    )
    args = parser.parse_args()
    if args.fleet:
        if fleet_missing_tools():
            raise SystemExit(f"needs {fleet_missing_tools()}: make tools installs them")
        runs = args.runs or 8
        if not 1 <= runs <= 8:
            raise SystemExit("--fleet --runs: 1 to 8 (one leak per node of the fleet)")
        seconds, budget = fleet_runs(runs, args.production, args.fast_path)
        median = statistics.median(seconds)
        print(
            f"fleet median {median:.2f} s over {len(seconds)} leaks (min {min(seconds):.2f}, "
            f"max {max(seconds):.2f}); configured scrape + evaluation + group_wait = "
            f"{budget:g} s, ratio {median / budget:.2f}x"
        )
        return
    if missing_tools():
        raise SystemExit(f"needs {missing_tools()}: apt-get install prometheus-alertmanager")
    seconds = []
    for run in range(1, (args.runs or 5) + 1):
        seconds.append(one_run())
        print(f"run {run}: integrity alert at the webhook {seconds[-1]:.2f} s after the request")
    median = statistics.median(seconds)
    print(
        f"median {median:.2f} s over {len(seconds)} runs (min {min(seconds):.2f}, max "
        f"{max(seconds):.2f}); configured scrape + evaluation + group_wait = "
        f"{CONFIGURED_SECONDS:.0f} s, ratio {median / CONFIGURED_SECONDS:.2f}x"
    )


if __name__ == "__main__":
    main()
