"""Start ``python -m minipd serve`` as a real process group, and always stop it.

``with MiniPD(["--release", "0.5.19"], tmp_path) as pd:`` yields a running engine on free ports
(the router binds port 0 and reports it); on exit the supervisor gets SIGTERM, and anything still
alive in its process group after a bounded wait is killed, so a failing test leaves no orphan.
"""

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
from types import TracebackType
from typing import Any

from engine_hooks.testing import SpoolContents, read_spool
from minipd.launch import child_env

READY_SECONDS = 90.0
STOP_SECONDS = 20.0


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class MiniPD:
    def __init__(self, args: list[str], workdir: Path, *, kvwatch: str = "off") -> None:
        self.workdir = workdir
        self.spool = workdir / "spool"
        self.spool.mkdir(parents=True, exist_ok=True)  # as the daemon's install would
        self.logs = workdir / "logs"
        self.args = [
            sys.executable, "-m", "minipd", "serve", "--port", "0",
            "--kvwatch", kvwatch, "--kvwatch-spool", str(self.spool),
            "--log-dir", str(self.logs), *args,
        ]  # fmt: skip
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.lines: list[str] = []
        self.stopped_cleanly = False

    def __enter__(self) -> MiniPD:
        self._stderr = open(self.workdir / "stderr.log", "w")
        self.proc = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=child_env(),
            text=True,
            start_new_session=True,
        )
        ready = threading.Event()

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith("minipd ready "):
                    self.url = line.split()[2]
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + READY_SECONDS
        while not ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"minipd did not start: {self.stderr()[-2000:]}")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(STOP_SECONDS)
        deadline = time.monotonic() + 5
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.stopped_cleanly = self.proc.poll() == 0 and not group_alive(pgid)
        if group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(5)
        self._stderr.close()

    def stderr(self) -> str:
        path = self.workdir / "stderr.log"
        return path.read_text() if path.exists() else ""

    def log(self, role: str) -> str:
        path = self.logs / f"{role}.log"
        return path.read_text() if path.exists() else ""

    def read_spool(self) -> SpoolContents:
        return read_spool(self.spool)

    def generate(
        self, text: str, max_new_tokens: int = 16, timeout: float = 120
    ) -> tuple[int, dict[str, Any]]:
        return post(self.url + "/generate", generate_body(text, max_new_tokens), timeout)

    def get(self, path: str) -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)


def generate_body(text: str, max_new_tokens: int) -> dict[str, Any]:
    return {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}


def post(url: str, body: dict[str, Any], timeout: float = 120) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)
