"""Ordinary mistakes across every command: an exit code, one line naming the fault, no traceback.

Each row runs the real ``kvwatch`` CLI in a subprocess against real files, folders, ports and
HTTP servers. Exit 2 is a usage error (the command line or the config), 1 a runtime fault.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvwatch.store.journal import Journal
from tests import anyuser
from tests.kvwatch.daemonproc import REPO, run_cli


@dataclass(frozen=True)
class Mistake:
    argv: tuple[str, ...]  # "{t}" stands for a scratch folder prepared by ``setup``
    code: int
    says: str  # a substring of the one line printed
    setup: Callable[[Path], None] = lambda _t: None


def _write(name: str, data: str | bytes) -> Callable[[Path], None]:
    def setup(t: Path) -> None:
        path = t / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data)

    return setup


def _journal(t: Path) -> None:
    Journal(t / "journal.db").close()


def _both(*setups: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(t: Path) -> None:
        for s in setups:
            s(t)

    return setup


_not_db = _write("journal.db", "this is not a database\n" * 100)


def _bad_ca(t: Path) -> None:
    """An Alertmanager CA bundle that is not PEM: ssl's error was a traceback."""
    (t / "ca.pem").write_text("not a certificate\n")
    (t / "k.toml").write_text(
        f'alertmanager_urls = ["https://127.0.0.1:9"]\nalertmanager_ca_file = "{t}/ca.pem"\n'
    )


def _other_app(t: Path) -> None:
    """Another program's SQLite database, where the journal should be."""
    db = sqlite3.connect(t / "journal.db")
    db.execute("CREATE TABLE users (name TEXT)")
    db.execute("INSERT INTO users VALUES ('ada')")
    db.commit()
    db.close()


_token = _write("token", "glsa_token\n")
_dir = _write("dir/.keep", "")
D = ("daemon", "--spool-dir", "{t}/spool", "--journal", "{t}/journal.db", "--no-nvml")

