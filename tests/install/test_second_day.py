"""The operator's second day, from the wheel, in the README's two-user layout (see
test_two_users): what goes wrong after the first install names its cause, and the counts add up.

Each test drives the installed ``kvwatch`` as the users involved: the daemon's own user, an
engine user in its group, a user outside it.
"""

from __future__ import annotations

import contextlib
import grp
import json
import pwd
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.install.test_two_users import Node, Users, as_user, node, users, walkthrough

__all__ = ["node", "users"]  # the fixtures, shared with test_two_users

pytestmark = pytest.mark.skipif(
    __import__("os").geteuid() != 0, reason="adds system users: needs root"
)


def as_(user: str, plain: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        as_user(user, str(plain / "kvwatch"), *argv),
        cwd="/", capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_permission_problems_name_who_may_read_and_who_may_acknowledge(
    node: Node, users: Users, engine: Path, plain: Path
) -> None:
    member = users.add("m", node.user)  # an on-call engineer in group kvwatch
    stranger = users.add("s")  # in no group of the daemon's
    node.start()
    walkthrough(engine, users.add("e", node.user), node.spool, node.root / "home-e")
    node.wait("the findings reach the journal", lambda: node.status()[0] == 4)
    journal = str(node.journal)

    # Outside the group: the journal's folder (StateDirectoryMode 0750) keeps them out.
    for command in (["incidents"], ["ack", "--all"]):
        line = one_line_error(as_(stranger, plain, *command, "--journal", journal))
        assert line.startswith(f"kvwatch {command[0]}: the journal {journal} is not readable"), line
        assert f"user {stranger}" in line and f"member of group {node.user}" in line, line
        assert f"usermod -aG {node.user} {stranger}" in line, line

    # In the group: reads, but acknowledging writes the daemon's journal (0640, its own).
    listed = as_(member, plain, "incidents", "--journal", journal)
    assert listed.returncode == 0 and "page_tag" in listed.stdout, listed.stderr
    line = one_line_error(as_(member, plain, "ack", "--all", "--journal", journal))
    assert f"user {member} may not write the journal {journal}" in line, line
    assert f"only {node.user} (sudo -u {node.user} ...) or root may" in line, line
    assert "readonly database" not in line, line

    # As the message says: the daemon's user acknowledges, and the alarm clears.
    acked = as_(node.user, plain, "ack", "--all", "--journal", journal)
    assert acked.returncode == 0, acked.stderr
    node.wait("ack clears the alarm", lambda: node.status()[0] != 4)
    assert node.status()[1]["integrity"]["acknowledged"] > 0  # type: ignore[index]
    # ... and `incidents` (table and JSON) says who acknowledged each, when.
    listed = as_(member, plain, "incidents", "--journal", journal, "--json")
    assert listed.returncode == 0, listed.stderr
    shown = json.loads(listed.stdout)
    assert shown and all(i["acknowledged"]["by"] == node.user for i in shown), shown
    table = as_(member, plain, "incidents", "--journal", journal).stdout
    assert "ACKED" in table.splitlines()[0] and f" {node.user} 20" in table, table


WRITE_AS_A_NEWER_ENGINE = r"""
import fcntl, os, sys, time
from kvspool import SpoolWriter, encode_frame, encode_payload

spool = sys.argv[1]
writer = SpoolWriter(spool, engine="vllm", role="decode")
writer.write("gauges", {"gauges": [["kv_pool_tokens", {}, 1.0]]})
# A hook through the writer's API writing a hello mid-segment: the writer refuses it.
writer.write("hello", dict(writer.identity))
# What a newer engine's writer (whose contract knows a "tier" label) appends: a whole record
# this daemon's schema rejects, numbered in the stream like any other.
newer = {"v": 1, "type": "gauges", "producer": writer.producer, "seq": writer.seq + 1,
         "ts": time.time(), "gauges": [["kv_pool_tokens", {"tier": "hbm"}, 1.0]]}
with writer._lock:
    os.write(writer._fd, encode_frame(encode_payload(newer)))
    writer._seq += 1
writer.write("gauges", {"gauges": [["kv_pool_tokens", {}, 2.0]]})
print(writer.seq, writer.dropped["invalid"])
"""


def test_a_record_rejected_whole_is_rejected_not_lost(
    node: Node, users: Users, engine: Path
) -> None:
    engine_user = users.add("e", node.user)
    node.start()
    result = subprocess.run(
        as_user(engine_user, str(engine / "python"), "-c", WRITE_AS_A_NEWER_ENGINE,
                str(node.spool)),
        cwd="/", capture_output=True, text=True, timeout=120, check=False, umask=0o027,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["4", "1"], result.stdout  # hello, gauges, newer, gauges
    assert "refused" in result.stderr, result.stderr  # the engine's log says so, once
    node.wait(
        "the records are read",
        lambda: node.metric("kvwatch_spool_records_total") == 3,  # hello, two gauges
    )
    assert node.metric("kvwatch_spool_rejected_total", reason="malformed") == 1
    assert node.metric("kvwatch_spool_rejected_total", reason="hello") == 0
    assert node.metric("kvwatch_spool_lost_records_total") == 0
    code, summary = node.status()
    assert summary["integrity"]["lost_records"] == 0, summary  # type: ignore[index]
    assert code != 4, summary


WRITE_FINDINGS = r"""
import sys
from kvspool import SpoolWriter

writer = SpoolWriter(sys.argv[1], engine="vllm", role="decode", max_segments=10_000)
for i in range(int(sys.argv[2])):
    writer.write("event", {
        "detector": "canary", "kind": "unwritten_page", "mode": "log", "action": "logged",
        "request_id": f"req-{i}", "pages": [i % 4096, 7], "pages_total": 2,
        "detail": {"unwritten": 1},
    })
writer.close()
print(writer.seq, writer.dropped.total())
"""


def ready(node: Node) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{node.url}/-/ready", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_a_full_journal_disk_names_itself_and_loses_nothing(
    node: Node, users: Users, engine: Path
) -> None:
    """The journal's folder on a 512 KiB tmpfs: the daemon names the full disk (status, the
    coverage check, ``/-/ready``), records wait in the spool, and once the disk grows every one
    is journaled, none lost."""
    folder = node.journal.parent
    ids = f"uid={pwd.getpwnam(node.user).pw_uid},gid={grp.getgrnam(node.user).gr_gid}"
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size=512k,mode=0750,{ids}", "tmpfs", str(folder)],
        check=True,
    )
    try:
        node.start()
        result = subprocess.run(
            as_user(users.add("e", node.user), str(engine / "python"), "-c", WRITE_FINDINGS,
                    str(node.spool), "6000"),
            cwd="/", capture_output=True, text=True, timeout=300, check=False, umask=0o027,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        written, dropped = map(int, result.stdout.split())
        assert dropped == 0, result.stdout

        def coverage() -> str:
            checks = node.status()[1]["checks"]
            return next(c["line"] for c in checks if c["name"] == "coverage")  # type: ignore[union-attr, index, attr-defined]

        node.wait("the journal's disk fills", lambda: "journal's disk is full" in coverage(), 120)
        line = coverage()
        assert str(folder) in line and "records wait in the spool" in line, line
        assert "spool folder is missing" not in line, line
        code, body = ready(node)
        assert code == 503 and "journal's disk is full" in body, (code, body)

        subprocess.run(["mount", "-o", "remount,size=64m", str(folder)], check=True)
        node.wait(
            "every record reaches the journal once the disk grows",
            lambda: node.metric("kvwatch_spool_records_total") == written,
            120,
        )
        assert node.metric("kvwatch_spool_lost_records_total") == 0
        assert ready(node)[0] == 200
        assert "journal's disk is full" not in coverage()
        listed = node.kvwatch("incidents", "--journal", str(node.journal), "--json")
        assert listed.returncode == 0, listed.stderr
    finally:
        node.stop()
        node.proc = None
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_each_incident_is_one_log_line_and_status_reads_the_installed_config(
    node: Node, users: Users, engine: Path, plain: Path
) -> None:
    """The daemon logs one structured line per incident (its id as ``kvwatch incidents`` shows
    it, the request, the node), and ``kvwatch status`` with no flags finds the daemon through
    ``/etc/kvwatch/kvwatch.toml``, where the README installs it (this node listens elsewhere
    than the default port)."""
    installed = Path("/etc/kvwatch/kvwatch.toml")
    assert not installed.exists(), (
        "a kvwatch is installed on this machine: the test would clobber it"
    )
    node.start()
    walkthrough(engine, users.add("e", node.user), node.spool, node.root / "home-e")
    node.wait("the findings reach the journal", lambda: node.status()[0] == 4)
    listed = node.kvwatch("incidents", "--journal", str(node.journal), "--json")
    assert listed.returncode == 0, listed.stderr
    incidents = json.loads(listed.stdout)
    logged = [
        json.loads(line) for line in node.log().splitlines()
        if line.startswith("{") and json.loads(line).get("event") == "spool.incident"
    ]  # fmt: skip
    assert incidents and len(logged) == len(incidents), (logged, incidents)
    assert {(e["id"], e["request_id"], e["node"]) for e in logged} == {
        (i["id"], i["request_id"], i["node"]) for i in incidents
    }

    installed.parent.mkdir(exist_ok=True)
    try:
        shutil.copy(node.config, installed)
        installed.chmod(0o644)
        result = as_(node.user, plain, "status", "--json")
        assert result.returncode == 4, (result.returncode, result.stdout, result.stderr)
        assert json.loads(result.stdout)["integrity"]["affected"] == len(incidents)
    finally:
        installed.unlink()
        with contextlib.suppress(OSError):
            installed.parent.rmdir()


#: An engine's start as SGLang's plugin makes it (its settings from the environment, the hooks
#: given them): it stays up until its stdin closes, so its producer is live while checked.
ENGINE_WITH_SETTINGS = r"""
import logging, sys
from engine_hooks import KVWatch
from engine_hooks.sglang.config import from_env

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
settings = from_env()
watch = KVWatch(None, role="prefill", engine="sglang", model="m", mode=settings.modes(),
                spool=settings.spool, scrub=settings.scrub, config_errors=settings.config_errors)
watch.report_pool(4096, 2048, 16)
watch.flush()
print(settings.mode.value, settings.flush_interval, ",".join(settings.config_errors), flush=True)
sys.stdin.readline()
"""


def test_a_misspelt_setting_is_an_error_line_an_alarm_and_an_alert_series(
    node: Node, users: Users, engine: Path
) -> None:
    """``KVWATCH_MODE=enforse`` and ``KVWATCH_FLUSH_INTERVAL=1s``: the engine's log says each
    (variable, value, valid ones, what it runs as), the engine runs in ``log`` mode, and the
    daemon shows it: ``kvwatch status`` ALARM naming the process and settings,
    ``kvwatch_engine_config_errors{setting}`` (what KVEngineMisconfigured pages on) and
    ``kvwatch_engine_info{mode,scrub}``; the alarm clears when the engine is gone."""
    engine_user = users.add("e", node.user)
    node.start()
    env = {
        "PATH": "/usr/bin:/bin", "KVWATCH_SPOOL": str(node.spool), "KVWATCH_MODE": "enforse",
        "KVWATCH_FLUSH_INTERVAL": "1s", "KVWATCH_SCRUB": "on_free",
    }  # fmt: skip
    process = subprocess.Popen(
        as_user(engine_user, str(engine / "python"), "-c", ENGINE_WITH_SETTINGS),
        cwd="/", env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, umask=0o027,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        assert process.stdout.readline().split() == ["log", "1.0", "mode,flush_interval"]
        node.wait("the hello is read", lambda: node.status()[0] == 4)
        code, summary = node.status()
        assert code == 4, summary
        (check,) = [c for c in summary["checks"] if c["name"] == "engine_config"]  # type: ignore[union-attr,index]
        assert check["level"] == "alarm", check
        assert "sglang prefill rank 0" in check["line"] and "mode, flush_interval" in check["line"]
        assert node.metric("kvwatch_engine_config_errors", role="prefill", setting="mode") == 1
        assert (
            node.metric("kvwatch_engine_config_errors", role="prefill", setting="flush_interval")
            == 1
        )
        assert node.metric("kvwatch_engine_config_errors", role="prefill", setting="scrub") == 0
        info = {"engine": "sglang", "version": "", "role": "prefill", "model": "m"}
        assert node.metric("kvwatch_engine_info", **info, mode="log", scrub="on_free") == 1
    finally:
        _, stderr = process.communicate(input="\n", timeout=60)
    errors = [line for line in stderr.splitlines() if line.startswith("ERROR")]
    assert errors == [
        "ERROR kvwatch: KVWATCH_MODE='enforse' is not valid (valid: off|log|enforce); running "
        "as log. Fix the setting and restart the engine",
        "ERROR kvwatch: KVWATCH_FLUSH_INTERVAL='1s' is not valid (valid: a number of seconds >= "
        "0.1, such as 1); using 1. Fix the setting and restart the engine",
    ], stderr
    node.wait("the engine is gone: the alarm clears", lambda: node.status()[0] != 4, 120)


#: An engine's spool writer as the hooks make one, writing three records: prints its drops.
WRITE_THREE = r"""
import logging, sys
from kvspool import SpoolWriter

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
writer = SpoolWriter(sys.argv[1], engine="sglang", role="prefill")
for _ in range(3):
    writer.write("gauges", {"gauges": [["kv_pool_tokens", {}, 4096.0]]})
writer.close()
print(writer.written, dict(writer.dropped))
"""


def test_without_systemd_init_makes_the_folders_and_the_hooks_never_do(
    node: Node, users: Users, engine: Path, plain: Path
) -> None:
    """``kvwatch init`` makes the folders the unit would (owners, modes) and names one that is
    otherwise; a misspelt ``KVWATCH_SPOOL`` is not created by the hooks but named in the
    engine's log and its records counted dropped; a spool no daemon beats in is named too."""
    engine_user = users.add("e", node.user)

    def write(spool: Path) -> tuple[str, str]:
        result = subprocess.run(
            as_user(engine_user, str(engine / "python"), "-c", WRITE_THREE, str(spool)),
            cwd="/", capture_output=True, text=True, timeout=120, check=False, umask=0o027,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        return result.stdout.strip(), result.stderr

    shutil.rmtree(node.root / "run")
    shutil.rmtree(node.root / "var")
    argv = ["init", "--config", str(node.config), "--user", node.user, "--group", node.user]
    made = subprocess.run(
        [str(plain / "kvwatch"), *argv], capture_output=True, text=True, check=False
    )
    assert made.returncode == 0, made.stderr
    assert f"created {node.spool} {node.user}:{node.user} 2770" in made.stdout, made.stdout
    for folder, mode in ((node.spool, 0o2770), (node.journal.parent, 0o750)):
        info = folder.stat()
        assert (info.st_mode & 0o7777, info.st_uid) == (mode, pwd.getpwnam(node.user).pw_uid)
        assert grp.getgrgid(info.st_gid).gr_name == node.user

    # Before the daemon runs: the records are written, and the engine's log says none reads them.
    out, err = write(node.spool)
    assert out == "4 {}", out  # the hello and three gauges
    assert f"no kvwatch daemon reads the spool {node.spool}" in err, err
    misspelt = node.spool.parent / "spoool"
    out, err = write(misspelt)
    assert out == "0 {'no_spool': 3}", out
    assert not misspelt.exists()
    (warning,) = [line for line in err.splitlines() if line.startswith("WARNING")]
    assert f"cannot write the spool {misspelt}" in warning and "does not exist" in warning

    node.start()
    node.wait("the daemon beats", (node.spool / "kvwatch-daemon.heartbeat").exists)
    out, err = write(node.spool)
    assert out == "4 {}" and "WARNING" not in err, err
    node.wait("both writers' records are read", lambda: (
        node.metric("kvwatch_spool_records_total") == 8
    ))  # fmt: skip

    node.spool.chmod(0o2777)
    again = subprocess.run(
        [str(plain / "kvwatch"), *argv], capture_output=True, text=True, check=False
    )
    assert again.returncode == 1, again
    line = one_line_error(again)
    assert f"kvwatch init: {node.spool} exists as" in line and "2777" in line and "2770" in line
    assert node.spool.stat().st_mode & 0o7777 == 0o2777  # named, never changed


def test_check_config_reads_the_config_as_the_daemon_would(
    node: Node, users: Users, plain: Path
) -> None:
    """``kvwatch check-config``: the installed config is valid; a misspelt key, a bad duration
    and a file the daemon's user cannot read are each one line naming it (exit 1)."""
    result = as_(node.user, plain, "check-config", str(node.config))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"SUCCESS: {node.config} is valid kvwatch daemon config"
    assert "Traceback" not in result.stderr
    text = node.config.read_text()
    broken = node.root / "broken.toml"
    for change, says in (
        ('\nspool_dri = "/x"\n', "spool_dri"),
        ('\nidle_grace = "5 seconds"\n', "idle_grace"),
        ('\nalertmanager_password_file = "/root/am-password"\n', "alertmanager_password_file"),
    ):
        broken.write_text(text + change)
        broken.chmod(0o644)
        line = one_line_error(as_(node.user, plain, "check-config", str(broken)))
        assert line.startswith(f"kvwatch check-config: config {broken}: ") and says in line, line


def test_a_reload_applies_the_config_without_a_restart(node: Node) -> None:
    """``systemctl reload kvwatch`` (the unit's ExecReload: SIGHUP): a valid change applies and
    the daemon keeps its pid; a broken file is refused and the daemon runs on."""
    import signal

    assert "ExecReload=/bin/kill -HUP $MAINPID" in node.unit
    node.start()
    assert node.proc is not None
    text = node.config.read_text()

    def events(name: str) -> list[dict[str, object]]:
        lines = [json.loads(x) for x in node.log().splitlines() if x.startswith("{")]
        return [e for e in lines if e.get("event") == name]

    node.config.write_text(text + '\npoll_interval = "500ms"\n')
    node.proc.send_signal(signal.SIGHUP)
    node.wait("the reload applies", lambda: events("config.reloaded"))
    assert events("config.reloaded")[0]["applied"] == ["poll_interval"]
    assert node.metric("kvwatch_config_last_reload_successful") == 1
    node.config.write_text(text + '\npoll_interval = "half a second"\n')
    node.proc.send_signal(signal.SIGHUP)
    node.wait("the broken file is refused", lambda: events("config.reload_failed"))
    assert node.metric("kvwatch_config_last_reload_successful") == 0
    assert node.proc.poll() is None and node.status()[0] in (0, 3)
