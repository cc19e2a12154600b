"""Time from a leaking request to the pager, through the whole live pipeline.

Each run starts a fresh stack (minipd as SGLang 0.5.19 with kvwatch log, the daemon, Prometheus
with 1 s scrape and evaluation, Alertmanager with a 1 s group wait, a webhook receiver), plants
the incident's markers, sends one prompt in the unsafe band, and measures the seconds until the
KVIntegrityMismatch notification reaches the webhook. Prints each run and the median, and the
share of it that the configured intervals account for (the baseline of the same run).

    python bench/alert_latency.py [--runs 5]
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import tempfile
import time
from pathlib import Path

from demo.stack import Stack, missing_tools
from minipd.launch import generate

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if missing_tools():
        raise SystemExit(f"needs {missing_tools()}: apt-get install prometheus-alertmanager")
    seconds = []
    for run in range(1, args.runs + 1):
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
