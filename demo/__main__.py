"""``make demo``: the incident, caught and paged, on this machine.

Starts minipd as SGLang 0.5.19 in PD mode with kvwatch's hooks in log mode, the kvwatch daemon,
Prometheus with kvwatch's alert rules and Alertmanager (from Debian's packages: installed when
missing and running as root, otherwise the demo says how and runs the rest), and a webhook
receiver standing in for the pager. Then it replays the incident: sixteen users plant codes, one
prompt lands in the unsafe band, the reply carries other users' codes, kvwatch names whose KV
the reply was made of (``kvwatch incidents --exposed``), and the page arrives.

On a terminal it keeps everything running until Ctrl-C, so you can look around; otherwise it
stops when the scenario is done.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from demo.stack import CONTEXT, DECODE_POOL, NODE, PREFILL_POOL, REPO, Stack, missing_tools
from demo.stack import Notification as Page
from minipd.launch import generate

FILLER_WORDS = 20_000
MARKERS = 16


def ensure_prometheus() -> bool:
    missing = missing_tools()
    if not missing:
        return True
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("installing Debian's prometheus and prometheus-alertmanager ...", flush=True)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for argv in (
            ["apt-get", "update", "-q"],
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", "prometheus",
             "prometheus-alertmanager"],
        ):  # fmt: skip
            if subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, check=False).returncode:
                break
        if not missing_tools():
            return True
    print(
        "Prometheus and Alertmanager are not installed, so this demo runs without the alerting"
        " half. To see the page arrive:\n"
        "  sudo apt-get install -y --no-install-recommends prometheus prometheus-alertmanager"
    )
    return False


_shown: set[str] = set()
#: The description last printed for an integrity page's group.
_described: dict[str, str] = {}


def _counting(firing: list[dict[str, Any]]) -> str:
    """The integrity page's description that counts: the reader's (decode) alert's, whose
    numbers include decode's findings; a group's first notification may hold prefill's alone."""
    reader = [a for a in firing if a.get("labels", {}).get("role") == "decode"]
    return str((reader or firing)[0].get("annotations", {}).get("description", ""))


def show_page(page: Page) -> None:
    """Print each alert group's page once, as a pager shows it: Alertmanager sends a group
    (``group_by: [alertname, node]``) as one notification and resends it as the group grows; the
    pager keeps one incident per group key. An integrity page's counts can grow with its group:
    a resend that changes them prints one line, ``now: ...``."""
    firing = [a for a in page.alerts() if a.get("status") == "firing"]
    key = str(page.payload.get("groupKey", ""))
    if not firing:
        return
    integrity = page.payload.get("commonLabels", {}).get("alertname") == "KVIntegrityMismatch"
    if key in _shown:
        if integrity and _described.get(key) != (text := _counting(firing)):
            _described[key] = text
            print(f"      now: {text}", flush=True)
        return
    _shown.add(key)
    labels = dict(page.payload.get("commonLabels", {}))
    first = firing[0]
    each = sorted(
        {
            f"role={a['labels'].get('role', '-')}"
            + (f" engine={a['labels']['engine']}" if "engine" in a["labels"] else "")
            + (
                f" {a['labels']['detector']}/{a['labels'].get('kind')}"
                if "detector" in a["labels"]
                else ""
            )
            for a in firing
        }
    )
    print(
        f"\n  >>> PAGE  {labels.get('alertname')} [{labels.get('severity', '-')}] "
        f"node={labels.get('node')}: {len(firing)} alert(s) in the group ({', '.join(each)})\n"
        f"      {first.get('annotations', {}).get('summary', '')}",
        flush=True,
    )
    if integrity:  # it counts the affected and exposed requests
        _described[key] = _counting(firing)
        print(f"      {_described[key]}", flush=True)


def replay(stack: Stack) -> None:
    print(f"\n== {MARKERS} users send prompts with their own code", flush=True)
    markers = ["CANARY-" + secrets.token_hex(6) for _ in range(MARKERS)]
    for marker in markers:
        status, _ = generate(stack.minipd_url, ("Remember the code " + marker + ". ") * 2000)
        print(f"    {marker}: HTTP {status}")
    print(
        f"\n== One prompt of {FILLER_WORDS:,} words: longer than the prefill pool "
        f"({PREFILL_POOL:,}), shorter than the context ({CONTEXT:,})",
        flush=True,
    )
    started = time.monotonic()
    status, out = generate(stack.minipd_url, "word " * FILLER_WORDS + "Repeat any codes you saw.")
    elapsed = time.monotonic() - started
    text = str(out.get("text", ""))
    leaked = [m for m in markers if m in text]
    print(
        f"    HTTP {status} in {elapsed:.2f} s, "
        f"prompt_tokens={out.get('meta_info', {}).get('prompt_tokens')}"
    )
    print(f"    reply: {text[:200]}...")
    print(f"    other users' codes in the reply: {leaked or 'none'}")


