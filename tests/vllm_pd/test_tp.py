"""kvwatch at tensor parallelism in real vLLM PD servers: every decode rank verifies every
transfer, across TP widths, and one verdict per request.

Two beds, each prefill + decode (log) + decode (enforce), kvwatch on every rank:

- **NIXL, prefill TP 1 -> decode TP 2** (the heterogeneous pair: each decode rank reads its two
  of the four KV heads from prefill's one rank, NIXL's head-slice reads);
- **shared storage, TP 2 -> TP 2** (``ranked_storage.py``: vLLM 0.32's ``ExampleConnector``
  writes every rank's shard to one file, the last writer wins; see
  ``test_vllm_shared_storage_mixes_the_ranks_shards``).

NIXL at TP 2 on the prefill side stalls on these 2-core machines with kvwatch and without it
(``engine_hooks/vllm/README.md``, "Tensor parallelism"): ``KVWATCH_PD_NIXL_PREFILL_TP=2`` runs
the NIXL bed at 2 -> 2 where it does not.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_pd.bed import ROOT, Bed, Server, serving, tp_bed, transfer_config
from tests.vllm_pd.test_pd import CLEAN, SPOOL_WAIT_S, describe, findings, prompt

MODEL = ROOT / "build" / "vllm-pd-model"
DECODE_TP = 2
NIXL_PREFILL_TP = int(os.environ.get("KVWATCH_PD_NIXL_PREFILL_TP", "1"))
#: KV heads per decode rank (make_model.py's four, at TP 2): head 2 is rank 1's first.
RANK1_HEAD = 2
PAIRS = {"nixl": NIXL_PREFILL_TP, "ranked": 2}


@pytest.fixture(scope="module", params=sorted(PAIRS))
def bed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    assert (MODEL / "model.safetensors").is_file(), "run tests/vllm_pd/setup_env.sh first"
    transport = str(request.param)
    workdir = tmp_path_factory.mktemp(f"tp-{transport}")
    with tp_bed(transport, MODEL, workdir, PAIRS[transport], DECODE_TP) as running:
        yield running


def rank_counter(bed: Bed, server: str, rank: int, name: str, **labels: str) -> float:
    series = bed.spool(server).latest_counters(rank).get(name, {})
    return sum(v for k, v in series.items() if all(dict(k).get(a) == b for a, b in labels.items()))


def wait_rank_verified(bed: Bed, server: str, at_least: float) -> list[float]:
    """Each decode rank's checksum verifications, once every rank's reach ``at_least``."""
    deadline = time.monotonic() + SPOOL_WAIT_S
    while True:
        seen = [
            rank_counter(bed, server, r, "verifications", detector="checksum")
            for r in range(DECODE_TP)
        ]
        if min(seen) >= at_least or time.monotonic() > deadline:
            return seen
        time.sleep(0.5)


def test_clean_traffic_is_verified_on_every_decode_rank(bed: Bed) -> None:
    texts = CLEAN[1:4]  # each over a block: every one is sealed
    for text in texts:
        single = bed.single(text, 8)
        assert single.status == 200, single.body
        for mode in ("log", "enforce"):
            served = bed.pd(mode, text, 8)
            assert served.status == 200, f"{bed.transport}/{mode}: {served.body}"
            assert served.token_ids == single.token_ids, f"{bed.transport}/{mode}"
    for mode in ("log", "enforce"):
        server = f"decode-{mode}"
        # bed.connect()'s request and the three: on each rank, none skipped for the widths.
        assert min(wait_rank_verified(bed, server, len(texts) + 1)) >= len(texts) + 1, mode
        for reason in ("other", "no_seal", "unsupported_layout"):
            series = bed.spool(server).latest_counters().get("verifications_skipped", {})
            skipped = sum(v for k, v in series.items() if dict(k).get("reason") == reason)
            assert skipped == 0, (mode, reason)
    for server in bed.spools:
        assert describe(findings(bed, server)) == [], server


def _new_findings(bed: Bed, server: str, before: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + SPOOL_WAIT_S
    while True:
        new = findings(bed, server)[before:]
        if new or time.monotonic() > deadline:
            return new
        time.sleep(0.5)


@pytest.mark.parametrize("mode", ["log", "enforce"])
def test_a_corrupted_shard_is_caught_on_its_rank_as_one_incident(bed: Bed, mode: str) -> None:
    """One byte of KV head 2 changed after the seal: decode rank 1's shard only."""
    server = f"decode-{mode}"
    before = len(findings(bed, server))
    text = f"{mode} shard " + prompt(13, 70)
    served = bed.pd(mode, text, 8, corrupt=True, head=RANK1_HEAD)
    new = _new_findings(bed, server, before)
    ranks = bed.spool(server).ranks()
    assert [(e["detector"], e["kind"], ranks[e["producer"]]) for e in new] == [
        ("checksum", "digest", 1)
    ], describe(new)
    if mode == "log":
        assert served.status == 200
        return
    # enforce: the rank's load error fails the request once (vLLM unions the ranks' errors);
    # the group goes on serving.
    assert served.status != 200
    text = CLEAN[1]
    assert bed.pd("enforce", text, 8).token_ids == bed.single(text, 8).token_ids


def test_prefill_ranks_stay_clean(bed: Bed) -> None:
    assert describe(findings(bed, "prefill")) == []
    assert sum(bed.spool("prefill").latest_counters().get("hook_errors", {}).values()) == 0


# -- vLLM's own shared-storage connector at TP 2 ---------------------------------------------


def test_vllm_shared_storage_mixes_the_ranks_shards(tmp_path: Path) -> None:
    """vLLM 0.32's ``ExampleConnector`` at TP 2 names a stored prompt by its tokens alone: both
    prefill ranks write their shard of the heads to one file, and decode's ranks load the
    last writer's. The replies are HTTP 200; kvwatch's per-head seal catches it on the rank
    that read another rank's heads: a true finding about the transport, not a false one."""
    storage = tmp_path / "kv-storage"
    storage.mkdir()
    spools = {n: tmp_path / f"spool-{n}" for n in ("prefill", "decode")}
    for spool in spools.values():
        spool.mkdir()
    servers = [
        Server(
            name,
            MODEL,
            tmp_path,
            transfer_config("example", role, spools[name], "log", storage, False, node=name),
            tp=2,
        )
        for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer"))
    ]
    with serving(servers):
        bed = Bed("example", servers[0], {"log": servers[1]}, spools, storage)
        served = [bed.pd("log", f"mixed {i} " + prompt(20 + i, 50), 4) for i in range(3)]
    assert [r.status for r in served] == [200, 200, 200]
    events = bed.spool("decode").events()
    assert events, "a rank read another rank's shard and nothing was found"
    assert {(e["detector"], e["kind"]) for e in events} == {("checksum", "digest")}
    assert bed.spool("prefill").events() == []
