"""Where each release stops an over-length request, seen from decode's free list."""

from __future__ import annotations

import time
from pathlib import Path

from tests.e2e.server import MiniPD

ARGS = [
    "--pool-tokens", "1024", "--decode-pool-tokens", "4096", "--context-length", "4096",
    "--transfer-timeout", "0.5",
]  # fmt: skip
DECODE_PAGES = 4096 // 16
IN_BAND = "word " * 2000  # longer than prefill's pool, inside the context: 125 pages


def decode_free_pages(pd: MiniPD) -> int:
    return int(pd.get("/stats")[1]["decode"]["free_pages"])


def test_0_5_20_returns_400_and_decode_half_waits_for_its_transfer_timeout(tmp_path: Path) -> None:
    with MiniPD(["--release", "0.5.20", *ARGS], tmp_path) as pd:
        assert pd.generate(IN_BAND)[0] == 400
        assert decode_free_pages(pd) == DECODE_PAGES - 125  # reserved, never written
        deadline = time.monotonic() + 10
        while decode_free_pages(pd) != DECODE_PAGES and time.monotonic() < deadline:
            time.sleep(0.1)
        assert decode_free_pages(pd) == DECODE_PAGES
        assert "KV transfer timed out" in pd.log("decode")


def test_0_5_22_rejects_before_decode_reserves_anything(tmp_path: Path) -> None:
    with MiniPD(["--release", "0.5.22", *ARGS], tmp_path) as pd:
        status, body = pd.generate(IN_BAND)
        assert status == 400 and "exceeds the maximum allowed length" in body["error"]["message"]
        assert decode_free_pages(pd) == DECODE_PAGES
        status, body = pd.generate("word " * 100, 4)  # and the engine serves on
        assert status == 200 and body["text"] == "word word word word"


def test_0_5_19_answers_200_with_the_full_prompt_length(tmp_path: Path) -> None:
    with MiniPD(["--release", "0.5.19", *ARGS], tmp_path) as pd:
        status, body = pd.generate(IN_BAND, 4)
        assert status == 200 and body["meta_info"]["prompt_tokens"] == 2000
        assert decode_free_pages(pd) == DECODE_PAGES  # it finished and gave its pages back
