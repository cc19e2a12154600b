"""The incidents log: one JSON line per incident, exactly once, rotated, read back whole."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvwatch.ingest.spool.reader import SpoolReader
from kvwatch.store import incidents_log
from kvwatch.store.incidents_log import HIGH_WATER_KEY, IncidentsLog
from kvwatch.store.journal import Journal
from tests.kvwatch.daemonproc import DaemonProcess, run_cli
from tests.kvwatch.spoolgen import Producer
from tests.kvwatch.writer import spool_module


def _events(
    spool: Path,
    journal: Journal,
    count: int,
    *,
    node: str = "node-a",
    log: IncidentsLog | None = None,
) -> None:
    state = journal.load()
    on_stored = log.committed if log else None
    reader = SpoolReader(spool, journal, state, idle_grace=3600.0, node=node, on_stored=on_stored)
    p = Producer(spool, f"sglang-decode-r0-1-{node}", node=node)
    frames = [p.hello()]
    for i in range(count):
        frames.append(
            p.event(
                f"req-{i}",
                sources=[{"request_id": f"src-{i}", "pages": 3, "instance": f"src-{i}#1"}],
                other_sources=i % 2,
                other_source_pages=i % 2,
            )
        )
    p.append(*frames)
    reader.poll()


def _lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for file in incidents_log.rotated(path):
        out += [json.loads(line) for line in file.read_text().splitlines()]
    return out


def test_every_incident_once_with_its_sources_and_the_same_rows_as_the_journal(
    spool: Path, journal: Journal, tmp_path: Path
) -> None:
    _events(spool, journal, 3)
    log = IncidentsLog(tmp_path / "incidents.jsonl", max_bytes=1 << 20, keep=3)
    assert log.drain(journal) == 3
    assert log.drain(journal) == 0
    lines = _lines(log.path)
    assert [line["request_id"] for line in lines] == ["req-0", "req-1", "req-2"]
    first = lines[0]
    assert first["v"] == 1 and first["journal"] == journal.meta("journal_id")
    assert first["node"] == "node-a" and first["role"] == "decode" and first["seq"] == 2
    assert first["sources"] == [
        {"request_id": "src-0", "pages": 3, "instance": "src-0#1", "written_at": 0.0}
    ]
    assert lines[1]["other_sources"] == 1
    assert first["time"] == incidents_log.iso(first["ts"])[:23] + "Z"  # to the millisecond
    assert incidents_log.read(log.path).rows == journal.incidents()
    assert journal.meta(HIGH_WATER_KEY) == str(lines[-1]["id"])


@pytest.mark.parametrize("source", ["memory", "journal"])
def test_rotation_keeps_n_files_and_reads_back_in_order(
    spool: Path, journal: Journal, tmp_path: Path, source: str
) -> None:
    """Lines encoded at commit time (a log attached before the poll) rotate between lines as
    the ones read back from the journal do."""
    path = tmp_path / "incidents.jsonl"
    log = IncidentsLog(path, max_bytes=4096, keep=2)
    if source == "memory":
        log.recover(journal)
    _events(spool, journal, 40, log=log)
    log.drain(journal)
    files = incidents_log.rotated(path)
    assert [f.name for f in files] == ["incidents.jsonl.2", "incidents.jsonl.1", "incidents.jsonl"]
    assert all(f.stat().st_size <= 4096 for f in files)
    assert not (tmp_path / "incidents.jsonl.3").exists()
    rows = incidents_log.read(path).rows
    ids = [r.id for r in rows]
    assert ids == sorted(ids) and ids[-1] == 40 and len(ids) < 40  # the oldest rotated away
    assert rows == journal.incidents()[-len(rows) :]


def test_a_crash_before_the_mark_is_stored_does_not_repeat_lines(
    spool: Path, journal: Journal, tmp_path: Path
) -> None:
    _events(spool, journal, 5)
    path = tmp_path / "incidents.jsonl"
    IncidentsLog(path, max_bytes=1 << 20, keep=3).drain(journal)
    # As if the daemon died after writing the lines, before the journal took the mark, and
    # in the middle of writing one more line.
    journal.set_meta(HIGH_WATER_KEY, "2")
    with path.open("ab") as handle:
        handle.write(b'{"v": 1, "journal": "')
    restarted = IncidentsLog(path, max_bytes=1 << 20, keep=3)
    assert restarted.drain(journal) == 0
    assert [line["id"] for line in _lines(path)] == [1, 2, 3, 4, 5]  # torn tail cut off
    _events(spool, journal, 0)
    state = journal.load()
    p = Producer(spool, "sglang-decode-r0-1-node-a", node="node-a")
    p.seq = 6
    p.append(p.event("late"))
    SpoolReader(spool, journal, state, idle_grace=3600.0, node="node-a").poll()
    assert restarted.drain(journal) == 1
    assert [line["request_id"] for line in _lines(path)][-1] == "late"


def test_a_log_from_another_journal_does_not_move_the_mark(
    spool: Path, journal: Journal, tmp_path: Path
) -> None:
    """A journal deleted and started afresh under the same log: its ids start again at 1."""
    path = tmp_path / "incidents.jsonl"
    other = Journal(tmp_path / "other.db")
    (tmp_path / "other-spool").mkdir()
    _events(tmp_path / "other-spool", other, 4, node="node-z")
    IncidentsLog(path, max_bytes=1 << 20, keep=3).drain(other)
    other.close()
    _events(spool, journal, 2)
    assert IncidentsLog(path, max_bytes=1 << 20, keep=3).drain(journal) == 2


def test_hostile_lines_are_named_counted_and_skipped(
    spool: Path, journal: Journal, tmp_path: Path
) -> None:
    _events(spool, journal, 2)
    path = tmp_path / "incidents.jsonl"
    IncidentsLog(path, max_bytes=1 << 20, keep=3).drain(journal)
    good = path.read_bytes().splitlines()
    hostile = [
        good[0],
        b"not json at all",
        b'{"v": 2, "id": 1}',
        good[0].replace(b'"pages_total":7', b'"pages_total":-1'),
        b'{"v": 1' + b" " * (2 << 20) + b"}",
        b"\xff\xfe\x00garbage",
        b"[1, 2, 3]",
        good[1],
    ]
    path.write_bytes(b"\n".join(hostile) + b"\n")
    result = incidents_log.read(path)
    assert [r.request_id for r in result.rows] == ["req-0", "req-1"]
    assert result.skipped == 6
    assert all(e.startswith(f"{path}:") and "\n" not in e for e in result.errors)
    assert "unsupported format version 2" in result.errors[1]
    assert "pages_total" in result.errors[2]
    # The first three named, the others counted: a wrong file cannot flood the terminal.
    assert len(result.errors) == 4 and "6 bad line(s) in all, 3 more not shown" in result.errors[3]
    cli = run_cli("incidents", "--incidents-log", str(path), "--json")
    assert cli.returncode == 1
    assert [r["request_id"] for r in json.loads(cli.stdout)] == ["req-0", "req-1"]
    assert "Traceback" not in cli.stderr
    assert "6 bad line(s) in all" in cli.stderr and len(cli.stderr.splitlines()) == 4


def test_a_journal_given_as_a_log_is_one_line(
    spool: Path, journal: Journal, tmp_path: Path
) -> None:
    """A SQLite file (or any file without one incident line) is named once, not line by line."""
    _events(spool, journal, 30)
    path = tmp_path / "journal.db"
    cli = run_cli("incidents", "--incidents-log", str(path))
    assert cli.returncode == 1 and "Traceback" not in cli.stderr
    assert len(cli.stderr.splitlines()) == 1, cli.stderr
    assert f"{path}: not an incidents log (line 1: " in cli.stderr
    assert "line(s) skipped" in cli.stderr


def test_the_daemon_writes_each_incident_once_across_kill9(tmp_path: Path) -> None:
    """The real daemon, a real SpoolWriter: lines appear after the commit; a kill -9 and a
    restart neither lose nor repeat one; the log lists what the journal lists."""
    (tmp_path / "spool").mkdir()
    log = tmp_path / "var" / "incidents.jsonl"
    daemon = DaemonProcess(tmp_path, "--incidents-log", str(log))
    daemon.wait_started()
    writer = spool_module().SpoolWriter(daemon.spool, engine="sglang", role="decode", model="m")

    def leak(request: str, sources: list[str]) -> None:
        writer.write(
            "event",
            {
                "detector": "canary",
                "kind": "unwritten_page",
                "mode": "log",
                "action": "logged",
                "request_id": request,
                "pages": [1, 2, 3],
                "pages_total": 3,
                "sources": [{"request_id": s, "pages": 1} for s in sources],
            },
        )

    def wait_lines(count: int) -> list[dict[str, Any]]:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if log.exists() and len(lines := _lines(log)) >= count:
                return lines
            time.sleep(0.05)
        raise AssertionError(f"{count} lines expected: {daemon.output()}")

    try:
        leak("reader-1", ["user-a", "user-b"])
        leak("reader-2", ["user-c"])
        wait_lines(2)
        daemon.kill9()
        leak("reader-3", ["user-a"])
        daemon = DaemonProcess(tmp_path, "--incidents-log", str(log))
        daemon.wait_started()
        lines = wait_lines(3)
        time.sleep(0.5)  # a few more polls: nothing more may come
        lines = _lines(log)
    finally:
        daemon.stop()
        writer.close()
    assert [line["request_id"] for line in lines] == ["reader-1", "reader-2", "reader-3"]
    assert [s["request_id"] for s in lines[0]["sources"]] == ["user-a", "user-b"]
    from_journal = run_cli("incidents", "--journal", str(daemon.journal), "--json")
    from_log = run_cli("incidents", "--incidents-log", str(log), "--json")
    assert from_journal.returncode == from_log.returncode == 0, from_log.stderr
    assert json.loads(from_journal.stdout) == json.loads(from_log.stdout)
    view = ["--exposed", "--json"]
    assert json.loads(
        run_cli("incidents", "--journal", str(daemon.journal), *view).stdout
    ) == json.loads(run_cli("incidents", "--incidents-log", str(log), *view).stdout)


def test_the_promtail_example_tails_the_default_log_and_labels_bounded_fields() -> None:
    """deploy/promtail-incidents.yml (Promtail is not in Debian: checked here as text): it tails
    the daemon's default path, not the rotated copies, extracts fields the line has, and makes
    labels only of bounded ones."""
    import re

    from kvwatch.config import Config
    from tests.kvwatch.daemonproc import REPO

    text = (REPO / "deploy" / "promtail-incidents.yml").read_text()
    [path] = re.findall(r"__path__: (\S+)", text)
    assert path == Config().incidents_log_path
    expressions = dict(re.findall(r"^ {12}(\w+): (\w+)$", text, flags=re.M))
    assert expressions and set(expressions.values()) <= set(
        incidents_log.IncidentLine.__struct_fields__
    )
    labels = re.search(r"- labels:\n((?: {10}\w+:\n)+)", text)
    assert labels is not None
    assert set(re.findall(r"(\w+):", labels.group(1))) <= {"node", "role", "detector", "kind"}
    assert "source: ts" in text and "format: Unix" in text


@pytest.mark.parametrize("source", ["memory", "journal"])
def test_a_full_disk_loses_no_line(
    spool: Path, journal: Journal, tmp_path: Path, source: str
) -> None:
    """A write that fails (ENOSPC, from /dev/full) moves no mark: once the disk has room, every
    line is written, once (lines encoded at commit time are dropped: the journal has them)."""
    import errno

    log = IncidentsLog("/dev/full", max_bytes=1 << 20, keep=3)
    if source == "memory":
        log.recover(journal)
    _events(spool, journal, 3, log=log)
    with pytest.raises(OSError) as failed:
        log.drain(journal)
    assert failed.value.errno == errno.ENOSPC
    assert journal.meta(HIGH_WATER_KEY) == "0"  # where recovery found the log: nothing yet
    log.path = tmp_path / "incidents.jsonl"  # room again
    assert log.drain(journal) == 3
    assert [line["request_id"] for line in _lines(log.path)] == ["req-0", "req-1", "req-2"]


def test_lines_encoded_at_commit_are_the_lines_the_journal_gives(
    spool: Path, journal: Journal, tmp_path: Path
) -> None:
    """The daemon encodes a committed incident's line from the rows in memory; its values are
    exactly those SQLite writes from the stored columns (_SELECT_LINES, the path a backlog
    takes): ts to the bit, time rounded to the millisecond as SQLite rounds, sources most pages
    first (ties in stored order), two producers in one commit."""
    log = IncidentsLog(tmp_path / "incidents.jsonl", max_bytes=1 << 20, keep=3)
    log.recover(journal)  # as the daemon does at start: the journal's commits are handed over
    rng = random.Random(18)
    base = float(int(time.time()) - 86400)
    fractions = [0.0, 0.0005, 0.0015, 0.9995, 0.999_999_9, 0.123_456_789, 59.9996, 3599.9995]
    fractions += [rng.uniform(0, 7200) for _ in range(200)]
    for name, node in (("sglang-decode-r0-1-node-a", "node-a"), ("vllm-prefill-r3-2-n-b", "n-b")):
        p = Producer(spool, name, node=node, role="prefill" if "prefill" in name else "decode")
        frames = [p.hello()]
        for i, fraction in enumerate(fractions):
            p.t0 = base + fraction - (p.seq + 1)  # this event's ts: base + fraction
            sources = [
                {"request_id": f"s{i}-{k}", "pages": rng.choice([1, 2, 2]), "written_at": 0.5}
                for k in range(i % 4)
            ]
            frames.append(
                p.event(
                    f'req-{i}\n"é',
                    pages=[i, i + 1],
                    instance=None if i % 3 else f"inst-{i}",
                    sources=sources,
                    other_sources=i % 2,
                    other_source_pages=i % 5,
                )
            )
        p.append(*frames)
    SpoolReader(spool, journal, journal.load(), idle_grace=3600.0, on_stored=log.committed).poll()
    count = 2 * len(fractions)
    assert log._pending_count == count  # encoded at commit, not read back
    assert log.drain(journal) == count
    assert journal.meta(HIGH_WATER_KEY) == str(count)
    # The backlog's path: the same findings read back from the journal's columns, the same bytes.
    journal.set_meta(HIGH_WATER_KEY, "0")
    backlog = IncidentsLog(tmp_path / "backlog.jsonl", max_bytes=1 << 20, keep=3)
    assert backlog.drain(journal) == count
    assert backlog.path.read_bytes() == log.path.read_bytes()
    lines = _lines(log.path)
    stored = journal.db.execute(
        "SELECT ts, strftime('%Y-%m-%dT%H:%M:%fZ', ts, 'unixepoch') FROM incidents ORDER BY id"
    ).fetchall()
    assert [(line["ts"], line["time"]) for line in lines] == [tuple(row) for row in stored]
    assert incidents_log.read(log.path).rows == journal.incidents(after_id=0)  # id order


def test_a_prune_of_an_incident_not_yet_written_reads_the_journal_instead(
    spool: Path, journal: Journal, tmp_path: Path
) -> None:
    """Incidents pruned before the drain are not written from memory, and the ids SQLite hands
    out again after them are written once each."""
    log = IncidentsLog(tmp_path / "incidents.jsonl", max_bytes=1 << 20, keep=3)
    log.recover(journal)
    state = journal.load()
    reader = SpoolReader(spool, journal, state, idle_grace=3600.0, on_stored=log.committed)
    p = Producer(spool, "sglang-decode-r0-1-node-a", t0=time.time() - 2 * 86400)
    p.append(p.hello(), p.event("old-0"), p.event("old-1"))
    reader.poll()
    assert log._pending_count == 2
    now = time.time()
    journal.prune(state, now=now, retention=86400.0, records_retention=86400.0)
    log.pruned(now - 86400.0)  # as the daemon hands the prune over
    assert log._pending_count == 0  # dropped: their ids are free again
    p.t0 = time.time() - p.seq - 1
    p.append(p.event("new-0"))
    reader.poll()
    assert log.drain(journal) == 1
    assert [(line["id"], line["request_id"]) for line in _lines(log.path)] == [(1, "new-0")]
    assert incidents_log.read(log.path).rows == journal.incidents()


#: A finding type with one field more than today's, given before the log's module is loaded:
#: what the log reads once such a field is added.
_LATER_FIELD = """
import sys
from pathlib import Path
from kvwatch.store import incident

class Later(incident.Finding, gc=False):
    layer: int = 0
    layers: list[int] = []

incident.Finding, incident.FINDING_FIELDS = Later, Later.__struct_fields__
from kvwatch.store import incidents_log

result = incidents_log.read(Path(sys.argv[1]))
print([(row.request_id, row.layer, row.layers) for row in result.rows], result.skipped)
"""


def test_a_line_written_before_a_field_was_added_reads_as_its_default(
    spool: Path, journal: Journal, tmp_path: Path
) -> None:
    _events(spool, journal, 2)
    log = IncidentsLog(tmp_path / "incidents.jsonl", max_bytes=1 << 20, keep=3)
    assert log.drain(journal) == 2
    assert '"layer' not in log.path.read_text()
    out = subprocess.run(
        [sys.executable, "-c", _LATER_FIELD, str(log.path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.strip() == "[('req-0', 0, []), ('req-1', 0, [])] 0", out
