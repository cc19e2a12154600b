"""Prefill -> decode through vLLM's own scheduler and model-runner connector code.

Every test here runs both of vLLM's runner paths (the V1 runner's
``KVConnectorModelRunnerMixin`` and the V2 runner's ``ActiveKVConnector``) beside an asynchronous
transport (NIXL's contract: ``start_load_kv`` after the forward, the load reported later in
``finished_recving``) and beside vLLM's synchronous ``ExampleConnector`` (shared storage, loaded
before the forward, never reported as received). Decode's forward recomputes the last prompt
token with a last-bit difference, as a GPU may.
"""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from harness import RUNNERS, TRANSPORTS, Pair, pair
from transport import LINKS
from vllm.v1.engine import FinishReason

from engine_hooks.heads import pack, unpack
from engine_hooks.testing import read_spool

PROMPTS = {
    "aligned": list(range(1, 13)),  # a multiple of the block size
    "ragged": list(range(20, 31)),  # ends inside a block
    "short": [5, 6, 7],  # less than one block
}


def _kinds(p: Pair) -> set[tuple[str, str]]:
    return {(v.detector, v.kind or "") for n in (p.prefill, p.decode) for v in n.kvwatch.verdicts}


@pytest.fixture(params=[(r, t) for r in RUNNERS for t in TRANSPORTS], ids="-".join)
def bed(request: pytest.FixtureRequest, tmp_path: Path, model: str) -> dict[str, Any]:
    runner, transport = request.param
    return {"tmp_path": tmp_path, "model": model, "runner": runner, "transport": transport}


@pytest.fixture(params=RUNNERS)
def async_bed(request: pytest.FixtureRequest, tmp_path: Path, model: str) -> dict[str, Any]:
    """Faults only an asynchronous load can have: a load that lands and is read in later steps
    (a synchronous one is loaded and checked in one step, always whole, and ExampleConnector
    loads fewer blocks than prefill sealed, so a shorter seal still covers them)."""
    return {"tmp_path": tmp_path, "model": model, "runner": request.param, "transport": "async"}


@pytest.mark.parametrize("mode", ["log", "enforce"])
def test_clean_requests_are_served_with_zero_findings(bed: dict[str, Any], mode: str) -> None:
    p = pair(mode=mode, **bed)
    for rid, prompt in PROMPTS.items():
        p.serve(rid, prompt, max_tokens=3)
    p.run()
    for rid in PROMPTS:
        out = p.decode.finished[rid]
        assert out.finish_reason == FinishReason.LENGTH, rid
    assert _kinds(p) == set()
    stats = p.decode.stat
    # A synchronous loader loads whole blocks short of the last prompt token: "short" has none.
    loads = 3 if bed["transport"] == "async" else 2
    assert stats("verifications", "checksum") == loads
    assert stats("verifications", "page_tag") == loads
    assert stats("verifications_skipped", "checksum", "other") == 0
    assert stats("hook_errors", "verify") == 0


def test_decode_prefix_hit_checks_the_loaded_blocks(bed: dict[str, Any]) -> None:
    """The second request shares two blocks with the first one decode served: those are decode's
    own prefix hits, and only the blocks the transport delivers are checked against the seal."""
    p = pair(**bed)
    p.serve("first", list(range(1, 15)))
    p.run()
    p.serve("second", [*list(range(1, 9)), 99, 98, 97, 96, 95, 94])
    p.run()
    assert p.decode.finished["second"].finish_reason == FinishReason.LENGTH
    assert _kinds(p) == set()
    assert p.decode.stat("verifications", "checksum") == 2


def _corrupt(p: Pair, rid: str, transport: str) -> None:
    """One flipped bit in the KV that reaches decode, after prefill sealed it."""
    if transport == "async":

        def flip(_rid: str, kv: dict[str, torch.Tensor], blocks: list[int]) -> None:
            next(iter(kv.values()))[blocks[0]].view(torch.uint8).view(-1)[5] ^= 0x01

        LINKS[p.decode.link].on_arrival[rid] = flip
        return
    # The shared storage's newest entry: this prompt, just stored by prefill.
    stored = max(Path(p.decode.link).iterdir(), key=lambda entry: entry.stat().st_mtime_ns)
    layer = sorted(stored.iterdir())[0]
    tensors = safetensors.torch.load_file(layer)
    tensors["kv_cache"].view(torch.uint8).view(-1)[5] ^= 0x01
    safetensors.torch.save_file(tensors, layer)


def _serve_prefill_only(p: Pair, rid: str, prompt: list[int]) -> None:
    p.prompts[rid] = prompt
    p.send(rid, prompt)
    while rid not in p.prefill.finished:
        p.prefill.step()


