"""A lease that expires before decode reads: caught on both sides, the takers named.

Through vLLM's real scheduler and block pool on both engines. The transport is
:class:`transport.AsyncTransport` with NIXL's expiry path (it logs NIXL's warning on NIXL's
logger and reports the request in ``finished_sending``, so vLLM frees its blocks); the proxy
holds the decode half until other requests have taken the blocks. Ground truth: which requests
vLLM's own block tables gave the victim's blocks to (``KVCacheManager.get_block_ids``).
"""

from __future__ import annotations

import inspect
import logging
import time
from pathlib import Path
from typing import Any

from harness import Node, Pair, proxy
from transport import LINKS, new_link
from vllm.v1.engine import FinishReason

from engine_hooks.testing import read_spool
from engine_hooks.vllm.lease import EXPIRY_MESSAGE

BLOCK = 4
VICTIM = "victim"
VICTIM_PROMPT = list(range(200, 212))  # three full blocks
WINDOW_S = 1.0  # outlasts other_traffic on a loaded machine: every taker is in the window


def start(tmp_path: Path, model: str, mode: str, prefill_blocks: int = 8) -> Pair:
    link = new_link()
    common: dict[str, Any] = {"model": model, "transport": "async", "link": link, "mode": mode}
    prefill = Node(
        "kv_producer",
        spool=str(tmp_path / "prefill"),
        name="prefill",
        num_blocks=prefill_blocks,
        kvwatch_extra={"freed_watch_s": WINDOW_S, "node": "p-node"},
        **common,
    )
    decode = Node(
        "kv_consumer", spool=str(tmp_path / "decode"), name="decode", recompute_differs=True,
        **common,
    )  # fmt: skip
    return Pair(prefill, decode)


def prefill_only(p: Pair, rid: str, prompt: list[int]) -> dict[str, Any]:
    """Prefill a request (the proxy's first half); its kv_transfer_params."""
    p.prompts[rid] = prompt
    p.send(rid, prompt)
    for _ in range(50):
        p.prefill.step()
        if rid in p.prefill.finished:
            return dict(p.prefill.finished[rid].kv_transfer_params or {})
    raise AssertionError(f"{rid} did not finish on prefill")


def other_traffic(p: Pair, users: int) -> dict[int, list[str]]:
    """Other users' requests on prefill, one after another, served there (a small pool: they
    take the blocks vLLM freed); per block, who vLLM's block tables gave it to, in order."""
    holders: dict[int, list[str]] = {}
    for i in range(users):
        rid = f"other-{i}"
        p.prefill.add(rid, [1000 + 16 * i + t for t in range(10)], 3, {})
        for _ in range(50):
            p.prefill.step()
            for request in p.prefill.scheduler.running:
                for block in p.prefill.blocks(request.request_id):
                    seen = holders.setdefault(block, [])
                    if not seen or seen[-1] != request.request_id:
                        seen.append(request.request_id)
            if rid in p.prefill.finished:
                break
    return holders


def expire(p: Pair, rid: str) -> None:
    """NIXL's lease on ``rid`` runs out unread: logged, reported in finished_sending."""
    LINKS[p.prefill.link].expire.add(rid)
    for _ in range(3):
        p.prefill.step()


def decode_half(p: Pair, rid: str, params: dict[str, Any]) -> None:
    """The proxy lets the held decode half go: decode reads what the blocks hold now."""
    p.decode.add(rid, p.prompts[rid], 3, proxy(params))
    for _ in range(50):
        p.decode.step()
        if rid in p.decode.finished:
            return
    raise AssertionError(f"{rid} did not finish on decode")


def close_window(p: Pair) -> None:
    time.sleep(WINDOW_S + 0.05)
    p.prefill.step()  # the window is closed at a step


def events(tmp_path: Path, side: str) -> list[dict[str, Any]]:
    return read_spool(tmp_path / side).events()


def sources(event: dict[str, Any]) -> dict[str, int]:
    return {s["request_id"]: s["pages"] for s in event.get("sources", [])}


def lease_case(
    tmp_path: Path, model: str, mode: str, users: int = 4
) -> tuple[Pair, dict[str, int], list[int], dict[int, list[str]]]:
    p = start(tmp_path, model, mode)
    params = prefill_only(p, VICTIM, VICTIM_PROMPT)
    (blocks,) = params["remote_block_ids"]
    expire(p, VICTIM)
    holders = other_traffic(p, users)
    # Ground truth: every request vLLM gave one of the victim's blocks to before the read (a
    # block taken, freed and taken again held both requests' KV in turn), and how many.
    took: dict[str, int] = {}
    for block in blocks:
        assert block in holders, "the test is about something: every block was taken"
        for holder in holders[block]:
            took[holder] = took.get(holder, 0) + 1
    close_window(p)
    decode_half(p, VICTIM, params)
    return p, took, list(blocks), holders


