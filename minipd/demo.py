"""``python -m minipd demo``: the incident's incident, end to end, with kvwatch watching.

Starts minipd as SGLang 0.5.19 in PD mode with ``--kvwatch log``, fills recent pages with
sixteen users' unique markers, then sends one prompt in the unsafe band (longer than the prefill
pool, shorter than the context). Shows the reply, with other users' markers in it, and what the
detectors wrote to the spool.
"""

from __future__ import annotations

import re
import secrets
import tempfile
import time
from collections import Counter
from pathlib import Path

from engine_hooks.testing import read_spool
from kvspool.catalogue import unsafe_band
from minipd.launch import generate, start, stop

PREFILL_POOL, DECODE_POOL, CONTEXT = 16384, 65536, 32768
FILLER_WORDS = 20_000
MARKERS = 16
SERVE_ARGS = [
    "--pool-tokens", str(PREFILL_POOL), "--decode-pool-tokens", str(DECODE_POOL),
    "--context-length", str(CONTEXT), "--page-size", "16",
]  # fmt: skip


def _show_records(spool: Path) -> None:
    contents = read_spool(spool)
    roles = {r["producer"]: r["role"] for r in contents.records if r["type"] == "hello"}
    grouped: Counter[tuple[str, str, str, str, int, str]] = Counter()
    for e in contents.events():
        key = (
            roles.get(e["producer"], "?"),
            e["detector"],
            e["kind"],
            e["request_id"] or "-",
            e["pages_total"],
            e["action"],
        )
        grouped[key] += 1
    print(f"\n== What the detectors wrote to the spool ({spool})")
    if not grouped:
        print("    no mismatch records")
    for (role, detector, kind, rid, pages, action), count in grouped.items():
        times = f" x{count} (at admit and at every decode step)" if count > 1 else ""
        print(
            f"    {role:<7} detector={detector:<9} kind={kind:<16} request={rid} "
            f"pages={pages} action={action}{times}"
        )
    counters = contents.latest_counters()
    for name in ("verifications", "mismatches"):
        for labels, value in sorted(counters.get(name, {}).items()):
            print(f"    counter {name}{dict(labels)} = {value:g}")


def run_demo(release: str = "0.5.19", kvwatch: str = "log", device: str = "cpu") -> int:
    workdir = Path(tempfile.mkdtemp(prefix="minipd-demo-"))
    spool, logs = workdir / "spool", workdir / "logs"
    spool.mkdir()  # what the daemon's install does: the hooks never create it
    args = [
        "--release", release, "--kvwatch", kvwatch, "--kvwatch-spool", str(spool),
        "--log-dir", str(logs), "--device", device, *SERVE_ARGS,
    ]  # fmt: skip
    print(
        f"minipd demo: SGLang {release} in PD mode, kvwatch {kvwatch}, pools on {device}; "
        f"files in {workdir}"
    )
    proc, url = start(args, workdir)
    try:
        print("\n== Start-up lines (the incident's first check)")
        for role in ("prefill", "decode"):
            for line in (logs / f"{role}.log").read_text().splitlines():
                m = re.search(r"max_total_num_tokens=(\d+).*context_len=(\d+)", line)
                if m:
                    pool, context = int(m.group(1)), int(m.group(2))
                    band = unsafe_band(context, pool)
                    print(f"    {role:<7} pool={pool} context={context} unsafe band={band}")
        print(f"\n== {MARKERS} users send prompts with their own code ({url})")
        markers = ["CANARY-" + secrets.token_hex(6) for _ in range(MARKERS)]
        for marker in markers:
            status, _ = generate(url, ("Remember the code " + marker + ". ") * 2000)
            print(f"    {marker}: HTTP {status}")
        print(f"\n== One prompt of {FILLER_WORDS} words: past the prefill pool, inside the context")
        started = time.monotonic()
        status, out = generate(url, "word " * FILLER_WORDS + "Repeat any codes you saw.")
        elapsed = time.monotonic() - started
        text = str(out.get("text", ""))
        leaked = [m for m in markers if m in text]
        meta = out.get("meta_info", {})
        print(f"    HTTP {status} in {elapsed:.2f}s, prompt_tokens={meta.get('prompt_tokens')}")
        if text:
            print(f"    reply: {text[:240]}...")
        else:
            print(f"    error: {out.get('error', {}).get('message', '')}")
        print(f"    other users' codes in the reply: {leaked or 'none'}")
        stop(proc)
        _show_records(spool)
        return 0
    finally:
        stop(proc)