MISTAKES: list[Mistake] = [
    # the top level
    Mistake((), 2, "the following arguments are required: COMMAND"),
    Mistake(("bogus",), 2, "invalid choice: 'bogus'"),
    # daemon: flags
    Mistake((*D, "--bogus"), 2, "kvwatch daemon: unrecognized arguments: --bogus"),
    Mistake((*D, "--retention", "30"), 2, "retention: '30' has no unit"),
    Mistake((*D, "--retention", "30s"), 2, "pass --allow-short-retention if you mean it"),
    Mistake((*D, "--retention", "0d", "--allow-short-retention"), 2, "must be more than 0"),
    Mistake((*D, "--records-retention", "soon"), 2, "records_retention: not a duration"),
    Mistake((*D, "--log-level", "LOUD"), 2, "argument --log-level: invalid choice: 'LOUD'"),
    Mistake((*D, "--log-format", "xml"), 2, "argument --log-format: invalid choice"),
    Mistake((*D, "--listen", "nowhere"), 2, "listen: expected HOST:PORT or :PORT"),
    Mistake((*D, "--listen", ":99999"), 2, "listen: expected HOST:PORT or :PORT"),
    Mistake(
        (*D, "--log", "prefill:sgl:/x.log"), 2, "unknown engine 'sgl' (did you mean 'sglang'?)"
    ),
    Mistake((*D, "--log", "prefil:/x.log"), 2, "unknown role 'prefil' (did you mean 'prefill'?)"),
    Mistake((*D, "--log", "x.log"), 2, "expected ROLE:ENGINE:PATH, ROLE:PATH or an absolute PATH"),
    Mistake((*D, "--poll-interval", "fast"), 2, "poll_interval: not a duration"),
    Mistake((*D, "--idle-grace", "-1"), 2, "idle_grace: not a duration"),
    Mistake((*D, "--poll-interval", "0.25"), 2, "poll_interval: '0.25' has no unit"),
    Mistake((*D, "--poll-interval", "0s"), 2, "poll_interval: must be at least 10ms, got 0ms"),
    Mistake((*D, "--poll-interval", "5ms"), 2, "poll_interval: must be at least 10ms, got 5ms"),
    Mistake((*D, "--allowed-user", "no-such-user-kvw"), 2, "no user 'no-such-user-kvw'"),
    # daemon: the config file
    Mistake((*D, "--config", "{t}/none.toml"), 2, "cannot read config {t}/none.toml"),
    Mistake((*D, "--config", "{t}/dir"), 2, "config {t}/dir is a directory", _dir),
    Mistake(
        (*D, "--config", "{t}/k.toml"),
        2,
        "is not UTF-8",
        _write("k.toml", b'journal = "/var/lib/kvwatch/j\xe9.db"\n'),
    ),
    Mistake((*D, "--config", "{t}/k.toml"), 2, "config {t}/k.toml: ", _write("k.toml", "= x")),
    Mistake(
        (*D, "--config", "{t}/k.toml"),
        2,
        "unknown setting 'retension' (did you mean 'retention'?)",
        _write("k.toml", 'retension = "30d"\n'),
    ),
    Mistake(
        (*D, "--config", "{t}/k.toml"),
        2,
        "nvml: expected true or false (no quotes), got 'false'",
        _write("k.toml", 'nvml = "false"\n'),
    ),
    Mistake(
        (*D, "--config", "{t}/k.toml"),
        2,
        "retention: 30 has no unit",
        _write("k.toml", "retention = 30\n"),
    ),
    Mistake(
        (*D, "--config", "{t}/k.toml"),
        2,
        "[[logs]] unknown key 'rol' (did you mean 'role'?)",
        _write("k.toml", "[[logs]]\npath = '/x.log'\nrol = 'decode'\n"),
    ),
    Mistake(
        (*D, "--config", "{t}/k.toml"),
        1,
        "cannot load alertmanager_ca_file {t}/ca.pem: NO_CERTIFICATE_OR_CRL_FOUND (not a PEM",
        _bad_ca,
    ),
    # daemon: runtime faults
    Mistake(
        ("daemon", "--journal", "{t}/dir", "--no-nvml"), 1, "journal {t}/dir is a directory", _dir
    ),
    Mistake(
        ("daemon", "--journal", "{t}/file/j.db", "--spool-dir", "{t}/s", "--no-nvml"),
        1,
        "{t}/file exists and is not a folder",
        _write("file", "x"),
    ),
    Mistake(
        ("daemon", "--journal", "{t}/j.db", "--spool-dir", "{t}/file", "--no-nvml"),
        1,
        "spool_dir {t}/file is a file, not a folder",
        _write("file", "x"),
    ),
    Mistake((*D,), 1, "{t}/journal.db is not a kvwatch journal (not an SQLite database)", _not_db),
    Mistake(
        (*D,),
        1,
        "{t}/journal.db is an SQLite database but not a kvwatch journal (tables: users)",
        _other_app,
    ),
    # daemon: no abbreviations (--spool was taken as --spool-dir), and values checked
    Mistake(
        ("daemon", "--spool", "{t}/s", "--journal", "{t}/j.db"),
        2,
        "kvwatch daemon: unrecognized arguments: --spool {t}/s",
    ),
    Mistake((*D, "--journ", "{t}/j.db"), 2, "unrecognized arguments: --journ"),
    Mistake((*D, "--retention", "-5d"), 2, "retention: not a duration: '-5d' is negative"),
    Mistake((*D, "--retention", "1e30d"), 2, "retention: must be at most 3650d, got 1e+30d"),
    Mistake((*D, "--records-retention", "9999d"), 2, "records_retention: must be at most 3650d"),
    Mistake((*D, "--idle-grace", "2h"), 2, "idle_grace: must be at most 1h, got 2h"),
    Mistake((*D, "--poll-interval", "5m"), 2, "poll_interval: must be at most 1m, got 5m"),
    Mistake(
        (*D, "--config", "{t}/k.toml"),
        2,
        "quarantine_max: must be at least 1, got -3 (from 1 to 100000)",
        _write("k.toml", "quarantine_max = -3\n"),
    ),
    Mistake(
        (*D, "--config", "{t}/k.toml"),
        2,
        "alertmanager_resend: must be at least 1s, got 0s",
        _write("k.toml", 'alertmanager_resend = "0s"\n'),
    ),
    # incidents
    Mistake(
        ("incidents", "--journal", "{t}/journal.db", "--detector", "Canary"),
        2,
        "unknown detector 'Canary' (did you mean 'canary'?)",
        _journal,
    ),
    Mistake(
        ("incidents", "--journal", "{t}/journal.db", "--kind", "unwriten_page"),
        2,
        "unknown kind 'unwriten_page' (did you mean 'unwritten_page'?)",
        _journal,
    ),
    Mistake(("incidents", "--since", "yesterday"), 2, "expected a duration (1h, 7d) or a UTC time"),
    Mistake(("incidents", "--since", "30"), 2, "expected a duration (1h, 7d) or a UTC time"),
    Mistake(("incidents", "--journal", "{t}/none.db"), 1, "no journal at {t}/none.db"),
    Mistake(("incidents", "--journal", "{t}/dir"), 1, "{t}/dir is a directory", _dir),
    Mistake(
        ("incidents", "--journal", "{t}/journal.db"),
        1,
        "{t}/journal.db is not a kvwatch journal (not an SQLite database)",
        _not_db,
    ),
    Mistake(
        ("incidents", "--journal", "{t}/journal.db"),
        1,
        "{t}/journal.db is an SQLite database but not a kvwatch journal",
        _other_app,
    ),
    Mistake(
        ("incidents", "--journal", "{t}/journal.db"),
        1,
        "{t}/journal.db is empty: no kvwatch daemon has started on it",
        _write("journal.db", ""),
    ),
    Mistake(
        ("incidents", "--since", "1h", "--until", "2h", "--journal", "{t}/journal.db"),
        2,
        "--since 1h is not before --until 2h: nothing can match",
        _journal,
    ),
    Mistake(("incidents", "--jour", "{t}/journal.db"), 2, "unrecognized arguments: --jour"),
    Mistake(("incidents", "--bogus"), 2, "kvwatch incidents: unrecognized arguments: --bogus"),
    # spool
    Mistake(("spool", "{t}/none"), 1, "{t}/none does not exist"),
    Mistake(("spool", "{t}/file"), 1, "{t}/file is not a folder", _write("file", "x")),
    Mistake(("spool",), 2, "the following arguments are required: DIR"),
    # check-logs
    Mistake(("check-logs",), 2, "the following arguments are required: FILE"),
    Mistake(("check-logs", "--role", "chef", "x.log"), 2, "argument --role: invalid choice"),
    # export
    Mistake(("export",), 2, "the following arguments are required: kind, DIR"),
    Mistake(("export", "slides", "{t}"), 2, "argument kind: invalid choice: 'slides'"),
    Mistake(
        ("export", "rules", "{t}/file/sub"), 1, "cannot write to {t}/file/sub", _write("file", "x")
    ),
    Mistake(
        ("export", "rules", "{t}"),
        1,
        "{t}/kvwatch.rules.yml exists; pass --force",
        _write("kvwatch.rules.yml", "x"),
    ),
    # status
    Mistake(("status", "--url", "http://127.0.0.1:9"), 1, "no kvwatch daemon answers at"),
    Mistake(("status", "--config", "{t}/none.toml"), 2, "cannot read config {t}/none.toml"),
    Mistake(("status", "--timeout", "-1"), 2, "argument --timeout: must be more than 0s, got -1"),
    Mistake(("status", "--timeout", "0"), 2, "argument --timeout: must be more than 0s, got 0"),
    Mistake(("status", "--timeout", "nan"), 2, "argument --timeout: must be more than 0s"),
    Mistake(("status", "--timeout", "1e9"), 2, "argument --timeout: must be 0 to 3600s, got 1e9"),
    Mistake(
        ("status", "--url", "127.0.0.1:9"), 1, "no kvwatch daemon answers at http://127.0.0.1:9"
    ),
    Mistake(("status", "--url", "http://"), 2, "--url 'http://': expected HOST:PORT or an http(s)"),
    Mistake(("status", "--url", "ftp://x:1"), 2, "expected HOST:PORT or an http(s) URL"),
    Mistake(("status", "--time", "1"), 2, "kvwatch status: unrecognized arguments: --time"),
    # probe
    Mistake(("probe", "--url", "not-a-url", "--prompt-tokens", "9"), 2, "is not an HTTP URL"),
    Mistake(("probe", "--url", "http://127.0.0.1:9"), 2, "say how long: --prompt-tokens"),
    Mistake(
        ("probe", "--url", "http://10.1.2.3:8000", "--prompt-tokens", "9"), 2, "not on loopback"
    ),
    Mistake(
        ("probe", "--url", "http://127.0.0.1:9", "--from-logs", "{t}/none.log"),
        2,
        "kvwatch probe: ",
    ),
    Mistake(("probe", "--url", "http://127.0.0.1:9", "--bogus"), 2, "kvwatch probe: unrecognized"),
    Mistake(("probe", "--url", "http://127.0.0.1:9", "--prompt", "9"), 2, "unrecognized arguments"),
    Mistake(
        ("probe", "--url", "http://127.0.0.1:9", "--prompt-tokens", "9", "--markers", "0"),
        2,
        "argument --markers: must be 1 to 1024, got 0",
    ),
    Mistake(
        ("probe", "--url", "http://127.0.0.1:9", "--prompt-tokens", "-9"),
        2,
        "argument --prompt-tokens: must be 1 to 1073741824, got -9",
    ),
    Mistake(
        ("probe", "--url", "http://127.0.0.1:9", "--prompt-tokens", "9", "--timeout", "-5"),
        2,
        "argument --timeout: must be more than 0s, got -5",
    ),
    # dashboards push
    Mistake(("dashboards",), 2, "the following arguments are required: dashboards_command"),
    Mistake(
        ("dashboards", "push", "--url", "http://127.0.0.1:9", "--token-file", "{t}/none"),
        1,
        "cannot read the token file {t}/none: No such file or directory",
    ),
    Mistake(
        ("dashboards", "push", "--url", "http://127.0.0.1:9", "--token-file", "{t}/token"),
        1,
        "Grafana at http://127.0.0.1:9 is unreachable",
        _token,
    ),
    Mistake(
        ("dashboards", "push", "--url", "x", "--token-file", "t", "--timeout", "0"),
        2,
        "argument --timeout: must be more than 0 seconds",
    ),
    Mistake(
        ("dashboards", "push", "--url", "x", "--token-file", "t", "--timeout", "1e9"),
        2,
        "argument --timeout: must be at most 3600 seconds",
    ),
    Mistake(
        ("dashboards", "push", "--url", "x", "--token-file", "t", "--token", "t"),
        2,
        "unrecognized arguments: --token t",
    ),
    Mistake(
        (
            "dashboards",
            "push",
            "--url",
            "http://127.0.0.1:9",
            "--token-file",
            "{t}/token",
            "--dashboards-dir",
            "{t}/dir",
        ),
        1,
        "no dashboard JSON in {t}/dir",
        _both(_token, _dir),
    ),
]


