"""The running daemon as an operator meets it: its HTTP paths, its locks, its signals, its logs,
and ``kvwatch status`` against it. Real processes, real sockets, real files."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.kvwatch.daemonproc import REPO, DaemonProcess, run_cli
from tests.kvwatch.spoolgen import Producer
from tests.kvwatch.test_daemon import samples


def get(url: str, accept: str = "*/*") -> tuple[int, str, str]:
    request = urllib.request.Request(url, headers={"Accept": accept})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def kvwatch(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args)


def wait_until(predicate: object, timeout: float = 30.0) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def status_on_a_terminal(url: str, **env: str) -> str:
    """``kvwatch status`` with its stdout on a pseudo-terminal, as an SRE logged in sees it."""
    import pty

    leader, follower = pty.openpty()
    try:
        subprocess.run(
            [sys.executable, "-m", "kvwatch.cli", "status", "--url", url],
            cwd=REPO, stdout=follower, stderr=subprocess.DEVNULL, check=False, timeout=60,
            env={**os.environ, "TERM": "xterm", **env},
        )  # fmt: skip
        os.close(follower)
        out = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's other end is closed and drained
                break
            if not chunk:
                break
            out += chunk
        return out.decode()
    finally:
        os.close(leader)


def collector(daemon: DaemonProcess, name: str) -> float | None:
    return samples(daemon.scrape(), "kvwatch_collector_success").get((("collector", name),))


def test_http_paths(tmp_path: Path) -> None:
    (tmp_path / "spool").mkdir()
    daemon = DaemonProcess(tmp_path, "--no-nvml")
    try:
        port = daemon.wait_started()
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: get(base + "/-/ready")[0] == 200)
        assert get(base + "/-/healthy")[0] == 200
        status, kind, body = get(base + "/metrics")
        assert status == 200 and "kvwatch_build_info" in body
        status, kind, body = get(base + "/")
        assert status == 200 and kind.startswith("text/html") and 'id="checks"' in body
        status, kind, body = get(base + "/", accept="application/json")
        assert status == 200 and kind == "application/json"
        assert {c["name"] for c in json.loads(body)["checks"]} == {
            "integrity", "spool_access", "unsafe_band", "coverage", "engine_config", "freshness",
        }  # fmt: skip
        for path in ("/healthz", "/nonexistent", "/metrics/x", "/index.html"):
            status, _, body = get(base + path)
            assert status == 404, path
            assert "kvwatch_" not in body
    finally:
        assert daemon.stop() == 0


def test_colon_port_listens_on_every_interface(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, "--no-nvml", "--listen", ":0")
    try:
        daemon.wait_started()
        started = next(e for e in daemon.events() if e.get("event") == "daemon.started")
        assert str(started["listen"]).startswith("0.0.0.0:")
        assert get(f"http://127.0.0.1:{daemon.port}/-/healthy")[0] == 200
    finally:
        daemon.stop()


def test_second_daemon_on_the_same_journal_or_spool_is_refused(tmp_path: Path) -> None:
    (tmp_path / "spool").mkdir()
    first = DaemonProcess(tmp_path, "--no-nvml")
    try:
        first.wait_started()
        same_journal = kvwatch(
            "daemon", "--journal", str(first.journal), "--spool-dir", str(tmp_path / "other"),
            "--listen", "127.0.0.1:0", "--no-nvml",
        )  # fmt: skip
        assert same_journal.returncode == 1
        assert same_journal.stderr.strip() == (
            f"kvwatch daemon: another kvwatch daemon is using the journal {first.journal}; "
            "stop it first (two daemons would record every incident twice)"
        )
        same_spool = kvwatch(
            "daemon", "--journal", str(tmp_path / "other.db"), "--spool-dir", str(first.spool),
            "--listen", "127.0.0.1:0", "--no-nvml",
        )  # fmt: skip
        assert same_spool.returncode == 1
        assert f"another kvwatch daemon is using the spool folder {first.spool}" in (
            same_spool.stderr
        )
    finally:
        assert first.stop() == 0
    # The lock goes with the process: a new daemon starts on the same files.
    again = DaemonProcess(tmp_path, "--no-nvml", journal=first.journal)
    try:
        again.wait_started()
    finally:
        assert again.stop() == 0


def test_sighup_reloads_what_it_can_and_refuses_a_broken_file(tmp_path: Path) -> None:
    """SIGHUP, as Prometheus: what can change live is applied (the retention, an engine log),
    a change that needs a restart is named, a file that does not load is refused with the
    daemon running on as it was; ``kvwatch_config_last_reload_successful`` says which."""
    settings = tmp_path / "kvwatch.toml"
    settings.write_text('retention = "30d"\n')
    daemon = DaemonProcess(tmp_path, "--no-nvml", "--config", str(settings))

    def reloaded(event: str, count: int) -> dict[str, object]:
        daemon.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: sum(e.get("event") == event for e in daemon.events()) == count)
        return [e for e in daemon.events() if e.get("event") == event][-1]

    def gauge(name: str) -> float:
        body = get(f"http://127.0.0.1:{port}/metrics")[2]
        (line,) = [x for x in body.splitlines() if x.startswith(name + " ")]
        return float(line.split()[1])

    try:
        port = daemon.wait_started()
        assert gauge("kvwatch_config_last_reload_successful") == 1.0
        started = gauge("kvwatch_config_last_reload_success_timestamp_seconds")
        log = tmp_path / "decode.log"
        log.write_text("starting\n")
        settings.write_text(
            'retention = "7d"\nnode = "other-node"\n'
            f'[[logs]]\npath = "{log}"\nrole = "decode"\nengine = "sglang"\n'
        )
        event = reloaded("config.reloaded", 1)
        assert event["applied"] == ["retention", "logs"], event
        waiting = [e for e in daemon.events() if e.get("event") == "config.restart_needed"]
        assert waiting and waiting[-1]["settings"] == ["node"], waiting
        wait_until(lambda: collector(daemon, "logs") == 1.0)  # the new engine log is read
        assert gauge("kvwatch_config_last_reload_success_timestamp_seconds") >= started
        settings.write_text('retention = "7 days"\n')
        event = reloaded("config.reload_failed", 1)
        assert "retention" in str(event["error"]), event
        assert gauge("kvwatch_config_last_reload_successful") == 0.0
        assert daemon.proc.poll() is None
        assert get(f"http://127.0.0.1:{port}/-/healthy")[0] == 200
        settings.write_text('retention = "7d"\n')
        reloaded("config.reloaded", 2)
        assert gauge("kvwatch_config_last_reload_successful") == 1.0
    finally:
        assert daemon.stop() == 0
    assert any(e.get("event") == "daemon.stopping" for e in daemon.events())


def test_missing_spool_and_log_are_loud_and_measured(tmp_path: Path) -> None:
    log = tmp_path / "prefill.log"
    daemon = DaemonProcess(
        tmp_path, "--no-nvml", "--log", f"prefill:sglang:{log}", make_spool=False
    )
    try:
        port = daemon.wait_started()
        wait_until(lambda: collector(daemon, "spool") == 0.0)
        assert collector(daemon, "logs") == 0.0
        events = {e.get("event"): e for e in daemon.events()}
        assert events["spool.missing"]["level"] == "warning"
        assert events["logs.missing"]["path"] == str(log)
        _, _, body = get(f"http://127.0.0.1:{port}/", accept="application/json")
        summary = json.loads(body)
        assert summary["level"] == "warning"
        assert "is missing or unreadable" in summary["headline"]
        daemon.spool.mkdir()
        log.write_text("starting\n")
        wait_until(lambda: collector(daemon, "spool") == 1.0 and collector(daemon, "logs") == 1.0)
    finally:
        assert daemon.stop() == 0


def test_status_command_against_the_daemon(tmp_path: Path) -> None:
    (tmp_path / "spool").mkdir()
    producer = Producer(tmp_path / "spool", role="prefill")
    producer.identity["pid"] = os.getpid()
    producer.append(producer.hello(), producer.gauges(681_280, 1_048_576))
    # A live writer holds its segment's flock: without it the segment is finished after
    # idle_grace (5 s) and the producer retired, the band stale, before the last status call.
    live = os.open(producer.path, os.O_RDONLY)
    fcntl.flock(live, fcntl.LOCK_EX)
    daemon = DaemonProcess(tmp_path, "--no-nvml")
    try:
        port = daemon.wait_started()
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: "unsafe band" in get(url + "/", accept="application/json")[2])
        plain = kvwatch("status", "--url", url)
        # The band is critical (KVPoolSmallerThanContext pages critical): an alarm here too.
        assert plain.returncode == 4, plain.stderr
        first = plain.stdout.splitlines()[0]
        assert first.startswith("ALARM: ") and "\x1b[" not in plain.stdout
        assert "unsafe band on prefill (sglang): prompts of 681,281 to 1,048,576" in plain.stdout
        coloured = kvwatch("status", "--url", url, "--color", "always")
        assert "\x1b[1;31m" in coloured.stdout
        machine = kvwatch("status", "--url", url, "--json")
        summary = json.loads(machine.stdout)
        levels = {c["name"]: c["level"] for c in summary["checks"]}
        assert levels["unsafe_band"] == "alarm" and levels["integrity"] == "ok"
        assert summary["integrity"]["affected"] == 0 and summary["node"]
        # The default URL comes from the config's listen (":PORT" is reached on loopback).
        config = tmp_path / "kvwatch.toml"
        config.write_text(f'listen = ":{port}"\n')
        assert kvwatch("status", "--config", str(config)).returncode == 4
        t0 = time.monotonic()
        assert "\x1b[" in status_on_a_terminal(url)
        assert "\x1b[" not in status_on_a_terminal(url, NO_COLOR="1")
        assert time.monotonic() - t0 < 20
    finally:
        os.close(live)
        assert daemon.stop() == 0


def test_human_logs_on_request_and_json_otherwise(tmp_path: Path) -> None:
    human = kvwatch(
        "daemon", "--spool-dir", str(tmp_path / "s"), "--journal", str(tmp_path / "d"),
        "--listen", "nowhere:1", "--log-format", "human", "--no-nvml",
    )  # fmt: skip
    # an address that does not resolve: a runtime fault, one human-readable line
    assert human.returncode == 1, human.stderr
    (line,) = [x for x in human.stderr.splitlines() if "[error" in x]
    assert "daemon.listen_failed" in line and "listen=nowhere:1" in line
    assert "Traceback" not in human.stderr
    daemon = DaemonProcess(tmp_path, "--no-nvml", "--log-format", "human")
    try:
        deadline = time.monotonic() + 30
        while "daemon.started" not in daemon.output():
            assert time.monotonic() < deadline and daemon.proc.poll() is None, daemon.output()
            time.sleep(0.05)
        line = next(x for x in daemon.output().splitlines() if "daemon.started" in x)
        assert not line.startswith("{") and "[info     ]" in line and "version=" in line
    finally:
        assert daemon.stop() == 0


def test_short_retention_with_confirmation_starts(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, "--no-nvml", "--retention", "30s", "--allow-short-retention")
    try:
        daemon.wait_started()
    finally:
        assert daemon.stop() == 0


@pytest.mark.parametrize("flag", ["--version"])
def test_version_is_the_package_version(flag: str) -> None:
    from importlib.metadata import version

    from kvwatch import __version__

    assert kvwatch(flag).stdout.strip() == f"kvwatch {__version__}"
    assert version("kvwatch") == __version__


def test_not_ready_until_the_first_poll(tmp_path: Path) -> None:
    """/-/ready answers 503 until the daemon says its first poll committed (the daemon's own
    app and server, with its readiness flag held down)."""
    import threading

    from prometheus_client import CollectorRegistry, make_wsgi_app

    from kvwatch.expose.http import make_app, serve_wsgi
    from kvwatch.store.state import State

    ready = threading.Event()
    app = make_app(make_wsgi_app(CollectorRegistry()), State(), tmp_path / "j.db", ready.is_set)
    server = serve_wsgi("127.0.0.1", 0, app, {})
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        status, _, body = get(base + "/-/ready")
        assert status == 503 and "first poll" in body
        assert get(base + "/-/healthy")[0] == 200
        ready.set()
        assert get(base + "/-/ready")[0] == 200
    finally:
        server.shutdown()
        server.server_close()


def test_sigterm_stops_a_daemon_whose_log_reader_stalled(tmp_path: Path) -> None:
    """stderr is a pipe that nobody reads for a while (a stuck log shipper) and the daemon has
    filled it; SIGTERM arrives then. Once the reader drains the pipe the daemon stops cleanly:
    the handler only records the signal, it never waits on the log stream's lock."""
    spool = tmp_path / "spool"
    spool.mkdir()
    for i in range(3000):  # each one is a warning line: far more than a pipe holds
        (spool / f"bad name {i}.kvs").write_bytes(b"")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvwatch.cli", "daemon", "--spool-dir", str(spool),
         "--journal", str(tmp_path / "j.db"), "--listen", "127.0.0.1:0", "--no-nvml"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        time.sleep(3)  # not reading: the daemon blocks writing its warnings
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        _, output = proc.communicate(timeout=60)  # drain the pipe; the daemon must exit
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert output.count(b"spool.segment_ignored") == 3000
    assert b'"daemon.stopping"' in output and b'"daemon.stopped"' in output


