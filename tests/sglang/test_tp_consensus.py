"""One verdict per request across a TP group: SGLang's real classes, two ranks, two processes.

SGLang runs one scheduler (and so one kvwatch plugin) per TP rank, each on its shard of the KV
heads. A check that fails on one rank's shard must fail the request on every rank, in one
collective per admission batch over the group's gloo CPU group, with no rank left waiting.
SGLang's CPU path cannot run a TP server on these machines (tests/sglang_pd/README.md), so the
ranks here are two processes serving through SGLang's own door, ``_pre_alloc``,
``process_prebuilt`` and batch result path (``tp_ranks.py``).
"""

from __future__ import annotations

import multiprocessing
import socket
from pathlib import Path
from typing import Any

from engine_hooks.testing import read_spool
from tests.sglang.tp_ranks import Plan, rank_main

#: A request that stays unserved this long on some rank is a hang (each runs in milliseconds).
HANG_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(tmp_path: Path, mode: str, plan: Plan) -> list[dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs, pipes = [], []
    for rank in (0, 1):
        parent, child = ctx.Pipe(duplex=False)
        spool = tmp_path / f"spool-rank{rank}"
        proc = ctx.Process(
            target=rank_main, args=(rank, port, str(spool), mode, plan, child), daemon=True
        )
        proc.start()
        child.close()
        procs.append(proc)
        pipes.append(parent)
    results = []
    try:
        for rank, pipe in enumerate(pipes):
            assert pipe.poll(HANG_S), f"rank {rank} hung (no verdict in {HANG_S:.0f} s)"
            status, value = pipe.recv()
            assert status == "ok", f"rank {rank}:\n{value}"
            results.append(value)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return results


def events(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    spool = read_spool(result["spool"])
    return [(e["request_id"], e["detector"], e["kind"], e["action"]) for e in spool.events()]


def test_one_ranks_failed_shard_fails_the_request_on_every_rank(tmp_path: Path) -> None:
    """Enforce: rank 1's transfer wrote one of the request's pages, rank 0's all of them. Both
    ranks fail it (HTTP 500), neither hangs, and the next request is served on both."""
    plan: Plan = [("short-shard", 0x5EED, 100, {0: None, 1: 1}), ("next", 0x5EEE, 100, {})]
    results = run_ranks(tmp_path, "enforce", plan)
    for rank, result in enumerate(results):
        assert result["finished"]["short-shard"][:2] == ("FINISH_ABORT", 500), rank
        assert result["finished"]["next"][0] == "FINISH_LENGTH", rank
    # The finding is the failing rank's alone; the other rank failed it on the verdict.
    assert events(results[0]) == []
    found = events(results[1])
    assert ("short-shard", "canary", "unwritten_page", "enforced") in found
    assert {(rid, action) for rid, _, _, action in found} == {("short-shard", "enforced")}


def test_log_mode_findings_of_every_rank_name_one_instance(tmp_path: Path) -> None:
    """Log: both ranks' shards short: a finding on each rank, one request instance (the
    router's bootstrap room), so the daemon makes one incident; both ranks serve it."""
    plan: Plan = [("both-short", 0xABC, 100, {0: 1, 1: 1})]
    results = run_ranks(tmp_path, "log", plan)
    instances = set()
    for result in results:
        assert result["finished"]["both-short"][0] == "FINISH_LENGTH"
        spool = read_spool(result["spool"])
        found = spool.events(request_id="both-short", detector="canary")
        assert [e["kind"] for e in found] == ["unwritten_page"]
        instances.update(e["instance"] for e in spool.events(request_id="both-short"))
    assert len(instances) == 1