@pytest.fixture
def scratch() -> Iterator[Path]:
    # Readable by every user (the read-only journal row runs as nobody), unlike pytest's tmp.
    path = Path(tempfile.mkdtemp(prefix="kvwatch-mistake-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        subprocess.run(["rm", "-rf", str(path)], check=True)


def run_kvwatch(argv: list[str], *, as_nobody: bool = False) -> subprocess.CompletedProcess[str]:
    # As nobody, from a copy nobody can read: the checkout may sit under a 0700 folder.
    return anyuser.cli(*argv) if as_nobody else run_cli(*argv)


def assert_one_line(result: subprocess.CompletedProcess[str], code: int, says: str) -> None:
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert result.returncode == code, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert says in lines[0], lines[0]


def test_at_least_forty_mistakes() -> None:
    assert len(MISTAKES) >= 40
    commands = {m.argv[0] for m in MISTAKES if m.argv}
    assert commands >= {
        "daemon", "incidents", "spool", "check-logs", "export", "status", "probe", "dashboards",
    }  # fmt: skip


@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda m: " ".join(m.argv)[:60] or "(none)")
def test_mistake(mistake: Mistake, scratch: Path) -> None:
    mistake.setup(scratch)
    argv = [a.replace("{t}", str(scratch)) for a in mistake.argv]
    assert_one_line(run_kvwatch(argv), mistake.code, mistake.says.replace("{t}", str(scratch)))


def test_read_only_journal_as_another_user(scratch: Path) -> None:
    """The journal belongs to the daemon's user; someone else runs ``kvwatch incidents``."""
    journal = scratch / "journal.db"
    Journal(journal).close()
    journal.chmod(0o600)
    if os.geteuid() == 0:
        result = run_kvwatch(["incidents", "--journal", str(journal)], as_nobody=True)
    else:  # the suite's own user cannot read a file it made unreadable to itself
        journal.chmod(0o000)
        result = run_kvwatch(["incidents", "--journal", str(journal)])
    assert_one_line(result, 1, f"the journal {journal} is not readable by user ")


def test_journal_in_a_read_only_folder(scratch: Path) -> None:
    """A journal readable by all in a folder the reader cannot write: SQLite cannot make its
    -shm file there; the error names the journal."""
    folder = scratch / "ro"
    folder.mkdir()
    Journal(folder / "journal.db").close()
    (folder / "journal.db").chmod(0o644)
    folder.chmod(0o755)
    result = run_kvwatch(
        ["incidents", "--journal", str(folder / "journal.db")], as_nobody=os.geteuid() == 0
    )
    assert "Traceback" not in result.stderr
    if result.returncode != 0:
        assert_one_line(result, 1, f"cannot read the journal {folder / 'journal.db'}")
    else:
        assert result.stdout.strip().endswith("0 incident(s)")


def test_broken_pipe_is_quiet(scratch: Path) -> None:
    """``kvwatch spool DIR | head -1`` ends without a traceback."""
    from tests.kvwatch.spoolgen import Producer

    producer = Producer(scratch / "spool")
    (scratch / "spool").mkdir()
    producer.append(producer.hello(), *[producer.counters(n) for n in range(3000)])
    shell = f"{sys.executable} -m kvwatch.cli spool {scratch / 'spool'} | head -1"
    result = subprocess.run(
        ["bash", "-o", "pipefail", "-c", shell],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.stdout.count("\n") == 1 and result.stdout.startswith("{")
    assert result.stderr == ""
    assert result.returncode == 1


# -- a failed start leaves nothing; another program's file is left as it was ---------------------


def test_a_failed_start_creates_no_journal(scratch: Path) -> None:
    """A start that fails (the port taken, the spool folder a file) leaves no journal and no
    folder made for it: an empty journal was then read as "no such table: meta"."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    (scratch / "file").write_text("x")
    try:
        for extra in (
            ("--listen", f"127.0.0.1:{port}", "--spool-dir", str(scratch / "s")),
            ("--spool-dir", str(scratch / "file")),
        ):
            result = run_kvwatch(
                ["daemon", "--journal", str(scratch / "new" / "sub" / "j.db"), "--no-nvml", *extra]
            )
            assert result.returncode == 1, result.stderr
            assert not (scratch / "new").exists(), list((scratch / "new").rglob("*"))
    finally:
        taken.close()


def test_another_programs_database_is_left_as_it_was(scratch: Path) -> None:
    """``--journal other-app.db``: refused before anything is written (no kvwatch tables, no
    switch to WAL mode, no side files)."""
    _other_app(scratch)
    before = (scratch / "journal.db").read_bytes()
    result = run_kvwatch(
        ["daemon", "--journal", str(scratch / "journal.db"), "--spool-dir", str(scratch / "s")]
    )
    assert_one_line(result, 1, "is an SQLite database but not a kvwatch journal (tables: users)")
    assert (scratch / "journal.db").read_bytes() == before
    assert sorted(p.name for p in scratch.iterdir()) == ["journal.db"]


# -- status ----------------------------------------------------------------------------------


def test_status_json_without_a_daemon_is_json(scratch: Path) -> None:
    """A machine reading ``status --json`` gets an object with the error, and the exit code of
    the plain command."""
    import json

    for argv, code in (
        (["status", "--json", "--url", "127.0.0.1:9"], 1),
        (["status", "--json", "--url", "http://"], 2),
        (["status", "--json", "--config", str(scratch / "none.toml")], 2),
    ):
        result = run_kvwatch(argv)
        assert result.returncode == code, result.stderr
        reply = json.loads(result.stdout)
        assert reply["exit_code"] == code and reply["error"], reply
        assert_one_line(result, code, reply["error"][:40])


def test_status_takes_the_listen_address_as_written(scratch: Path) -> None:
    """``status --url 127.0.0.1:29400``: the daemon's listen setting, as the config writes it."""
    import json

    from tests.kvwatch.daemonproc import DaemonProcess

    daemon = DaemonProcess(scratch, "--no-nvml")
    try:
        port = daemon.wait_started()
        result = run_kvwatch(["status", "--json", "--url", f"127.0.0.1:{port}"])
        assert result.returncode in (0, 3, 4), result.stderr
        assert "level" in json.loads(result.stdout)
    finally:
        assert daemon.stop() == 0


# -- no abbreviations, anywhere ---------------------------------------------------------------


def _parsers(parser: object) -> Iterator[object]:
    import argparse

    assert isinstance(parser, argparse.ArgumentParser)
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_no_parser_takes_an_abbreviation() -> None:
    """``--spool DIR`` was taken as ``--spool-dir``: every kvwatch and minipd parser and
    subparser refuses abbreviations, and every other command line in the repository is built
    with ``allow_abbrev=False``."""
    import ast

    from kvwatch.cli import build_parser
    from minipd.cli import build_parser as minipd_parser

    for parser in [*_parsers(build_parser()), *_parsers(minipd_parser())]:
        assert parser.allow_abbrev is False, parser.prog  # type: ignore[attr-defined]
    unguarded = []
    for path in sorted(REPO.rglob("*.py")):
        relative = path.relative_to(REPO).parts
        if relative[0] in ("tests", ".venv", "build") or "node_modules" in relative:
            continue  # the tests' own parsers are no one's command line
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            if node.func.attr not in ("ArgumentParser", "add_parser"):
                continue
            if relative[0] == "kvwatch" and node.func.attr == "add_parser":
                continue  # kvwatch's subparsers are clihelp.Parser: checked above
            if not any(k.arg == "allow_abbrev" for k in node.keywords):
                unguarded.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not unguarded
