"""Tensor parallelism: every rank verifies, across TP widths, with one verdict per request.

Each engine runs ``tp`` workers, each with its own connector (vLLM's ``MultiConnector`` over the
kvwatch connector and the transport) and its own share of the KV heads; every worker runs the
same ``SchedulerOutput`` through vLLM's runner code, and vLLM's ``KVOutputAggregator`` merges
their outputs for the scheduler, as its multiprocess executor does. The transport reads each
decode rank's heads from whichever prefill rank holds them, as NIXL's head-slice reads do when
the widths differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import Node, Pair
from transport import LINKS, new_link
from vllm.v1.engine import FinishReason

from engine_hooks.testing import read_spool
from engine_hooks.vllm.layout import dtype_name

#: (prefill TP, decode TP): the same width, and both heterogeneous pairs. The tiny model has
#: two KV heads, so TP 2 holds one head per rank.
WIDTHS = [(1, 2), (2, 1), (2, 2)]
PROMPTS = {"aligned": list(range(1, 13)), "ragged": list(range(20, 31)), "short": [5, 6, 7]}


def tp_pair(
    tmp_path: Path, model: str, widths: tuple[int, int], mode: str = "enforce", **decode: Any
) -> Pair:
    link = new_link()
    common = {"spool": str(tmp_path / "spool"), "model": model, "link": link, "mode": mode}
    prefill = Node("kv_producer", name="prefill", tp=widths[0], **common)
    decode_kw = {"recompute_differs": True, "tp": widths[1], **decode}
    return Pair(prefill, Node("kv_consumer", name="decode", **common | decode_kw))


def verdicts(node: Node) -> list[Any]:
    return [v for r in range(node.tp) for v in node.rank_side(r).verdicts]


def prefill_only(p: Pair, rid: str, prompt: list[int]) -> dict[str, Any]:
    p.prompts[rid] = prompt
    p.send(rid, prompt)
    while rid not in p.prefill.finished:
        p.prefill.step()
    return dict(p.prefill.finished[rid].kv_transfer_params or {})


@pytest.mark.parametrize("widths", WIDTHS, ids=lambda w: f"tp{w[0]}-tp{w[1]}")
@pytest.mark.parametrize("mode", ["log", "enforce"])
def test_clean_traffic_is_verified_on_every_decode_rank(
    tmp_path: Path, model: str, widths: tuple[int, int], mode: str
) -> None:
    p = tp_pair(tmp_path, model, widths, mode)
    for rid, prompt in PROMPTS.items():
        p.serve(rid, prompt, max_tokens=3)
    p.run()
    for rid in PROMPTS:
        assert p.decode.finished[rid].finish_reason == FinishReason.LENGTH, rid
    assert verdicts(p.prefill) == verdicts(p.decode) == []
    # Every transfer checked on every decode rank, none skipped for the widths.
    for rank in range(widths[1]):
        watch = p.decode.ranks[rank].child().watch
        assert watch.counter("verifications", "checksum") == len(PROMPTS), rank
    for reason in ("other", "no_seal", "unsupported_layout"):
        assert p.decode.stat("verifications_skipped", "checksum", reason) == 0, reason
    # The wire: one seal per prefill rank, per block and KV head, with its layout signature.
    wire = p.prefill.finished["aligned"].kv_transfer_params["kvwatch"]
    assert sorted(wire["seals"]) == [str(r) for r in range(widths[0])]
    for rank, seal in wire["seals"].items():
        layout = seal["layout"]
        assert (layout["kv_heads"], layout["head_count"]) == (2, 2 // widths[0])
        assert layout["head_start"] == int(rank) * layout["head_count"]
        # 4 bytes per block and head this rank holds, base64.
        assert len(seal["heads"]) == 4 * -(-(3 * 4 * layout["head_count"]) // 3)


def _flip_rank(p: Pair, rid: str, rank: int) -> None:
    """One bit of decode rank ``rank``'s shard flipped after the seal: that rank's heads only."""

    def flip(_rid: str, kv: dict[str, torch.Tensor], blocks: list[int]) -> None:
        next(iter(kv.values()))[blocks[0]].view(torch.uint8).view(-1)[3] ^= 0x04

    LINKS[p.decode.link].on_arrival[f"{rid}@{rank}"] = flip


@pytest.mark.parametrize("widths", [(2, 2), (1, 2)], ids=lambda w: f"tp{w[0]}-tp{w[1]}")
def test_a_corrupted_shard_fails_the_request_on_every_rank_and_the_next_is_served(
    tmp_path: Path, model: str, widths: tuple[int, int]
) -> None:
    p = tp_pair(tmp_path, model, widths, "enforce")
    params = prefill_only(p, "bad", PROMPTS["aligned"])
    _flip_rank(p, "bad", 1)
    p.decode.add("bad", PROMPTS["aligned"], 3, params)
    p.run()
    # Caught on the rank whose shard was damaged, not on the other.
    assert [(v.detector, v.kind) for v in p.decode.rank_side(1).verdicts] == [
        ("checksum", "digest")
    ]
    assert p.decode.rank_side(0).verdicts == []
    # One verdict: vLLM's aggregator unions the ranks' load errors, the scheduler fails the
    # request once for every rank, and the group goes on serving.
    assert p.decode.finished["bad"].finish_reason == FinishReason.ERROR
    p.serve("next", PROMPTS["ragged"], max_tokens=3)
    p.run()
    assert p.decode.finished["next"].finish_reason == FinishReason.LENGTH
    assert len(verdicts(p.decode)) == 1


def test_findings_of_every_rank_name_one_instance(tmp_path: Path, model: str) -> None:
    """A seal one block short fails on both decode ranks: two findings, one request instance
    (the scheduler mints it for every rank), so the daemon makes one incident of them."""
    p = tp_pair(tmp_path, model, (2, 2), "log")
    params = prefill_only(p, "short", PROMPTS["aligned"])
    for seal in params["kvwatch"]["seals"].values():
        seal["page_count"] -= 1
        seal["heads"] = _drop_last_block(seal)
    p.decode.add("short", PROMPTS["aligned"], 3, params)
    p.run()
    found = verdicts(p.decode)
    assert sorted((v.detector, v.kind) for v in found) == [("checksum", "page_count")] * 2
    events = [e for e in read_spool(tmp_path / "spool").events() if e["request_id"] == "short"]
    assert len(events) == 2
    assert len({e["instance"] for e in events}) == 1


def _drop_last_block(seal: dict[str, Any]) -> str:
    from engine_hooks.heads import pack, unpack

    rows = unpack(seal["heads"], seal["page_count"] + 1, seal["layout"]["head_count"])
    assert rows is not None
    return pack(rows[:-1])


@pytest.mark.parametrize("widths", WIDTHS, ids=lambda w: f"tp{w[0]}-tp{w[1]}")
def test_a_dtype_mismatch_is_caught_before_the_read(
    tmp_path: Path, model: str, widths: tuple[int, int]
) -> None:
    """Prefill's KV is float16, decode's bfloat16: the same bytes per element, so the transfer
    arrives intact and its digests match; read as the other type it is wrong. The layout
    signature catches it on every decode rank, and enforce fails the request."""
    p = tp_pair(tmp_path, model, widths, "enforce", dtype=torch.bfloat16)
    p.prefill = Node(
        "kv_producer",
        name="prefill",
        tp=widths[0],
        dtype=torch.float16,
        spool=str(tmp_path / "spool"),
        model=model,
        link=p.decode.link,
    )
    p.serve("misread", PROMPTS["aligned"], max_tokens=3)
    p.run()
    found = [(v.detector, v.kind, v.detail.get("field")) for v in verdicts(p.decode)]
    assert found == [("checksum", "layout_mismatch", "dtype")] * widths[1]
    detail = verdicts(p.decode)[0].detail
    assert (detail["sealed"], detail["read"]) == ("float16", "bfloat16")
    assert p.decode.finished["misread"].finish_reason == FinishReason.ERROR


def test_element_types_are_compared_by_meaning() -> None:
    """vLLM's ``fp8`` is its ``fp8_e4m3``: a pair started with the two names reads the same
    bytes the same way, so no ``layout_mismatch``; E5M2 is another type; ``auto`` is the pool's."""
    assert dtype_name("fp8", torch.uint8) == dtype_name("fp8_e4m3", torch.uint8) == "fp8_e4m3"
    assert dtype_name("fp8_e5m2", torch.uint8) != dtype_name("fp8", torch.uint8)
    assert dtype_name("auto", torch.bfloat16) == "bfloat16"
