"""Case 2: the spool fills or breaks under a running writer. The hook never raises and the
engine keeps going; the daemon reports the loss as a sequence gap
(kvwatch_spool_lost_records_total > 0, the metric KVSpoolRecordsLost fires on)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kvwatch.writer import spool_module
from tests.reliability.tools import DaemonProcess, event_fields, metric, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root")


@contextlib.contextmanager
def small_tmpfs(directory: Path, size: str = "256k") -> Iterator[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], check=True
    )
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def write_for(writer: Any, seconds: float, start: int = 0) -> tuple[int, int]:
    """Write events for ``seconds`` (a few per ms, like a busy engine); (ok, failed). Any
    exception out of ``write`` fails the test: the hook must never raise."""
    ok = failed = 0
    deadline = time.monotonic() + seconds
    i = start
    while time.monotonic() < deadline:
        if writer.write("event", event_fields(i)):
            ok += 1
        else:
            failed += 1
        i += 1
        if i % 50 == 0:
            time.sleep(0.005)
    return ok, failed


def lost(daemon: DaemonProcess) -> float:
    return metric(daemon.scrape(), "kvwatch_spool_lost_records_total") or 0.0


def test_enospc_on_a_full_tmpfs_is_a_counted_gap(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "spool") as spool:
        daemon = DaemonProcess(tmp_path, "--no-nvml", "--idle-grace", "0.5s")
        try:
            daemon.wait_started()
            writer = spool_module().SpoolWriter(
                spool, engine="sglang", role="decode", segment_bytes=32 << 10, max_segments=1000
            )
            # The daemon stopped: nobody drains, the 256 KiB tmpfs fills, writes hit ENOSPC.
            os.kill(daemon.proc.pid, signal.SIGSTOP)
            try:
                ok, failed = write_for(writer, 1.5)
            finally:
                os.kill(daemon.proc.pid, signal.SIGCONT)
            assert ok > 0 and failed > 0, (ok, failed, writer.dropped)
            assert writer.dropped["write_error"] > 0
            # The daemon drains and frees space; the writer resumes after its retry pause.
            more, _ = write_for(writer, 3.0, start=ok + failed)
            assert more > 0, writer.dropped
            writer.close()
            assert wait_for(lambda: lost(daemon) > 0, 15), daemon.output()[-2000:]
        finally:
            daemon.kill9()


def test_spool_directory_removed_under_a_running_writer(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, "--no-nvml", "--idle-grace", "0.5s")
    try:
        daemon.wait_started()
        daemon.spool.mkdir(exist_ok=True)
        writer = spool_module().SpoolWriter(daemon.spool, engine="sglang", role="prefill")
        ok1, _ = write_for(writer, 0.5)
        assert ok1 > 0
        shutil.rmtree(daemon.spool)  # records written to the unlinked segment are lost
        write_for(writer, 2.0, start=ok1 + 1000)  # the writer notices, never re-creates it
        assert not daemon.spool.exists() and writer.dropped["no_spool"] > 0
        daemon.spool.mkdir()  # the operator's fix: a new segment, the lost ones a gap
        ok2, _ = write_for(writer, 2.0, start=ok1 + 100_000)
        assert ok2 > 0 and daemon.spool.is_dir()
        writer.close()
        assert wait_for(lambda: lost(daemon) > 0, 15), daemon.output()[-2000:]
    finally:
        daemon.kill9()


NOBODY = 65534


def test_spool_directory_made_read_only_under_a_running_writer() -> None:
    # Root ignores directory permissions: the writer runs with the effective uid of an
    # unprivileged user (this thread, for the writing only), in small segments so that it opens
    # new ones while the directory is read-only.
    root = Path(tempfile.mkdtemp(prefix="kvwatch-ro-"))
    try:
        root.chmod(0o755)
        spool = root / "spool"
        spool.mkdir()
        os.chown(spool, NOBODY, NOBODY)
        daemon = DaemonProcess(
            root, "--no-nvml", "--idle-grace", "0.5s", "--allowed-user", "nobody"
        )
        try:
            daemon.wait_started()
            os.setegid(NOBODY)
            os.seteuid(NOBODY)
            try:
                writer = spool_module().SpoolWriter(
                    spool, engine="sglang", role="decode", segment_bytes=16 << 10
                )
                ok1, _ = write_for(writer, 1.0)
                spool.chmod(0o555)
                ok2, failed = write_for(writer, 1.5, start=100_000)
                spool.chmod(0o755)
                ok3, _ = write_for(writer, 1.5, start=200_000)
                writer.close()
            finally:
                os.seteuid(0)
                os.setegid(0)
            assert ok1 > 0 and failed > 0 and ok3 > 0, (ok1, ok2, failed, ok3, writer.dropped)
            assert writer.dropped["write_error"] > 0
            assert wait_for(lambda: lost(daemon) > 0, 15), daemon.output()[-2000:]
        finally:
            daemon.kill9()
    finally:
        shutil.rmtree(root, ignore_errors=True)
