"""Prefill -> decode through vLLM's own scheduler and model-runner connector code.

Every test here runs both of vLLM's runner paths (the V1 runner's
``KVConnectorModelRunnerMixin`` and the V2 runner's ``ActiveKVConnector``) beside an asynchronous
transport (NIXL's contract: ``start_load_kv`` after the forward, the load reported later in
``finished_recving``) and beside vLLM's synchronous ``ExampleConnector`` (shared storage, loaded
before the forward, never reported as received). Decode's forward recomputes the last prompt
token with a last-bit difference, as a GPU may.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from harness import RUNNERS, TRANSPORTS, Pair, pair
from transport import LINKS
from vllm.v1.engine import FinishReason

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
    (stored,) = Path(p.decode.link).iterdir()  # the shared storage's one entry: this prompt
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


def test_missing_block_is_caught(bed: dict[str, Any]) -> None:
    if bed["transport"] != "async":
        pytest.skip("ExampleConnector writes every block it loads")
    p = pair(**bed)
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
