"""kvwatch's cost inside a real SGLang 0.5.23 PD deployment on CPU: decode time per output token
with and without kvwatch, as a ratio (issue 24).

Run (root, after ``bash tests/sglang_pd/setup_env.sh``):
``build/sglang-pd-venv/bin/python bench/sglang_pd.py [--rounds R] [--tokens N]
[--transport mooncake_tcp|nixl] [--page-size P]``. Re-runs itself inside a fresh loopback-only
network namespace, as the bed does (tests/sglang_pd/README.md).

One prefill server (kvwatch in log mode, so both decodes receive sealed transfers alike) and two
decode servers side by side: one with kvwatch in log mode, one without (only the CPU shims).
Each round sends the same prompt to each decode server in alternating order, once with
``--tokens`` output tokens and once with one; the difference over ``tokens - 1`` is decode's
time per output token (prefill, transfer and admission cancel out). Each figure is the median
over rounds, so drift on a shared machine hits both alike.

Measured once on the 2-core shared development machine (load about 10), mooncake_tcp, page
size 16, 8 rounds of 64 tokens, the tiny 2-layer model: kvwatch 10.64 ms, off 4.83 ms per
output token, ratio 2.20. kvwatch's own hook time on that decode (``hook_seconds``) was about
0.08 s over some 530 output tokens, 0.15 ms per token: most of the gap is not inside the hooks
and is not explained yet (open; see the issue).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.sglang_pd.bed import (
    START_TIMEOUT_S,
    Bed,
    Process,
    only_loopback,
    sglang_server,
    stop_all,
)

PROMPT = " ".join(["decode reads what prefill sealed page by page over the wire"] * 8)


def in_namespace() -> None:
    """Re-run this script inside a fresh network namespace that has only loopback."""
    ns = f"kvwatch-bench-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        cmd = ["ip", "netns", "exec", ns, sys.executable, *sys.argv]
        raise SystemExit(subprocess.run(cmd, check=False).returncode)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def timed(bed: Bed, mode: str, tokens: int) -> float:
    start = time.perf_counter()
    reply = bed.direct(mode, PROMPT, tokens)
    elapsed = time.perf_counter() - start
    if reply.status != 200:
        raise SystemExit(f"decode {mode}: HTTP {reply.status}: {reply.body}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=64)
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
    for mode, plugins in (("kvwatch", "kvwatch,cpu_bed"), ("off", "cpu_bed")):
        decodes[mode], _, _ = sglang_server(
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
        bed = Bed(transport, prefill, bootstrap, decodes, prefill, {})  # no router: direct
        bed.served = {mode: 0 for mode in decodes}
        for mode in decodes:  # warm: the transfer's handshake, the first forward
            timed(bed, mode, 2)
        per_token: dict[str, list[float]] = {mode: [] for mode in decodes}
        order = list(decodes)
        for round_ in range(args.rounds):
            for mode in order if round_ % 2 == 0 else order[::-1]:
                long, short = timed(bed, mode, args.tokens), timed(bed, mode, 1)
                per_token[mode].append((long - short) / (args.tokens - 1))
        median = {mode: statistics.median(v) for mode, v in per_token.items()}
    print(
        f"SGLang PD ({args.transport}, page size {args.page_size}), decode time per output "
        f"token, median of {args.rounds} alternating rounds of {args.tokens} tokens:"
    )
    for mode, value in median.items():
        print(f"  {mode:8s} {value * 1000:8.2f} ms")
    print(f"  ratio kvwatch/off: {median['kvwatch'] / median['off']:.3f}")


if __name__ == "__main__":
    main()
