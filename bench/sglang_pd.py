"""kvwatch's cost inside a real SGLang 0.5.23 PD deployment on CPU: decode time per output token
with and without kvwatch, as a ratio (issue 24).

Run (root, after ``bash tests/sglang_pd/setup_env.sh``):
``build/sglang-venv/bin/python bench/sglang_pd.py [--rounds R] [--tokens N]
[--transport mooncake_tcp|nixl] [--page-size P]``. Re-runs itself inside a fresh loopback-only
network namespace, as the bed does (tests/sglang_pd/README.md).

One prefill server (kvwatch in log mode, so both decodes receive sealed transfers alike) and two
decode servers side by side: one with kvwatch in log mode, one without (only the CPU shims).
Each round sends the same prompt to each decode server, in alternating order, and streams the
reply: decode's time per output token (TPOT, what a streaming client sees between tokens) is
the time from the first streamed token to the last over the tokens between them, so prefill,
the transfer and admission (which swing by a second on a 2-core machine running three
schedulers) are outside it. Each figure is the median over rounds, so drift on a shared machine
hits both alike. Figures: docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_hooks.testing import read_spool
from tests.sglang_pd.bed import (
    REQUEST_TIMEOUT_S,
    START_TIMEOUT_S,
    Process,
    generate_body,
    only_loopback,
    post,
    sglang_server,
    stop_all,
    with_room,
)

WARM_TOKENS = 4
PROMPT = " ".join(["decode reads what prefill sealed page by page over the wire"] * 8)


def in_namespace() -> None:
    """Re-run this script inside a fresh network namespace that has only loopback."""
    ns = f"kvwatch-bench-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        # Ephemeral ports from 32768 up, the bed's own below them (tests/sglang_pd/bed.py).
        ports = "net.ipv4.ip_local_port_range=32768 60999"
        subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", ports], check=True)
        cmd = ["ip", "netns", "exec", ns, sys.executable, *sys.argv]
        raise SystemExit(subprocess.run(cmd, check=False).returncode)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def tpot(prefill: Process, bootstrap: int, decode: Process, tokens: int) -> float:
    """One PD request the way the router sends it (one body to prefill and decode, a fresh
    room), decode's reply streamed: seconds per output token from the first to the last."""
    body = with_room(generate_body(PROMPT, tokens), bootstrap)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, prefill.url, body)
        stamps: list[tuple[float, int]] = []  # (when, completion tokens so far)
        with requests.post(
            decode.url + "/generate", json=body | {"stream": True}, stream=True,
            timeout=REQUEST_TIMEOUT_S,
        ) as reply:  # fmt: skip
            if reply.status_code != 200:
                raise SystemExit(f"{decode.name}: HTTP {reply.status_code}: {reply.text[:300]}")
            for line in reply.iter_lines():
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise SystemExit(f"{decode.name}: {chunk['error']}")
                stamps.append((time.perf_counter(), int(chunk["meta_info"]["completion_tokens"])))
        first.result()
    (t0, n0), (t1, n1) = stamps[0], stamps[-1]
    if n1 != tokens or n1 <= n0:
        raise SystemExit(f"{decode.name}: streamed {stamps[-1]} of {tokens} tokens")
    return (t1 - t0) / (n1 - n0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--transport", default="mooncake_tcp")
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args()
    if not only_loopback():
        in_namespace()
    work = Path(tempfile.mkdtemp(prefix="kvwatch-sglang-bench-"))
    transport, page_size = args.transport, args.page_size
    prefill, _, bootstrap = sglang_server(
        "prefill", work, role="prefill", transport=transport, page_size=page_size
    )
    decodes: dict[str, Process] = {}
    spools: dict[str, Path] = {}
    for mode, plugins in (("kvwatch", "kvwatch,cpu_bed"), ("off", "cpu_bed")):
        decodes[mode], spools[mode], _ = sglang_server(
            f"decode-{mode}",
            work,
            role="decode",
            transport=transport,
            plugins=plugins,
            page_size=page_size,
        )
    servers = [prefill, *decodes.values()]
    with ExitStack() as stack:
        stack.callback(stop_all, servers)
        for server in servers:
            server.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in servers:
            server.wait_ready(deadline)
        for decode in decodes.values():  # warm: the transfer's handshake, the first forward
            tpot(prefill, bootstrap, decode, WARM_TOKENS)
        per_token: dict[str, list[float]] = {mode: [] for mode in decodes}
        order = list(decodes)
        for round_ in range(args.rounds):
            for mode in order if round_ % 2 == 0 else order[::-1]:
                per_token[mode].append(tpot(prefill, bootstrap, decodes[mode], args.tokens))
        median = {mode: statistics.median(v) for mode, v in per_token.items()}
        time.sleep(2.0)  # the flush thread's next snapshot (every second)
        spool = spools["kvwatch"]
        assert spool is not None
        counters = read_spool(spool).latest_counters().get("hook_seconds", {})
        served = WARM_TOKENS + args.rounds * args.tokens
    print(
        f"SGLang PD ({args.transport}, page size {args.page_size}), decode time per output "
        f"token (streamed), median of {args.rounds} alternating rounds of {args.tokens} tokens:"
    )
    for mode, value in median.items():
        print(f"  {mode:8s} {value * 1000:8.2f} ms")
    print(f"  ratio kvwatch/off: {median['kvwatch'] / median['off']:.3f}")
    # The hooks' own time (hook_seconds, every hook on the kvwatch decode) per output token it
    # served: what kvwatch adds to decode's thread, free of the wall-clock noise above.
    hooks = sum(counters.values()) / served
    print(
        f"  kvwatch's hooks on decode: {hooks * 1000:.3f} ms per output token "
        f"({hooks / median['off']:.3f} of off's time per token)"
    )


if __name__ == "__main__":
    main()
