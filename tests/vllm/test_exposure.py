"""Blast radius and scrub, through vLLM's own scheduler, block pool and runner connector code.

A load that delivers fewer blocks than the request reads leaves the reader with blocks that
still hold what was there before. The sources kvwatch names are checked against vLLM's own
block ownership (``KVCacheManager.get_block_ids`` of every request while it ran): exactly the
requests whose KV those blocks last held, never the reader. With the connector's ``scrub``
extra config the same reader reads zeros (and canary stamps), and the detectors still fire.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import RUNNERS, Pair, kv_cache_config, kvwatch_child, pair, vllm_config
from transport import LINKS
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from engine_hooks import Scrub, canary
from engine_hooks.testing import read_spool
from engine_hooks.vllm import KVWatchConnector

BLOCK = 4
NUM_BLOCKS = 16
READER = "reader"
READER_PROMPT = list(range(100, 116))  # four blocks
LOST = (0, 1)  # the reader's blocks its load never delivers
USER_PROMPT = 5  # tokens: the load fills the first two blocks, decode's forward the rest
EXPOSING = {("canary", "unwritten_page"), ("page_tag", "stale_tag"), ("checksum", "digest")}


@pytest.fixture(params=RUNNERS)
def runner(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def start(tmp_path: Path, model: str, runner: str, scrub: str = "off") -> Pair:
    return pair(
        tmp_path, model, "async", "log", runner, num_blocks=NUM_BLOCKS, scrub=scrub
    )  # fmt: skip


def record_owners(p: Pair, owners: dict[int, tuple[str, bool]]) -> None:
    """Block -> the request whose KV vLLM's block table says it holds, and whether only that
    request's own forward wrote it (past its loaded prompt blocks): every running request's
    blocks over the tokens computed so far."""
    scheduler = p.decode.scheduler
    loaded = -(-USER_PROMPT // BLOCK)
    for request in scheduler.running:
        if request.status != RequestStatus.RUNNING:
            continue
        computed = -(-request.num_computed_tokens // BLOCK)
        for i, block in enumerate(p.decode.blocks(request.request_id)[:computed]):
            owners[block] = (request.request_id, i >= loaded)


def serve_users(p: Pair, users: int = 5) -> dict[int, tuple[str, bool]]:
    """Users served one after another (short prompts, longer replies: some of their blocks are
    written by decode's own forward only); returns who held each block, from vLLM's block
    tables (see :func:`record_owners`)."""
    owners: dict[int, tuple[str, bool]] = {}
    for i in range(users):
        rid = f"user-{i}"
        p.serve(rid, [10 * i + t for t in range(1, USER_PROMPT + 1)], max_tokens=10)
        for _ in range(100):
            p.step()
            record_owners(p, owners)
            if p.idle():
                break
        assert p.decode.finished[rid].finish_reason == FinishReason.LENGTH
    return owners


def read_with_lost_blocks(p: Pair) -> list[int]:
    """The reader's load arrives without two of its blocks (they keep what decode's reservation
    left there); returns those blocks."""
    p.prompts[READER] = READER_PROMPT
    p.send(READER, READER_PROMPT)
    while READER not in p.prefill.finished:
        p.prefill.step()
    params = dict(p.prefill.finished[READER].kv_transfer_params or {})
    p.decode.add(READER, READER_PROMPT, 3, params)
    p.decode.step()  # reserved (and stamped, and scrubbed on_reserve); waiting for the KV
    lost = [p.decode.blocks(READER)[i] for i in LOST]
    saved = {(name, b): view[b].clone() for name, view in p.decode.kv.items() for b in lost}

    def lose(_rid: str, kv: dict[str, torch.Tensor], blocks: list[int]) -> None:
        for (name, block), data in saved.items():
            kv[name][block].copy_(data)

    LINKS[p.decode.link].on_arrival[READER] = lose
    return lost


def nonzero_bytes(p: Pair, block: int) -> int:
    return sum(int(view[block].view(torch.uint8).count_nonzero()) for view in p.decode.kv.values())


def reader_events(tmp_path: Path) -> list[dict[str, Any]]:
    events = read_spool(tmp_path / "spool").events(request_id=READER)
    assert {(e["detector"], e["kind"]) for e in events} == EXPOSING
    return events


def sources(event: dict[str, Any]) -> dict[str, int]:
    return {s["request_id"]: s["pages"] for s in event.get("sources", [])}


def test_a_short_load_names_exactly_the_exposed_requests(
    tmp_path: Path, model: str, runner: str
) -> None:
    p = start(tmp_path, model, runner)
    owners = serve_users(p)
    lost = read_with_lost_blocks(p)
    held = Counter(owners[b][0] for b in lost if b in owners)
    assert sum(held.values()) == len(lost)  # the test is about something: all were users'
    # ... one written by a load, one by decode's own forward only
    assert sorted(owners[b][1] for b in lost) == [False, True]
    p.run()
    assert p.decode.finished[READER].finish_reason == FinishReason.LENGTH  # log mode: served
    for event in reader_events(tmp_path):
        assert sorted(event["pages"]) == sorted(lost)
        assert sources(event) == dict(held)  # exactly, page counts included
        assert READER not in sources(event)
        assert event["other_sources"] == 0


@pytest.mark.parametrize("scrub", ["on_free", "on_reserve"])
def test_scrub_leaves_the_reader_zeros_and_the_detectors_still_fire(
    tmp_path: Path, model: str, runner: str, scrub: str
) -> None:
    p = start(tmp_path, model, runner, scrub)
    serve_users(p)
    lost = read_with_lost_blocks(p)
    for block in lost:  # what decode will read: nothing but the canary stamp
        assert nonzero_bytes(p, block) <= canary.STAMP_BYTES, block
    p.run()
    for event in reader_events(tmp_path):
        assert sorted(event["pages"]) == sorted(lost)
        assert event["sources"] == []  # the blocks held nobody's data


def test_without_scrub_the_reader_reads_the_users_kv(tmp_path: Path, model: str) -> None:
    """The control for the scrub test: the same blocks, scrub off, hold the users' KV."""
    p = start(tmp_path, model, "v1")
    serve_users(p)
    lost = read_with_lost_blocks(p)
    assert all(nonzero_bytes(p, block) > canary.STAMP_BYTES for block in lost)