def test_an_expired_lease_is_caught_on_both_sides_and_names_the_takers(
    tmp_path: Path, model: str
) -> None:
    p, took, blocks, _holders = lease_case(tmp_path, model, "log")
    assert p.decode.finished[VICTIM].finish_reason == FinishReason.LENGTH  # log: served
    (freed,) = events(tmp_path, "prefill")
    assert (freed["detector"], freed["kind"], freed["action"]) == (
        "page_tag", "freed_before_read", "logged",
    )  # fmt: skip
    assert freed["request_id"] == VICTIM and sorted(freed["pages"]) == sorted(blocks)
    assert sources(freed) == took  # exactly vLLM's takers, block counts included
    assert all(s["written_at"] > 0 for s in freed["sources"])
    assert freed["detail"]["remote_reads"] == 0
    read = [e for e in events(tmp_path, "decode") if e["kind"] == "digest"]
    assert len(read) == 1 and read[0]["request_id"] == VICTIM
    detail = read[0]["detail"]
    # The decode finding names its peer: prefill's request instance, node, engine, transport.
    assert detail["peer_request_id"] == VICTIM
    assert detail["peer_instance"] == freed["instance"]
    assert detail["peer_node"] == "p-node"
    assert detail["peer_engine_id"] == p.prefill.config.kv_transfer_config.engine_id
    assert detail["transport"] == "nixl"


def test_every_request_that_took_a_block_before_the_read_is_named(
    tmp_path: Path, model: str
) -> None:
    """A block taken by one request, freed and taken by the next before decode read it: both
    held it, decode may have read either's KV, so both are sources (the holder slots name a
    page's last holder only)."""
    _p, took, blocks, holders = lease_case(tmp_path, model, "log", users=6)
    twice = [b for b in blocks if len(holders[b]) > 1]
    assert twice, f"the test is about something: a block taken twice ({holders})"
    (freed,) = events(tmp_path, "prefill")
    assert sources(freed) == took
    for block in twice:
        for holder in holders[block]:
            assert holder in sources(freed), (block, holder)


def test_enforce_fails_the_request_that_reads_freed_blocks(tmp_path: Path, model: str) -> None:
    p, _took, _blocks, _holders = lease_case(tmp_path, model, "enforce")
    assert p.decode.finished[VICTIM].finish_reason == FinishReason.ERROR
    (freed,) = events(tmp_path, "prefill")
    assert freed["action"] == "logged"  # the writer's request is gone: decode's check fails it


def test_a_slow_read_inside_the_lease_is_no_finding(tmp_path: Path, model: str) -> None:
    p = start(tmp_path, model, "enforce", prefill_blocks=16)
    LINKS[p.decode.link].delay = 20  # a slow transfer: decode reads long after the prefill
    params = prefill_only(p, VICTIM, VICTIM_PROMPT)
    other_traffic(p, 3)
    close_window(p)
    decode_half(p, VICTIM, params)
    other_traffic(p, 2)
    close_window(p)
    assert p.decode.finished[VICTIM].finish_reason == FinishReason.LENGTH
    assert events(tmp_path, "prefill") == [] and events(tmp_path, "decode") == []


def test_nixl_still_logs_the_expiry_that_kvwatch_reads() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    assert EXPIRY_MESSAGE in inspect.getsource(base_worker)


def test_an_expiry_kvwatch_cannot_read_is_counted_never_raised(tmp_path: Path, model: str) -> None:
    """NIXL's warning with a reads count kvwatch cannot read: vLLM's logging goes on, the
    failure is a hook error (``hook_errors{hook="free"}``), and the next expiry is read."""
    p = start(tmp_path, model, "log")
    nixl = logging.getLogger("vllm.distributed.kv_transfer.kv_connector.v1.nixl")
    before = p.prefill.stat("hook_errors", "free")
    nixl.warning(EXPIRY_MESSAGE + " by %s decode workers", VICTIM, "several")  # no exception
    assert p.prefill.stat("hook_errors", "free") == before + 1
    params = prefill_only(p, VICTIM, VICTIM_PROMPT)
    expire(p, VICTIM)
    other_traffic(p, 4)
    close_window(p)
    decode_half(p, VICTIM, params)
    (freed,) = events(tmp_path, "prefill")
    assert (freed["kind"], freed["request_id"]) == ("freed_before_read", VICTIM), freed
