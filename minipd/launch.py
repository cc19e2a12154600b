"""Start ``python -m minipd serve`` from another program (the demo, the benchmark) and stop it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

START_SECONDS = 120.0


def generate(url: str, text: str, max_new_tokens: int = 64) -> tuple[int, dict[str, Any]]:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    req = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def child_env() -> dict[str, str]:
    """This environment, with the directory that holds minipd first on the path (so that the
    child runs this minipd, from a checkout or an install alike)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def start(args: list[str], workdir: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "minipd", "serve", "--port", "0", *args],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=(workdir / "minipd.stderr").open("w"),
        text=True,
        start_new_session=True,
    )
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("minipd ready "):
                found.append(line.split()[2])
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + START_SECONDS
    while not ready.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError("minipd did not start; see " + str(workdir / "minipd.stderr"))
    return proc, found[0]


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(20)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def get(url: str, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + path, timeout=60) as r:
        reply = json.load(r)
    return reply if isinstance(reply, dict) else {}
