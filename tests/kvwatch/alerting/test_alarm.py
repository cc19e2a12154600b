"""The integrity alarm's lifecycle, on a real daemon process and its real journal: an incident
raises it (``kvwatch status`` exits 4); ``kvwatch ack`` (one incident, a range, all) or the end
of the window (``alarm_window``) returns ``status`` to exit 0; ``alarm_until_ack`` keeps it until
acknowledged; a finding after an acknowledgement raises it again."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from kvwatch.store.journal import Journal
from tests.kvwatch.daemonproc import DaemonProcess, run_cli
from tests.kvwatch.spoolgen import Producer


def _live_producer(spool: Path) -> Producer:
    """A producer that is live (this process's pid), verifies, fits its context and writes
    now: integrity is the only check that can fail."""
    spool.mkdir(exist_ok=True)
    producer = Producer(spool, t0=time.time())
    producer.identity["pid"] = os.getpid()
    producer.append(producer.hello(), producer.counters(10), producer.gauges(2_000_000, 131_072))
    return producer


def _status(url: str) -> tuple[int, dict[str, object]]:
    done = run_cli("status", "--url", url, "--json")
    return done.returncode, json.loads(done.stdout)


def _until(check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _daemon(tmp_path: Path, settings: str) -> tuple[DaemonProcess, str]:
    config = tmp_path / "kvwatch.toml"
    config.write_text(f'node = "alarm-node"\n{settings}\n')
    daemon = DaemonProcess(tmp_path, "--no-nvml", "--idle-grace", "600s", "--config", str(config))
    return daemon, f"http://127.0.0.1:{daemon.wait_started()}"


def _incident_ids(journal: Path) -> list[int]:
    listing = run_cli("incidents", "--journal", str(journal), "--json")
    assert listing.returncode == 0, listing.stderr
    return [int(i["id"]) for i in json.loads(listing.stdout)]


def test_ack_returns_status_to_0_and_a_later_finding_raises_it_again(tmp_path: Path) -> None:
    producer = _live_producer(tmp_path / "spool")
    daemon, url = _daemon(tmp_path, 'alarm_window = "1h"')
    try:
        _until(lambda: _status(url)[0] == 0)
        # One leaking request, two detectors: one incident.
        producer.append(
            producer.event("leaky", sources=[{"request_id": "alice", "pages": 3}]),
            producer.event("leaky", detector="page_tag", kind="stale_tag"),
        )
        _until(lambda: _status(url)[0] == 4)
        code, summary = _status(url)
        integrity = summary["integrity"]
        assert isinstance(integrity, dict)
        assert (integrity["affected"], integrity["exposed"]) == (1, 1)
        assert summary["node"] == "alarm-node"
        [first] = _incident_ids(daemon.journal)
        acked = run_cli("ack", "--all", "--journal", str(daemon.journal), "--by", "alice")
        assert acked.returncode == 0, acked.stderr
        assert f"({1} incident(s): {first})" in acked.stdout and "by alice" in acked.stdout
        code, summary = _status(url)
        assert code == 0, summary
        assert summary["integrity"] == {**integrity, "affected": 0, "exposed": 0,
                                        "acknowledged": 1, "incident_ids": []}  # fmt: skip
        # Who and when, in the journal's own table.
        journal = Journal(daemon.journal, readonly=True)
        [ack] = journal.acks()
        journal.close()
        assert ack.by == "alice" and ack.incident is None and time.time() - ack.ts < 60
        # kvwatch status and the status page mark it acknowledged.
        assert "1 acknowledged" in run_cli("status", "--url", url).stdout
        with urllib.request.urlopen(url + "/", timeout=10) as reply:
            page = reply.read().decode()
        assert '<tr class="acked">' in page and "by alice at " in page
        assert '<span id="acknowledged">1</span>' in page
        # A new leaking request: the alarm again; acknowledged by its id (the default user).
        producer.append(producer.event("leaky-2"))
        _until(lambda: _status(url)[0] == 4)
        second = [i for i in _incident_ids(daemon.journal) if i != first]
        assert len(second) == 1
        assert run_cli("ack", str(second[0]), "--journal", str(daemon.journal)).returncode == 0
        assert _status(url)[0] == 0
        # An unknown id: one line.
        wrong = run_cli("ack", "999", "--journal", str(daemon.journal))
        assert wrong.returncode == 1 and "no incident 999" in wrong.stderr
        assert len(wrong.stderr.splitlines()) == 1
    finally:
        assert daemon.stop() == 0


def test_the_window_ends_the_alarm_and_until_ack_keeps_it(tmp_path: Path) -> None:
    producer = _live_producer(tmp_path / "spool")
    daemon, url = _daemon(tmp_path, 'alarm_window = "4s"')
    try:
        producer.append(producer.event("leaky"))
        _until(lambda: _status(url)[0] == 4)
        # Out of the window (its last finding 4 s old): exit 0 with nothing acknowledged.
        _until(lambda: _status(url)[0] == 0, timeout=40)
        assert _status(url)[1]["integrity"]["acknowledged"] == 0  # type: ignore[index]
    finally:
        assert daemon.stop() == 0
    daemon, url = _daemon(tmp_path, 'alarm_window = "1s"\nalarm_until_ack = true')
    try:
        time.sleep(2)
        code, summary = _status(url)
        assert code == 4, summary  # the same incident, long out of the window: still raised
        assert "until acknowledged" in str(summary["headline"])
        since = run_cli("ack", "--since", "1h", "--journal", str(daemon.journal))
        assert since.returncode == 0, since.stderr
        assert _status(url)[0] == 0
    finally:
        assert daemon.stop() == 0


def test_a_bad_alarm_setting_is_one_line(tmp_path: Path) -> None:
    for setting, message in (
        ('alarm_window = "0s"', "alarm_window: must be at least 1s, got 0s (from 1s to 366d)"),
        ("alarm_until_ack = 1", "alarm_until_ack: expected true or false"),
    ):
        config = tmp_path / "kvwatch.toml"
        config.write_text(setting + "\n")
        done = run_cli(
            "daemon", "--config", str(config), "--spool-dir", str(tmp_path / "s"),
            "--journal", str(tmp_path / "j.db"), "--no-nvml",
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert message in done.stderr and "Traceback" not in done.stderr
        assert not (tmp_path / "j.db").exists()


def test_ack_mistakes_are_one_line(tmp_path: Path) -> None:
    for args, message in (
        ((), "give one incident ID, a time range (--since/--until) or --all"),
        (("1", "--all"), "give one incident ID"),
        (("--all", "--journal", str(tmp_path / "none.db")), "no journal at"),
        (("--since", "yesterday", "--journal", str(tmp_path / "none.db")), "expected a duration"),
    ):
        done = run_cli("ack", *args)
        assert done.returncode in (1, 2), done.stderr
        assert message in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    assert not (tmp_path / "none.db").exists()


def test_ack_takes_an_incident_id_not_a_later_findings(tmp_path: Path) -> None:
    """``kvwatch ack ID`` takes the ID column of ``kvwatch incidents``: the id of a finding that
    joined an incident names no incident, and must not acknowledge that one by accident."""
    producer = _live_producer(tmp_path / "spool")
    producer.append(
        producer.event("leaky", sources=[{"request_id": "alice", "pages": 3}]),
        producer.event("leaky", detector="page_tag", kind="stale_tag"),
    )
    daemon, url = _daemon(tmp_path, 'alarm_window = "1h"')
    try:
        _until(lambda: _status(url)[0] == 4)
        [first] = _incident_ids(daemon.journal)
        later = run_cli("ack", str(first + 1), "--journal", str(daemon.journal))
        assert later.returncode == 1 and f"no incident {first + 1}" in later.stderr, later
        empty = run_cli("ack", "--since", "1h", "--until", "2h", "--journal", str(daemon.journal))
        assert empty.returncode == 2 and "is not before --until" in empty.stderr, empty
        assert len(empty.stderr.splitlines()) == 1
        assert _status(url)[0] == 4  # nothing was acknowledged
        journal = Journal(daemon.journal, readonly=True)
        assert journal.acks() == []
        journal.close()
    finally:
        assert daemon.stop() == 0


def test_the_node_flag_names_the_node_everywhere(tmp_path: Path) -> None:
    """``--node`` (the DaemonSet passes the pod's spec.nodeName) beats the config's node."""
    producer = _live_producer(tmp_path / "spool")
    producer.append(producer.event("leaky"))
    config = tmp_path / "kvwatch.toml"
    config.write_text('node = "from-config"\n')
    daemon = DaemonProcess(tmp_path, "--no-nvml", "--config", str(config), "--node", "gpu-node-7")
    url = f"http://127.0.0.1:{daemon.wait_started()}"
    try:
        _until(lambda: _status(url)[0] == 4)
        assert _status(url)[1]["node"] == "gpu-node-7"
        listing = run_cli("incidents", "--journal", str(daemon.journal), "--json")
        assert [i["node"] for i in json.loads(listing.stdout)] == ["gpu-node-7"]
    finally:
        assert daemon.stop() == 0
