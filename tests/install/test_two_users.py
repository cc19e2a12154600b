"""The README's layout with real users: the daemon as its own user, the engines as theirs.

From the installed wheel: the daemon runs as a system user (the unit's ``kvwatch``), from the
daemon's venv, with the unit's spool folder (owner, group and ``RuntimeDirectoryMode`` read from
the unit the wheel exports) and the unit's umask; the engine (``python -m
engine_hooks.walkthrough``, minipd with the hooks) runs as another user in the daemon's group, from
the engine's venv. Its findings must reach the journal, ``kvwatch incidents`` and an ALARM in
``kvwatch status``. A user outside the group writing through a spool someone opened to all is
ignored, and loudly: ``status`` names it, its uid and its segments, and the metrics count them.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.install.conftest import run
from tests.install.test_readme import free_port

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="adds system users: needs root")


class Users:
    """System users made for one test (``useradd``), removed after it."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(3)
        self.made: list[str] = []

    def add(self, role: str, *groups: str) -> str:
        name = f"kvw{role}{self.tag}"
        extra = ["--groups", ",".join(groups)] if groups else []
        run(
            ["useradd", "--system", "--user-group", "--no-create-home", "--shell",
             "/usr/sbin/nologin", *extra, name],
            cwd=Path("/"),
        )  # fmt: skip
        self.made.append(name)
        return name

    def remove(self) -> None:
        for name in reversed(self.made):
            run(["userdel", name], cwd=Path("/"), check=False)
            run(["groupdel", name], cwd=Path("/"), check=False)  # when userdel left it


@pytest.fixture
def users() -> Iterator[Users]:
    made = Users()
    try:
        yield made
    finally:
        made.remove()


def as_user(user: str, *argv: str) -> list[str]:
    """``argv`` as ``user`` with its groups from the group database, as systemd and login do."""
    return ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--", *argv]


def unit_setting(unit: str, key: str) -> str:
    match = re.search(rf"^{key}=(.*)$", unit, flags=re.M)
    assert match, key
    return match.group(1).strip()


class Node:
    def __init__(self, root: Path, plain: Path, daemon_user: str) -> None:
        self.root = root
        self.plain = plain
        self.user = daemon_user
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.spool = root / "run/kvwatch/spool"
        self.journal = root / "var/lib/kvwatch/journal.db"
        self.proc: subprocess.Popen[bytes] | None = None
        deploy = root / "deploy"
        run([str(plain / "kvwatch"), "export", "deploy", str(deploy)], cwd=root)
        self.unit = (deploy / "kvwatch.service").read_text()
        # What systemd makes of the unit: RuntimeDirectory= (owned User:Group, with
        # RuntimeDirectoryMode=), StateDirectory= (StateDirectoryMode=).
        assert unit_setting(self.unit, "User") == unit_setting(self.unit, "Group") == "kvwatch"
        assert unit_setting(self.unit, "RuntimeDirectory") == "kvwatch kvwatch/spool"
        for folder, key in (
            (self.spool.parent, "RuntimeDirectoryMode"),
            (self.spool, "RuntimeDirectoryMode"),
            (self.journal.parent, "StateDirectoryMode"),
        ):
            folder.mkdir(parents=True, exist_ok=True)
            shutil.chown(folder, daemon_user, daemon_user)
            folder.chmod(int(unit_setting(self.unit, key), 8))
        config = root / "kvwatch.toml"
        text = (deploy / "kvwatch.toml").read_text()
        for key in ("spool_dir", "journal"):
            text = re.sub(rf'^{key} = "/', f'{key} = "{root}/', text, flags=re.M)
        text = re.sub(r'^listen = ".*"', f'listen = "127.0.0.1:{self.port}"', text, flags=re.M)
        text = re.sub(r"^nvml = true", "nvml = false", text, flags=re.M)  # no GPU on CI
        config.write_text(text)
        config.chmod(0o644)
        self.config = config

    def start(self) -> None:
        umask = int(unit_setting(self.unit, "UMask"), 8)
        argv = as_user(
            self.user, str(self.plain / "kvwatch"), "daemon", "--config", str(self.config),
            "--idle-grace", "1s",
        )  # fmt: skip
        log = (self.root / "daemon.log").open("w")
        self.proc = subprocess.Popen(
            argv, cwd="/", stdout=log, stderr=subprocess.STDOUT, umask=umask
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2):
                    return
            except OSError:
                assert self.proc.poll() is None, self.log()
                assert time.monotonic() < deadline, self.log()
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            assert self.proc.wait(30) == 0, self.log()

    def log(self) -> str:
        return (self.root / "daemon.log").read_text()

    def kvwatch(self, *argv: str) -> subprocess.CompletedProcess[str]:
        """The CLI as the daemon's user (the journal is its own, mode 0640)."""
        argv_ = as_user(self.user, str(self.plain / "kvwatch"), *argv)
        return run(argv_, cwd=self.root, check=False)

    def status(self) -> tuple[int, dict[str, object]]:
        result = self.kvwatch("status", "--url", self.url, "--json")
        return result.returncode, json.loads(result.stdout)

    def metric(self, name: str, **labels: str) -> float:
        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=10).read().decode()
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        series = f"{name}{{{want}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(series + " "):
                return float(line.split()[-1])
        raise AssertionError(f"no series {series}")

    def wait(self, what: str, done: object, seconds: float = 60) -> None:
        deadline = time.monotonic() + seconds
        while not done():  # type: ignore[operator]
            assert time.monotonic() < deadline, f"{what}: {self.status()}\n{self.log()[-3000:]}"
            time.sleep(0.25)