@pytest.mark.parametrize("scrub", ["on_free", "on_reserve"])
def test_clean_traffic_with_scrub_gives_zero_findings(
    tmp_path: Path, model: str, runner: str, scrub: str
) -> None:
    p = start(tmp_path, model, runner, scrub)
    serve_users(p, users=6)  # the small pool wraps: blocks are freed, evicted and reused
    p.serve("shared-1", list(range(60, 75)), max_tokens=3)
    p.run()
    p.serve("shared-2", list(range(60, 75)), max_tokens=3)  # a decode prefix-cache hit
    p.run()
    assert read_spool(tmp_path / "spool").events() == []
    assert p.decode.kvwatch.verdicts == [] and p.prefill.kvwatch.verdicts == []
    assert p.decode.stat("verifications", "canary") >= 8
    assert p.decode.stat("hook_errors", "verify") == 0


def test_scrub_reaches_the_worker_and_a_bad_value_is_one_error_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def worker(scrub: str) -> Any:
        config = vllm_config([kvwatch_child("kv_consumer", str(tmp_path), "log", scrub)], "x")
        connector = KVConnectorFactory.create_connector(
            config, KVConnectorRole.WORKER, kv_cache_config()
        )
        assert isinstance(connector, KVWatchConnector)
        return connector

    assert worker("on_reserve").scrub is Scrub.ON_RESERVE
    with caplog.at_level(logging.ERROR, logger="kvwatch.vllm"):
        assert worker("always").scrub is Scrub.OFF
    (line,) = [m for m in caplog.messages if "kvwatch" in m]  # vLLM logs its own lines too
    assert "scrub" in line and "\n" not in line


def test_bad_options_are_one_error_line_each_and_ride_on_the_hello(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A misspelt mode runs as log, a unit on a number runs as its default, an unknown key is
    named: one error line each, and the hello of the connector vLLM's factory makes carries the
    mode, scrub and the invalid options (the daemon shows the engine misconfigured)."""
    spool = tmp_path / "spool"
    spool.mkdir()
    child = kvwatch_child("kv_producer", str(spool), "enforse", "on_free")
    child["kv_connector_extra_config"].update({"resolve_interval_s": "1s", "mdoe": "enforce"})
    with caplog.at_level(logging.ERROR, logger="kvwatch.vllm"):
        connector = KVConnectorFactory.create_connector(
            vllm_config([child], "x"), KVConnectorRole.SCHEDULER, kv_cache_config()
        )
    assert isinstance(connector, KVWatchConnector) and connector.watch is not None
    lines = [m for m in caplog.messages if "kvwatch" in m]  # vLLM logs its own lines too
    assert len(lines) == 3 and all("\n" not in line for line in lines), lines
    assert "kv_connector_extra_config.'mdoe' is not a kvwatch setting" in lines[0]
    assert (
        "kv_connector_extra_config.mode='enforse' is not valid (valid: off|log|enforce); "
        "running as log" in lines[1]
    )
    assert "kv_connector_extra_config.resolve_interval_s='1s' is not valid" in lines[2]
    connector.watch.flush()
    hellos = [r for r in read_spool(spool).records if r["type"] == "hello"]
    assert hellos
    for hello in hellos:
        assert (hello["mode"], hello["scrub"]) == ("log", "on_free"), hello
        assert list(hello["config_errors"]) == ["option", "mode", "resolve_interval_s"], hello
    per_detector = kvwatch_child("kv_consumer", str(spool), "log", "off")
    per_detector["kv_connector_extra_config"]["mode"] = {"default": "log", "checksum": "enforce"}
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="kvwatch.vllm"):
        clean = KVConnectorFactory.create_connector(
            vllm_config([per_detector], "x"), KVConnectorRole.WORKER, kv_cache_config()
        )
    assert isinstance(clean, KVWatchConnector) and clean.config_errors == ()
    assert [m for m in caplog.messages if "kvwatch" in m] == []
