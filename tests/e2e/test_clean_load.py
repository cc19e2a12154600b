"""Clean load: many concurrent requests of mixed lengths, every one verified, no mismatch."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.e2e.server import MiniPD, generate_body, post

REQUESTS = 240
CLIENTS = 16
ARGS = ["--pool-tokens", "65536", "--context-length", "8192", "--page-size", "16"]


def prompts(seed: int) -> list[tuple[list[str], int]]:
    rng = random.Random(seed)
    out = []
    for i in range(REQUESTS):
        length = rng.randint(20, 1600)
        words = [f"w{i}-{j}" for j in range(length)]
        out.append((words, rng.randint(1, 12)))
    return out


def test_concurrent_mixed_load_verifies_10000_pages_without_a_mismatch(tmp_path: Path) -> None:
    work = prompts(7)
    with MiniPD(ARGS, tmp_path, kvwatch="log") as pd:

        def one(item: tuple[list[str], int]) -> tuple[int, str, int]:
            words, max_new = item
            status, body = post(pd.url + "/generate", generate_body(" ".join(words), max_new))
            return status, body.get("text", ""), body.get("meta_info", {}).get("prompt_tokens", 0)

        with ThreadPoolExecutor(CLIENTS) as pool:
            results = list(pool.map(one, work))
        _, stats = pd.get("/stats")
    for (words, max_new), (status, text, prompt_tokens) in zip(work, results, strict=True):
        assert status == 200
        assert prompt_tokens == len(words)
        # The model recites its own context from the start: exactly its own prompt.
        assert text == " ".join(words[:max_new])
    decode = stats["decode"]
    assert decode["admitted"] == REQUESTS and decode["failed"] == 0
    assert decode["pages_verified_at_admit"] >= 10_000
    spool = pd.read_spool()
    assert not spool.events()
    assert not spool.errors
    counters = spool.latest_counters()
    verified = {dict(k)["detector"]: v for k, v in counters["verifications"].items()}
    assert verified["canary"] >= REQUESTS and verified["checksum"] >= REQUESTS
    assert verified["page_tag"] >= REQUESTS
    assert not counters.get("mismatches")