def walkthrough(engine: Path, user: str, spool: Path, home: Path) -> None:
    """minipd's detector walkthrough as ``user``: the hooks write its findings to ``spool``."""
    home.mkdir(mode=0o700)
    shutil.chown(home, user, user)
    result = subprocess.run(
        as_user(user, str(engine / "python"), "-m", "engine_hooks.walkthrough", "--spool",
                str(spool)),
        cwd="/", env={"PATH": os.environ["PATH"], "HOME": str(home)}, capture_output=True,
        text=True, timeout=300, check=False, umask=0o022,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture
def node(users: Users, plain: Path) -> Iterator[Node]:
    root = Path(tempfile.mkdtemp(prefix="kvwatch-node-"))
    root.chmod(0o755)
    made = Node(root, plain, users.add("d"))
    try:
        yield made
    finally:
        made.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("setgid", [True, False], ids=["unit", "spool-not-setgid"])
def test_engine_user_in_the_daemons_group_is_ingested(
    node: Node, users: Users, engine: Path, setgid: bool
) -> None:
    engine_user = users.add("e", node.user)
    if not setgid:  # a spool folder made by hand, 0770: the writer gives segments its group
        node.spool.chmod(0o770)
    node.start()
    code, summary = node.status()
    assert code == 3 and summary["level"] == "warning", summary  # no engine yet
    walkthrough(engine, engine_user, node.spool, node.root / "home-e")
    node.wait("the engine's findings reach the journal", lambda: node.status()[0] == 4)
    code, summary = node.status()
    assert str(summary["headline"]).startswith("ALARM: INTEGRITY ALERT"), summary
    incidents = node.kvwatch("incidents", "--journal", str(node.journal))
    assert incidents.returncode == 0, incidents.stderr
    assert "minipd" in incidents.stdout and "page_tag" in incidents.stdout, incidents.stdout
    assert node.metric("kvwatch_spool_ignored_segments", reason="owner") == 0
    assert node.metric("kvwatch_spool_ignored_segments", reason="unreadable") == 0
    assert node.metric("kvwatch_spool_rejected_total", reason="owner") == 0
    assert "spool.open_failed" not in node.log()
    assert (node.spool.stat().st_mode & 0o7777) == (0o2770 if setgid else 0o770)


def test_a_user_outside_the_group_is_named_and_paged(
    node: Node, users: Users, engine: Path
) -> None:
    stranger = users.add("s")  # in no group of the daemon's
    node.start()
    # Someone opened the spool to every user: the stranger's engine writes into it.
    node.spool.parent.chmod(node.spool.parent.stat().st_mode | 0o001)
    node.spool.chmod(node.spool.stat().st_mode | 0o007)
    walkthrough(engine, stranger, node.spool, node.root / "home-s")
    segments = list(node.spool.glob("*.kvs"))
    uid = Path(segments[0]).stat().st_uid
    node.wait(
        "the stranger's segments are counted",
        lambda: node.metric("kvwatch_spool_ignored_segments", reason="owner") == len(segments),
    )
    assert node.metric("kvwatch_spool_ignored_findings") > 0
    code, summary = node.status()
    headline = str(summary["headline"])
    assert code == 4, summary
    assert headline.startswith(f"ALARM: {len(segments)} spool segment(s) of {stranger} (uid {uid})")
    assert "finding(s) in them are not in the journal" in headline
    # Nothing of it reached the journal: the findings wait in the spool, untouched.
    incidents = node.kvwatch("incidents", "--journal", str(node.journal))
    assert "minipd" not in incidents.stdout, incidents.stdout
    assert sorted(node.spool.glob("*.kvs")) == sorted(segments)
