"""Run the real ``kvwatch daemon`` as a subprocess and talk to it over real HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_cli(
    *args: str, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """The real ``kvwatch`` command line, in a subprocess, from the checkout (``prefix``: e.g.
    a command that changes user). Local HTTP never goes through a proxy."""
    return subprocess.run(
        [*prefix, sys.executable, "-m", "kvwatch.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={**os.environ, "NO_PROXY": "127.0.0.1,localhost", **(env or {})},
    )


class DaemonProcess:
    def __init__(
        self,
        tmp: Path,
        *args: str,
        journal: Path | None = None,
        prefix: tuple[str, ...] = (),
        python: str = sys.executable,
        make_spool: bool = True,
    ) -> None:
        """``prefix`` (a command that changes user) and ``python`` (one that user can run, e.g.
        :func:`tests.anyuser.python`) run the daemon as another user. ``make_spool``: the spool
        folder is made first, as the unit's RuntimeDirectory (or ``kvwatch init``) makes it."""
        self.spool = tmp / "spool"
        if make_spool:
            self.spool.mkdir(exist_ok=True)
        self.journal = journal or tmp / "journal.db"
        self.log_path = tmp / f"daemon-{time.monotonic_ns()}.log"
        self.args = [
            *prefix,
            python,
            "-m",
            "kvwatch.cli",
            "daemon",
            "--spool-dir",
            str(self.spool),
            "--journal",
            str(self.journal),
            "--listen",
            "127.0.0.1:0",
            "--poll-interval",
            "0.05s",
            *args,
        ]
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            self.args, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ)
        )
        self.port = 0

    def wait_started(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.events():
                if event.get("event") == "daemon.started":
                    self.port = int(str(event["listen"]).rsplit(":", 1)[1])
                    return self.port
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}: {self.output()}")
            time.sleep(0.02)
        raise TimeoutError(f"daemon did not start: {self.output()}")

    def output(self) -> str:
        return self.log_path.read_text()

    def events(self) -> list[dict[str, object]]:
        out = []
        for line in self.output().splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

    def scrape(self) -> str:
        url = f"http://127.0.0.1:{self.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            return str(reply.read().decode())

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._log.close()

    def stop(self, timeout: float = 15.0) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()
