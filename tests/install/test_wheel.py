"""The built wheel, installed into clean venvs outside the checkout, as an operator installs it.

One venv without torch: the daemon (real spool, real HTTP), the CLI, ``kvwatch export`` and
``kvwatch dashboards push`` against a real HTTP server. One with torch (2.13.0 CPU, pinned as the
Makefile does): the hooks writing a real spool, and SGLang's plugin entry point. Every command
runs from an empty folder with the checkout off ``sys.path``; a missing build tool or package
index is a failure, never a skip.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from kvwatch import __version__, assets
from tests.dashboards.test_dashboards_push import TOKEN, FakeGrafana
from tests.install.conftest import REPO, run, wheel


def test_sdist_and_wheel_are_built(dist: Path) -> None:
    assert (dist / f"kvwatch-{__version__}.tar.gz").is_file()
    assert wheel(dist).is_file()


def test_wheel_install_has_no_torch_and_runs_from_the_wheel(plain: Path, empty: Path) -> None:
    assert run([str(plain / "kvwatch"), "--version"], empty).stdout == f"kvwatch {__version__}\n"
    where = run(
        [str(plain / "python"), "-c", "import kvwatch, kvspool; print(kvwatch.__file__)"], empty
    ).stdout
    assert where.startswith(str(plain.parent)), where  # not the checkout
    no_torch = run([str(plain / "python"), "-c", "import torch"], empty, check=False)
    assert no_torch.returncode == 1 and "No module named 'torch'" in no_torch.stderr


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("kind", sorted(assets.KINDS))
def test_export_writes_the_checkouts_files(plain: Path, empty: Path, kind: str) -> None:
    out = empty / kind
    listed = run([str(plain / "kvwatch"), "export", kind, str(out)], empty).stdout.split()
    assert sorted(listed) == sorted(str(out / name) for name in assets.KINDS[kind])
    for name, source in assets.KINDS[kind].items():
        assert _digest(out / name) == _digest(REPO / source), name


def test_daemon_from_the_wheel(plain: Path, empty: Path) -> None:
    from tests.kvwatch.spoolgen import Producer

    spool = empty / "spool"
    spool.mkdir()
    # An incident now (the integrity alarm covers the last 5 minutes' incidents).
    producer = Producer(spool, t0=time.time())
    producer.append(producer.hello(), producer.counters(5, mismatches=1), producer.event("r"))
    log = empty / "daemon.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                str(plain / "kvwatch"), "daemon", "--spool-dir", str(spool),
                "--journal", str(empty / "journal.db"), "--listen", "127.0.0.1:0", "--no-nvml",
            ],
            cwd=empty, stdout=out, stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )  # fmt: skip
    try:
        port = 0
        deadline = time.monotonic() + 60
        while not port:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            for line in log.read_text().splitlines():
                if '"daemon.started"' in line:
                    port = int(json.loads(line)["listen"].rsplit(":", 1)[1])
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port}"
        text = ""
        while "kvwatch_mismatches_total{" not in text or 'detector="canary"' not in text:
            assert time.monotonic() < deadline, text
            with urllib.request.urlopen(base + "/metrics", timeout=10) as reply:
                text = reply.read().decode()
            time.sleep(0.1)
        assert 'kvwatch_build_info{python="' in text and f'version="{__version__}"' in text
        status = run([str(plain / "kvwatch"), "status", "--url", base], empty, check=False)
        assert status.returncode == 4 and status.stdout.startswith("ALARM: INTEGRITY ALERT")
        incidents = run([str(plain / "kvwatch"), "incidents", "--journal",
                         str(empty / "journal.db")], empty)  # fmt: skip
        assert incidents.stdout.endswith("incident(s)\n")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()


def test_dashboards_push_from_the_wheel(plain: Path, empty: Path, grafana: FakeGrafana) -> None:
    token = empty / "token"
    token.write_text(TOKEN)
    result = run(
        [str(plain / "kvwatch"), "dashboards", "push", "--url", grafana.url,
         "--token-file", str(token)],
        empty,
    )  # fmt: skip
    assert "dashboard kvwatch-overview: saved" in result.stdout
    sent = {
        body["dashboard"]["uid"]: body["dashboard"]
        for _, path, _, body in grafana.requests
        if path == "/api/dashboards/db"
    }
    for name in assets.KINDS["dashboards"]:
        board = json.loads((REPO / "dashboards" / name).read_text())
        assert {k: v for k, v in sent[board["uid"]].items() if k != "id"} == board
    assert grafana.requests[-1][1] == "/api/v1/provisioning/folder/kvwatch/rule-groups/kvwatch"


def test_hooks_and_sglang_entry_point_from_the_wheel(
    engine: Path, plain: Path, empty: Path
) -> None:
    spool = empty / "spool"
    spool.mkdir()  # as the daemon's install would: the hooks never create it
    run([str(engine / "python"), "-m", "engine_hooks.walkthrough", "--spool", str(spool)], empty)
    events = run([str(plain / "kvwatch"), "spool", str(spool), "--events"], empty).stdout
    detectors = {json.loads(line)["detector"] for line in events.splitlines()}
    assert {"canary", "checksum", "page_tag"} <= detectors
    code = (
        "from importlib.metadata import entry_points\n"
        "(ep,) = [e for e in entry_points(group='sglang.srt.plugins') if e.name == 'kvwatch']\n"
        "register = ep.load()\n"
        "import engine_hooks.sglang as m\n"
        "print(ep.value, m.__file__, register())\n"
    )
    out = run([str(engine / "python"), "-c", code], empty).stdout.split()
    assert out[0] == "engine_hooks.sglang:register"
    assert out[1].startswith(str(engine.parent))
    assert out[2] == "False"  # no SGLang in this venv: the plugin declines, never raises
