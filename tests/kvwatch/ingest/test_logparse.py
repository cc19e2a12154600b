from __future__ import annotations

import pytest

from kvwatch.ingest.logs.parse import LineError, LogParser, parse_line

SGLANG = (
    "[2026-09-01 12:00:00 TP0] max_total_num_tokens=681280, chunked_prefill_size=8192,"
    " max_prefill_tokens=16384, max_running_requests=48, context_len=1048576,"
    " available_gpu_mem=12.34 GB"
)


def test_sglang_startup_line_with_logger_prefix() -> None:
    reading = parse_line(SGLANG)
    assert reading is not None
    assert (reading.engine, reading.pool_tokens, reading.context_length_tokens) == (
        "sglang",
        681280,
        1048576,
    )
    assert reading.rank == 0 and reading.role is None


def test_sglang_rank_colours_and_role_prefix() -> None:
    line = "prefill: \x1b[32m[2026-09-01 12:00:00 DP0 TP3]\x1b[0m " + SGLANG.split("] ", 1)[1]
    reading = parse_line(line)
    assert reading is not None
    assert (reading.role, reading.rank, reading.pool_tokens) == ("prefill", 3, 681280)


@pytest.mark.parametrize(
    "lines",
    [
        [
            "INFO 09-01 12:00:00 [kv_cache_utils.py:716] GPU KV cache size: 1,234,567 tokens,"
            " Maximum concurrency for 131,072 tokens per request: 9.42x"
        ],
        [
            "INFO 09-01 12:00:00 [kv_cache_utils.py:716] GPU KV cache size: 1,234,567 tokens",
            "INFO 09-01 12:00:00 [engine.py:1] unrelated interleaved line",
            "INFO 09-01 12:00:00 [kv_cache_utils.py:719] Maximum concurrency for 131,072 tokens"
            " per request: 9.42x",
        ],
    ],
    ids=["one-line", "two-lines"],
)
def test_vllm_capacity_line_one_or_two_lines(lines: list[str]) -> None:
    parser = LogParser("decode")
    for line in lines:
        parser.feed(line)
    [view] = parser.views.values()
    assert (view.engine, view.pool_tokens, view.context_length_tokens) == ("vllm", 1234567, 131072)
    assert view.band_tokens == 0


def test_vllm_v0_gpu_blocks_times_block_size_and_model_len() -> None:
    parser = LogParser("unified")
    parser.feed(
        "INFO 05-01 10:00:00 llm_engine.py:100] Initializing an LLM engine (v0.5.4) with config:"
        " model='meta/llama', max_seq_len=65536, block_size=32, seed=0"
    )
    parser.feed("INFO 05-01 10:00:05 gpu_executor.py:83] # GPU blocks: 1000, # CPU blocks: 512")
    [view] = parser.views.values()
    assert (view.pool_tokens, view.context_length_tokens, view.page_size) == (32000, 65536, 32)
    assert view.version == "0.5.4" and view.model == "meta/llama"
    assert view.band_tokens == 65536 - 32000


def test_vllm_blocks_default_block_size_and_using_max_model_len() -> None:
    parser = LogParser()
    parser.feed("INFO # GPU blocks: 2048")
    parser.feed("INFO Using max model len 40960")
    [view] = parser.views.values()
    assert (view.pool_tokens, view.context_length_tokens) == (2048 * 16, 40960)


def test_unreadable_lines_are_counted_not_fatal() -> None:
    parser = LogParser()
    assert parser.feed("max_total_num_tokens=lots, context_len=1048576") is None
    assert parser.feed("GPU KV cache size: many tokens") is None
    assert parser.feed("x" * 70000 + " max_total_num_tokens=1") is None
    assert parser.feed("\x00\x01 binary junk \xff") is None
    assert parser.feed("ServerArgs(context_length=None, page_size=1)") is None  # not a trigger
    assert parser.errors == {"unparsed": 2, "long_line": 1}
    assert parser.views == {}


def test_parse_line_raises_on_trigger_without_value() -> None:
    with pytest.raises(LineError):
        parse_line("Using max model len ???")