def test_sigterm_while_the_main_thread_holds_the_stop_events_lock(tmp_path: Path) -> None:
    """The signal handler runs in the main thread, which may be inside ``stop.wait()`` holding
    the Event's lock: setting the Event right there waited on that lock forever (a daemon that
    never stopped on SIGTERM). The handler must return, and the stop arrive, while it is held."""
    script = f"""
import signal, sys
from kvwatch.config import Config
from kvwatch.daemon import Daemon
config = Config(spool_dir={str(tmp_path / "spool")!r}, journal={str(tmp_path / "j.db")!r})
daemon = Daemon(config)
with daemon.stop._cond:  # as inside Event.wait
    daemon._on_signal(signal.SIGTERM, None)
sys.exit(0 if daemon.stop.wait(10) else 3)
"""
    (tmp_path / "spool").mkdir()
    done = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        cwd=REPO,
        timeout=30,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_unwritable_incidents_log_refuses_to_start(tmp_path: Path) -> None:
    result = kvwatch(
        "daemon", "--spool-dir", str(tmp_path / "s"), "--journal", str(tmp_path / "j.db"),
        "--listen", "127.0.0.1:0", "--no-nvml", "--incidents-log", "/proc/x/y",
    )  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "kvwatch daemon: incidents_log /proc/x/y: cannot create /proc/x: No such file or directory"
    )
    # A missing folder is created, as the journal's; the log appears with its first incident.
    log = tmp_path / "new" / "incidents.jsonl"
    daemon = DaemonProcess(tmp_path, "--no-nvml", "--incidents-log", str(log))
    try:
        daemon.wait_started()
        assert log.parent.is_dir() and not log.exists()
    finally:
        assert daemon.stop() == 0


def test_a_failing_incidents_log_is_logged_once_then_its_recovery(tmp_path: Path) -> None:
    log = tmp_path / "incidents.jsonl"
    daemon = DaemonProcess(tmp_path, "--no-nvml", "--incidents-log", str(log))
    try:
        daemon.wait_started()
        log.mkdir()  # the log's path taken by a folder: every append fails (EISDIR)
        daemon.spool.mkdir(exist_ok=True)
        p = Producer(daemon.spool, "sglang-decode-r0-1")
        p.append(p.hello(), p.event("req-1"))
        wait_until(lambda: collector(daemon, "incidents_log") == 0.0)
        time.sleep(1.0)  # some 20 polls at 0.05s, each failing
        failed = [e for e in daemon.events() if e.get("event") == "incidents_log.write_failed"]
        assert len(failed) == 1 and failed[0]["level"] == "error", failed
        log.rmdir()
        wait_until(lambda: collector(daemon, "incidents_log") == 1.0)
        events = [e.get("event") for e in daemon.events()]
        assert events.count("incidents_log.write_recovered") == 1
        assert events.count("incidents_log.write_failed") == 1
        assert b'"request_id":"req-1"' in log.read_bytes()
    finally:
        assert daemon.stop() == 0
