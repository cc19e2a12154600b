"""The record schema: valid records pass; anything else is a SchemaError with a bounded reason."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvspool import SchemaError, catalogue, decode_payload, encode_payload
from kvspool.schema import MAX_EVENT_PAGES, MAX_EVENT_SOURCES


def base(**fields: Any) -> dict[str, Any]:
    return {"v": 1, "producer": "p", "seq": 1, "ts": 1.0} | fields


def event(**fields: Any) -> dict[str, Any]:
    """A valid event record, with ``fields`` changed."""
    defaults = dict(detector="c", kind="k", mode="log", action="logged", request_id="r")
    return base(type="event", **defaults, pages=[], pages_total=0) | fields


GOOD = [
    base(
        type="hello",
        engine="sglang",
        engine_version="0.5.23",
        role="decode",
        model="m",
        rank=0,
        pid=1,
        node="node-a",
        disaggregation_mode="decode",
        transfer_backend="mooncake",
        page_size=64,
        kv_canary="log",
        kv_checksum=True,
        mode="log",
        scrub="on_free",
        config_errors=("mode", "flush_interval"),
    ),
    base(type="counters", counters=[["verifications", {"detector": "canary"}, 3.0]]),
    base(type="gauges", gauges=[["kv_pool_tokens", {}, 681280.0]]),
    base(
        type="event",
        detector="canary",
        kind="unwritten_page",
        mode="log",
        action="logged",
        request_id="r",
        pages=[1, 2],
        pages_total=2,
        detail={"x": 1, "y": "z"},
        instance="r-1",
        sources=[
            {"request_id": "w", "pages": 2, "instance": "w-1", "written_at": 0.5},
            {"request_id": "u", "pages": 1, "instance": None, "written_at": 0.0},
        ],
        other_sources=3,
        other_source_pages=4,
    ),
    base(
        type="event",
        detector="page_tag",
        kind="stale_tag",
        mode="log",
        action="logged",
        request_id="r",
        pages=[1],
        pages_total=1,
        detail={},
        instance="9f3c01aa-2",
        sources=[],
        other_sources=0,
        other_source_pages=0,
    ),
    base(type="seal", next_segment="p.000001.kvs"),
]


@pytest.mark.parametrize("record", GOOD, ids=lambda r: r["type"])
def test_valid_records_round_trip(record: dict[str, Any]) -> None:
    assert msgspec.to_builtins(decode_payload(encode_payload(record))) == record


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"not json", "malformed"),
        (b"[1,2]", "malformed"),
        (encode_payload(base(type="hello") | {"v": 99}), "schema"),
        (encode_payload(base(type="nope")), "schema"),
        (encode_payload(base(type="counters", counters=[["unknown", {}, 1]])), "malformed"),
        (encode_payload(base(type="counters", counters=[["verifications", {}, 1]])), "malformed"),
        (
            encode_payload(
                base(type="counters", counters=[["verifications", {"detector": "c"}, -1]])
            ),
            "malformed",
        ),
        (encode_payload(event(pages=list(range(MAX_EVENT_PAGES + 1)))), "malformed"),
        (encode_payload(event(instance=7)), "malformed"),
        (
            encode_payload(
                event(sources=[{"request_id": "w", "pages": 1}] * (MAX_EVENT_SOURCES + 1))
            ),
            "malformed",
        ),
        (encode_payload(event(sources=[{"request_id": "w", "pages": -1}])), "malformed"),
        (encode_payload(event(sources=[{"request_id": "w", "pages": 1, "x": 1}])), "malformed"),
        (encode_payload(event(other_sources=1 << 64)), "malformed"),
        (encode_payload(base(type="seal", next_segment="x", seq=0)), "malformed"),
        (encode_payload(base(type="seal", next_segment="x", seq=True)), "malformed"),
    ],
)
def test_invalid_records_are_rejected_with_a_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(SchemaError) as info:
        decode_payload(payload)
    assert info.value.reason == reason


def test_unknown_label_values_become_other() -> None:
    assert catalogue.DETECTOR.bound("canary") == "canary"
    assert catalogue.DETECTOR.bound("x" * 1000) == "other"
    assert catalogue.ROLE.bound("decode") == "decode"