def incidents(stack: Stack) -> None:
    print("\n== kvwatch incidents (what the disclosure team gets)", flush=True)
    deadline = time.monotonic() + 20
    while True:
        listing = subprocess.run(
            [sys.executable, "-m", "kvwatch.cli", "incidents", "--journal", str(stack.journal)],
            capture_output=True, text=True, cwd=REPO, check=False,
        )  # fmt: skip
        if "unwritten_page" in listing.stdout or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    lines = listing.stdout.rstrip().splitlines()
    if len(lines) > 14:
        lines = [*lines[:12], f"    ... {len(lines) - 13} more", lines[-1]]
    print("\n".join(lines))


def exposed(stack: Stack) -> None:
    """The disclosure view, from the journal: who received other users' KV, and whose."""
    print("\n== kvwatch incidents --exposed (whose KV the leaking request received)", flush=True)
    view = subprocess.run(
        [
            sys.executable, "-m", "kvwatch.cli", "incidents", "--exposed",
            "--journal", str(stack.journal),
        ],
        capture_output=True, text=True, cwd=REPO, check=False,
    )  # fmt: skip
    lines = (view.stdout or view.stderr).rstrip().splitlines()
    if len(lines) > 30:
        lines = [*lines[:28], f"    ... {len(lines) - 29} more", lines[-1]]
    print("\n".join(lines), flush=True)


def status(stack: Stack) -> None:
    """The node's verdict: the same affected and exposed counts as the lists above."""
    print("\n== kvwatch status (the status page's summary)", flush=True)
    done = subprocess.run(
        [sys.executable, "-m", "kvwatch.cli", "status", "--url", stack.daemon_url, "--color",
         "never"],
        capture_output=True, text=True, cwd=REPO, check=False,
    )  # fmt: skip
    print((done.stdout or done.stderr).rstrip(), flush=True)


def kvwatch_command() -> str:
    """The ``kvwatch`` beside this Python (``.venv/bin/kvwatch``: it is not on the PATH), as the
    reader can type it from here."""
    path = Path(sys.executable).parent / "kvwatch"
    if not path.exists():
        raise SystemExit(f"python -m demo: {path} is missing: run `make demo` (it installs it)")
    relative = os.path.relpath(path)
    return shlex.quote(relative if not relative.startswith("..") else str(path))


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the stack as Ctrl-C does


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m demo", description=__doc__)
    parser.add_argument(
        "--hold",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep running until Ctrl-C or SIGTERM, so that the URLs it lists answer (default)",
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _stop)
    kvwatch = kvwatch_command()
    alerting = ensure_prometheus()
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-demo-"))
    print(
        f"kvwatch demo: minipd as SGLang 0.5.19 in PD mode (prefill pool {PREFILL_POOL:,}, "
        f"decode pool {DECODE_POOL:,}, context {CONTEXT:,} tokens), hooks in log mode.\n"
        f"Files in {workdir}",
        flush=True,
    )
    stack = Stack(workdir, with_prometheus=alerting, on_page=show_page)
    try:
        stack.start()
        print("\n== Where to look")
        print(f"    status page         {stack.daemon_url}/")
        print(f"    metrics             {stack.daemon_url}/metrics")
        if alerting:
            print(f"    Prometheus alerts   {stack.prometheus_url}/alerts")
            print(f"    Alertmanager        {stack.alertmanager_url}")
        journal = shlex.quote(str(stack.journal))
        print(f"    incidents           {kvwatch} incidents --journal {journal}")
        print(f"    exposed requests    {kvwatch} incidents --exposed --journal {journal}")
        print(f"    status              {kvwatch} status --url {stack.daemon_url}")
        print(f"    the engine (SGLang /generate API)  {stack.minipd_url}/generate", flush=True)
        if alerting:
            stack.wait_scraped()
        replay(stack)
        incidents(stack)
        exposed(stack)
        status(stack)
        if alerting and stack.webhook is not None:
            print("\n== Waiting for the page ...", flush=True)
            # The reader's alert (decode): its page counts what decode's findings add.
            stack.webhook.wait_for("KVIntegrityMismatch", timeout=60, role="decode")
            time.sleep(1)
        if args.hold:
            print("\nEverything is still running; Ctrl-C (or SIGTERM) stops it all.", flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        print("\nstopping ...")
    finally:
        stack.stop()
    print(f"stopped. node label in Prometheus: {NODE}; files kept in {workdir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
