from __future__ import annotations

import os
from pathlib import Path

from kvwatch.ingest.logs.watch import EngineLog, LogFollower, LogWatcher
from kvwatch.store.state import State

LINE = (
    "[2026-09-01 12:00:00 TP0] max_total_num_tokens={pool}, chunked_prefill_size=8192,"
    " max_prefill_tokens=16384, max_running_requests=48, context_len=1048576,"
    " available_gpu_mem=12.34 GB\n"
)


def write(path: Path, text: str) -> None:
    with path.open("a") as handle:
        handle.write(text)


def test_follower_reads_partial_lines_once_complete(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    write(log, "one\ntw")
    follower = LogFollower(log)
    assert list(follower.lines()) == [b"one"]
    write(log, "o\n")
    assert list(follower.lines()) == [b"two"]
    assert list(follower.lines()) == []


def test_follower_across_rename_rotation_and_copytruncate(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    write(log, "a\n")
    follower = LogFollower(log)
    assert list(follower.lines()) == [b"a"]
    write(log, "b\nlast-unterminated")
    os.rename(log, tmp_path / "engine.log.1")  # logrotate's default
    write(log, "c\n")
    assert list(follower.lines()) == [b"b", b"last-unterminated", b"c"]
    write(log, "d\n")
    assert list(follower.lines()) == [b"d"]
    os.truncate(log, 0)  # copytruncate
    write(log, "e\n")
    assert list(follower.lines()) == [b"e"]


def test_follower_drops_over_long_lines(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    write(log, "x" * 200_000 + "\nok\n")
    follower = LogFollower(log)
    assert list(follower.lines()) == [b"ok"]
    assert follower.errors == {"long_line": 1}


def test_watcher_feeds_gauges_through_rotation(tmp_path: Path) -> None:
    log = tmp_path / "prefill.log"
    state = State()
    watcher = LogWatcher([EngineLog(str(log), role="prefill", engine="sglang")], state)
    write(log, "\x1b[33mINFO starting\x1b[0m\n" + LINE.format(pool=681280))
    watcher.poll()
    [source] = state.logs.values()
    assert source.gauges["kv_pool_tokens"] == 681280
    assert (source.role, source.engine, source.rank) == ("prefill", "sglang", 0)
    # The engine restarts with a bigger pool after the log rotated.
    os.rename(log, tmp_path / "prefill.log.1")
    write(log, "max_total_num_tokens=garbage\n" + LINE.format(pool="2,040,000"))
    watcher.poll()
    [source] = state.logs.values()
    assert source.gauges["kv_pool_tokens"] == 2040000
    assert state.log_counts[("errors", ("unparsed",))] == 1
    assert state.log_counts[("lines", ())] == 4
    watcher.close()


def test_watcher_missing_file_is_not_fatal(tmp_path: Path) -> None:
    state = State()
    watcher = LogWatcher([EngineLog(str(tmp_path / "nope.log"))], state)
    assert watcher.poll() == 0
    write(tmp_path / "nope.log", "GPU KV cache size: 10,000 tokens\n")
    assert watcher.poll() == 1
    [source] = state.logs.values()
    assert source.engine == "vllm"