@pytest.mark.parametrize("mode", ["log", "enforce"])
def test_corrupted_transfer(bed: dict[str, Any], mode: str) -> None:
    p = pair(mode=mode, **bed)
    rid, prompt = "bad", PROMPTS["aligned"]
    _serve_prefill_only(p, rid, prompt)
    _corrupt(p, rid, bed["transport"])
    p.decode.add(rid, prompt, 3, dict(p.prefill.finished[rid].kv_transfer_params or {}))
    p.run()
    out = p.decode.finished[rid]
    assert ("checksum", "digest") in _kinds(p)
    (verdict,) = [v for v in p.decode.kvwatch.verdicts if v.detector == "checksum"]
    assert len(verdict.pages) == 1  # exactly the damaged block
    events = read_spool(bed["tmp_path"] / "spool").events(request_id=rid)
    if mode == "enforce":
        # vLLM's kv_load_failure_policy "fail": an error, and no token from the bad KV.
        assert out.finish_reason == FinishReason.ERROR
        assert out.new_token_ids == []
        assert {e["action"] for e in events} == {"enforced"}
    else:
        assert out.finish_reason == FinishReason.LENGTH
        assert {e["action"] for e in events} == {"logged"}


def test_missing_block_is_caught(async_bed: dict[str, Any]) -> None:
    p = pair(**async_bed)
    rid, prompt = "miss", PROMPTS["aligned"]
    _serve_prefill_only(p, rid, prompt)

    def lose(_rid: str, kv: dict[str, torch.Tensor], blocks: list[int]) -> None:
        for view in kv.values():  # the block never arrives: restore decode's reserved stamp
            view[blocks[1]].copy_(saved[view.data_ptr()])

    saved: dict[int, torch.Tensor] = {}

    def snapshot(_rid: str, kv: dict[str, torch.Tensor], blocks: list[int]) -> None:
        saved.update({v.data_ptr(): v[blocks[1]].clone() for v in kv.values()})

    LINKS[p.decode.link].on_arrival[rid] = lose
    p.decode.add(rid, prompt, 3, dict(p.prefill.finished[rid].kv_transfer_params or {}))
    p.decode.step()  # reserves and stamps: keep the stamp of the block that will not arrive
    snapshot(rid, p.decode.kv, p.decode.blocks(rid))
    p.run()
    assert {("canary", "unwritten_page"), ("checksum", "digest")} <= _kinds(p)
    assert p.decode.finished[rid].finish_reason == FinishReason.ERROR


def test_kvwatch_listed_after_the_transport(bed: dict[str, Any]) -> None:
    """Its place among MultiConnector's children does not matter: its pre-forward work runs in
    bind_connector_metadata, which vLLM calls on every child before any start_load_kv."""
    p = pair(kvwatch_first=False, **bed)  # on decode, the engine that checks loads
    p.serve("clean", PROMPTS["ragged"])
    p.run()
    _serve_prefill_only(p, "bad", PROMPTS["aligned"])
    _corrupt(p, "bad", bed["transport"])
    p.decode.add("bad", PROMPTS["aligned"], 3, dict(p.prefill.finished["bad"].kv_transfer_params))
    p.run()
    assert p.decode.finished["clean"].finish_reason == FinishReason.LENGTH
    assert p.decode.finished["bad"].finish_reason == FinishReason.ERROR
    assert _kinds(p) == {("checksum", "digest")}


def test_recompute_policy_serves_from_local_compute(bed: dict[str, Any]) -> None:
    """kv_load_failure_policy="recompute": vLLM drops the bad blocks and computes them itself."""
    p = pair(policy="recompute", **bed)
    _serve_prefill_only(p, "bad", PROMPTS["aligned"])
    _corrupt(p, "bad", bed["transport"])
    p.decode.add("bad", PROMPTS["aligned"], 3, dict(p.prefill.finished["bad"].kv_transfer_params))
    p.run()
    assert p.decode.finished["bad"].finish_reason == FinishReason.LENGTH
    assert _kinds(p) == {("checksum", "digest")}


def _last_blocks(p: Pair, rid: str) -> list[int]:
    """Run until ``rid`` finishes on decode; its blocks as of its last step."""
    blocks: list[int] = []
    for _ in range(50):
        p.step()
        if rid in p.decode.finished:
            return blocks
        if rid in p.decode.scheduler.requests:
            blocks = p.decode.blocks(rid)
    raise AssertionError(f"{rid} never finished on decode")


