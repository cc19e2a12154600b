"""Three real processes: start-up lines, the HTTP API's edges, and no orphans on stop."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from tests.e2e.server import MiniPD, group_alive, post

RUNBOOK_SED = r"s/.*max_total_num_tokens=([0-9]+).*context_len=([0-9]+).*/pool=\1 context=\2/"


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def test_roles_log_sglang_startup_line_and_the_runbook_grep_reads_it(tmp_path: Path) -> None:
    args = ["--prefill-pool-tokens", "4096", "--decode-pool-tokens", "8192"]
    with MiniPD([*args, "--context-length", "6000"], tmp_path) as pd:
        assert pd.url.startswith("http://127.0.0.1:")
        assert pd.get("/health") == (200, {"status": "ok"})
    logs = [str(pd.logs / "prefill.log"), str(pd.logs / "decode.log")]
    grep = subprocess.run(
        ["grep", "-h", "max_total_num_tokens=", *logs], capture_output=True, text=True, check=True
    )
    fields = ("chunked_prefill_size=", "max_prefill_tokens=", "max_running_requests=")
    assert all(f in grep.stdout for f in fields) and "available_gpu_mem=" in grep.stdout
    sed = subprocess.run(
        ["sed", "-E", RUNBOOK_SED], input=grep.stdout, capture_output=True, text=True, check=True
    )
    assert sorted(sed.stdout.split("\n")[:2]) == [
        "pool=4096 context=6000",
        "pool=8192 context=6000",
    ]
    assert pd.stopped_cleanly


def test_api_errors_follow_sglang(tmp_path: Path) -> None:
    with MiniPD(["--pool-tokens", "1024", "--context-length", "100"], tmp_path) as pd:
        status, body = pd.generate("word " * 101)
        assert status == 400 and "context length" in body["error"]["message"]
        assert pd.generate("   ")[0] == 400
        assert post(pd.url + "/generate", {"text": 5})[0] == 400
        status, body = pd.generate("word " * 100, max_new_tokens=3)
        assert status == 200
        assert body["text"] == "word word word"
        meta = body["meta_info"]
        assert meta["prompt_tokens"] == 100 and meta["completion_tokens"] == 3
        assert meta["finish_reason"] == {"type": "length", "length": 3}
        assert pd.get("/nope")[0] == 404
    # Privacy: the prompt's words appear in no log.
    assert "word" not in pd.log("router") + pd.log("prefill") + pd.log("decode")


def test_sigterm_stops_all_three_processes(tmp_path: Path) -> None:
    with MiniPD([], tmp_path) as pd:
        assert pd.proc is not None
        assert len(group_members(pd.proc.pid)) == 4  # supervisor, router, prefill, decode
    assert pd.stopped_cleanly


def test_children_die_with_a_killed_supervisor(tmp_path: Path) -> None:
    with MiniPD([], tmp_path) as pd:
        assert pd.proc is not None
        pgid = pd.proc.pid
        os.kill(pgid, signal.SIGKILL)
        pd.proc.wait(5)
        deadline = time.monotonic() + 15
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_members(pgid)
    assert not group_alive(pgid)


def test_ready_line_names_the_release(tmp_path: Path) -> None:
    with MiniPD(["--release", "0.5.20"], tmp_path, kvwatch="log") as pd:
        assert re.search(r"release=0\.5\.20 kvwatch=log", "".join(pd.lines))
