"""Who may own a spool segment: ``allowed_users``, or a member of the spool folder's group while
that group may write the folder; anyone else's segments are left unread, and loudly."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvspool import records as schema
from kvspool.writer import SpoolWriter
from kvwatch.expose.metrics import KvwatchCollector
from kvwatch.expose.status import Alarm, AlarmSettings, spool_access, summarize
from kvwatch.ingest.spool.owner import user_name
from kvwatch.ingest.spool.reader import SpoolReader
from kvwatch.store.journal import Journal
from kvwatch.store.state import State
from tests import anyuser
from tests.kvwatch.daemonproc import DaemonProcess
from tests.kvwatch.spoolgen import Producer

NOBODY = 65534  # nobody, whose primary group is nogroup (65534) on Debian
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def metric(state: State, line: str) -> float:
    registry = CollectorRegistry()
    registry.register(KvwatchCollector(state))
    for text in generate_latest(registry).decode().splitlines():
        if text.startswith(line + " "):
            return float(text.split()[-1])
    raise AssertionError(line)


def foreign_segment(spool: Path, uid: int, gid: int) -> Producer:
    p = Producer(spool)
    p.append(p.hello(), p.event("x"), p.event("y"))
    os.chown(p.path, uid, gid)
    return p


@root_only
def test_a_member_of_the_spool_folders_group_is_read(
    spool: Path, journal: Journal, state: State
) -> None:
    os.chown(spool, 0, NOBODY)
    spool.chmod(0o2770)  # the unit's spool folder: group-writable, setgid
    foreign_segment(spool, NOBODY, NOBODY)
    SpoolReader(spool, journal, state, idle_grace=3600.0).poll()
    assert len(journal.incidents()) == 2
    assert not state.ignored and not state.daemon.get(("spool_rejected", ("owner",)))
    assert spool_access(state).level == "ok"


@root_only
def test_a_group_that_may_not_write_the_folder_trusts_nobody(
    spool: Path, journal: Journal, state: State
) -> None:
    os.chown(spool, 0, NOBODY)
    spool.chmod(0o2750)  # the group reads, but only the owner writes: membership grants nothing
    foreign_segment(spool, NOBODY, NOBODY)
    SpoolReader(spool, journal, state, idle_grace=3600.0).poll()
    assert journal.incidents() == []
    assert [(i.reason, i.uid, i.findings) for i in state.ignored.values()] == [("owner", NOBODY, 2)]


def test_a_foreign_segment_is_named_counted_and_alarmed(
    spool: Path, journal: Journal, state: State
) -> None:
    uid = os.geteuid()
    p = Producer(spool)
    p.append(p.hello(), p.event("x"))
    # Only another uid is allowed: this file's owner may not write the spool.
    reader = SpoolReader(spool, journal, state, allowed_uids={uid + 4242}, idle_grace=3600.0)
    reader.poll()
    reader.poll()
    assert metric(state, 'kvwatch_spool_ignored_segments{reason="owner"}') == 1
    assert metric(state, 'kvwatch_spool_ignored_segments{reason="unreadable"}') == 0
    assert metric(state, "kvwatch_spool_ignored_findings") == 1
    summary = summarize(state, Alarm(AlarmSettings()))
    assert summary.level == "alarm"
    assert summary.headline.startswith(
        f"ALARM: 1 spool segment(s) of {user_name(uid)} (uid {uid}) ignored"
    ), summary.headline
    assert "1 finding(s) in them are not in the journal" in summary.headline
    assert "add that user to the spool folder's group or to allowed_users" in summary.headline
    # Gone from the spool, gone from the page and the metrics.
    p.path.unlink()
    reader.poll()
    assert spool_access(state).level == "ok"
    assert metric(state, 'kvwatch_spool_ignored_segments{reason="owner"}') == 0
    assert metric(state, "kvwatch_spool_ignored_findings") == 0


def test_a_foreign_segment_without_findings_beside_a_read_producer_warns(
    spool: Path, journal: Journal, state: State
) -> None:
    uid = os.geteuid()
    p = Producer(spool)
    p.append(p.hello())
    reader = SpoolReader(spool, journal, state, allowed_uids={uid + 4242}, idle_grace=3600.0)
    reader.poll()
    state.live_producers = 1  # another, trusted producer is read
    assert spool_access(state).level == "warning"
    state.live_producers = 0  # none is: nothing on the node is verified
    check = spool_access(state)
    assert check.level == "alarm" and "nothing on this node is verified" in check.line


@root_only
def test_the_writer_gives_a_segment_the_folders_group_readable(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    os.chown(spool, 0, NOBODY)
    spool.chmod(0o770)  # not setgid: the writer sets the group itself
    old = os.umask(0o077)  # an engine whose umask drops group read
    try:
        writer = SpoolWriter(spool, engine="minipd", role="decode")
        assert writer.write(schema.GAUGES, {"gauges": [["kv_pool_tokens", {}, 4096.0]]})
        writer.close()
    finally:
        os.umask(old)
    info = writer.segment_path.stat()
    assert info.st_gid == NOBODY and info.st_mode & 0o777 == 0o640


@root_only
def test_a_segment_the_daemon_cannot_open_is_named_and_alarmed() -> None:
    """The old layout's failure: an engine's segment keeps the engine's own group, so the daemon
    (another user) cannot open it. It must not read "no record yet"."""
    root = Path(tempfile.mkdtemp(prefix="kvwatch-unreadable-"))
    try:
        root.chmod(0o755)
        (root / "spool").mkdir(mode=0o755)
        p = Producer(root / "spool")
        p.append(p.hello(), p.event("x"))
        p.path.chmod(0o600)  # root's, and nobody may read it
        (root / "state").mkdir()
        os.chown(root / "state", NOBODY, NOBODY)
        daemon = DaemonProcess(
            root,
            "--no-nvml",
            journal=root / "state/journal.db",
            prefix=("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"),
            python=str(anyuser.python()),
        )
        try:
            port = daemon.wait_started()
            url = f"http://127.0.0.1:{port}/"
            deadline = time.monotonic() + 30
            while 'kvwatch_spool_ignored_segments{reason="unreadable"} 1.0' not in daemon.scrape():
                assert time.monotonic() < deadline, daemon.output()
                time.sleep(0.1)
            request = urllib.request.Request(url, headers={"Accept": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as reply:
                summary = json.loads(reply.read())
            assert summary["level"] == "alarm", summary
            assert summary["headline"].startswith(
                "ALARM: 1 spool segment(s) of root (uid 0) unreadable"
            ), summary["headline"]
            assert "nothing on this node is verified" in summary["headline"]
            assert "setgid with the daemon's group (mode 2770)" in summary["headline"]
        finally:
            assert daemon.stop() == 0
    finally:
        shutil.rmtree(root, ignore_errors=True)