@pytest.mark.parametrize("mode", ["log", "enforce"])
def test_late_write_into_a_freed_block(bed: dict[str, Any], mode: str) -> None:
    """A write that lands after decode freed the block (an aborted transfer's late RDMA write)
    is caught when vLLM's block pool hands the block out again. Nothing can be failed (the
    next owner rewrites the block before reading it), so the event says "logged"."""
    p = pair(mode=mode, num_blocks=16, **bed)
    p.serve("gone", PROMPTS["aligned"], max_tokens=3)
    blocks = _last_blocks(p, "gone")
    p.run()
    p.decode.step()  # the next step's bind stamps the freed (unhashed) blocks
    free = p.decode.scheduler.kv_cache_manager.block_pool
    victim = next(b for b in blocks if free.blocks[b].block_hash is None)
    for view in p.decode.kv.values():
        view[victim].fill_(3.0)  # the late write
    for i in range(12):  # one at a time: no preemption (ExampleConnector cannot resume on 0.32)
        p.serve(f"next-{i}", [40 + i, *PROMPTS["ragged"]], max_tokens=2)
        p.run()
    assert _kinds(p) == {("canary", "write_to_free_page")}
    events = read_spool(bed["tmp_path"] / "spool").events()
    assert {e["action"] for e in events} == {"logged"}
    assert all(out.finish_reason == FinishReason.LENGTH for out in p.decode.finished.values())


def test_block_reallocated_before_the_read(async_bed: dict[str, Any]) -> None:
    """A stale block reference: the pool takes a reserved block back and gives it out again
    before the load is read (tag check)."""
    p = pair(**async_bed)
    _serve_prefill_only(p, "stale", PROMPTS["aligned"])
    p.decode.add(
        "stale", PROMPTS["aligned"], 3, dict(p.prefill.finished["stale"].kv_transfer_params)
    )
    p.decode.step()  # reserved; waiting for the remote KV
    pool = p.decode.scheduler.kv_cache_manager.block_pool
    victim = pool.blocks[p.decode.blocks("stale")[0]]
    pool.free_blocks([victim])
    taken = pool.get_new_blocks(pool.get_num_free_blocks())
    pool.free_blocks([b for b in taken if b is not victim])
    p.run()
    assert ("page_tag", "stale_tag") in _kinds(p)
    assert p.decode.finished["stale"].finish_reason == FinishReason.ERROR


def test_a_shorter_seal_is_a_page_count_finding(async_bed: dict[str, Any]) -> None:
    p = pair(**async_bed)
    _serve_prefill_only(p, "short", PROMPTS["aligned"])
    params = dict(p.prefill.finished["short"].kv_transfer_params)
    seal = params["kvwatch"]["seals"]["0"]
    rows = unpack(seal["heads"], seal["page_count"], seal["layout"]["head_count"])
    assert rows is not None
    seal["heads"] = pack(rows[:-1])  # the writer's per-(block, head) seal, one block short
    seal["page_count"] -= 1
    p.decode.add("short", PROMPTS["aligned"], 3, params)
    p.run()
    assert _kinds(p) == {("checksum", "page_count")}


def test_records_land_in_the_spool(bed: dict[str, Any]) -> None:
    p = pair(**bed)
    p.serve("clean", PROMPTS["ragged"])
    p.run()
    _serve_prefill_only(p, "bad", PROMPTS["aligned"])
    _corrupt(p, "bad", bed["transport"])
    p.decode.add("bad", PROMPTS["aligned"], 3, dict(p.prefill.finished["bad"].kv_transfer_params))
    p.run()
    for node in (p.prefill, p.decode):
        node.worker.shutdown()
        node.scheduler.connector.shutdown()
    # Shut down, the engine holds no segment open: the daemon can finish and retire them.
    segments = sorted((bed["tmp_path"] / "spool").glob("*.kvs"))
    assert segments
    for segment in segments:
        with segment.open("rb") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while a writer holds it
    contents = read_spool(bed["tmp_path"] / "spool")
    assert not sum(contents.errors.values())
    assert {(e["request_id"], e["detector"]) for e in contents.events()} == {("bad", "checksum")}
    hellos = [r for r in contents.records if r["type"] == "hello"]
    assert {(h["engine"], h["role"]) for h in hellos} >= {("vllm", "prefill"), ("vllm", "decode")}
    counters = contents.latest_counters()
    assert counters["verifications"]
    gauges = {g[0] for r in contents.records if r["type"] == "gauges" for g in r["gauges"]}
    assert gauges == {"kv_pool_tokens", "context_length_tokens", "page_size_tokens"}


def test_abort_after_the_load_finished(async_bed: dict[str, Any]) -> None:
    """Aborted between the load's completion and its check: vLLM frees the blocks at once and
    may hand them to another request in the same schedule; kvwatch must not check them."""
    p = pair(num_blocks=8, **async_bed)
    _serve_prefill_only(p, "gone", PROMPTS["aligned"])
    p.decode.add("gone", PROMPTS["aligned"], 3, dict(p.prefill.finished["gone"].kv_transfer_params))
    while "gone" not in p.decode.scheduler.finished_recving_kv_req_ids:
        p.decode.step()
        p.prefill.step()
    p.decode.abort("gone")
    p.serve("next", list(range(50, 66)), max_tokens=2)  # takes the freed blocks
    p.run()
    assert p.decode.finished["next"].finish_reason == FinishReason.LENGTH
    assert _kinds(p) == set()
