"""Case 4: hostile and broken input, fuzzed with structure-aware mutations (hypothesis).

Valid records of every type are built, then mutated at three levels: the record (a field
dropped, retyped, replaced by any JSON value, lone surrogates, integers past 2^63, 2^64 and
2^1024, NaN/Infinity, timestamps far from now, deep nesting), the payload bytes (flips, cuts,
inserted bytes and magics), and the frame (length, CRC, splices). The decoder may only raise
``SchemaError``; the spool reader's poll and the log parser never raise. Survival is not
enough: beside each hostile segment a good producer writes many valid records, and after each
example every one of them is in the journal, and the journal, /metrics, the status page and
``kvwatch incidents`` all render. The spool also holds FIFOs, directories, zero-length files,
symbolic links and badly named files. CI runs a bounded, derandomized run;
``KVWATCH_FUZZ_EXAMPLES=N`` runs N per test with fresh randomness (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvspool
from kvspool import schema
from kvwatch.ingest.logs.parse import LineError, LogParser, parse_line
from kvwatch.ingest.spool.reader import SpoolReader
from kvwatch.store.journal import Journal
from tests.kvwatch.spoolgen import Producer
from tests.kvwatch.views import render_all
from tests.reliability.fuzz_junk import JUNK_KINDS, add_junk

LONG = int(os.environ.get("KVWATCH_FUZZ_EXAMPLES", "0"))
T0 = time.time() - 60


def fuzz_settings(ci_examples: int) -> Any:
    return settings(
        max_examples=LONG or ci_examples,
        deadline=None,
        derandomize=not LONG,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


# -- records ----------------------------------------------------------------------------------

BIG_INTS = st.sampled_from(
    [0, -1, 1 << 63, -(1 << 63), (1 << 63) - 1, 1 << 64, 1 << 1024, 10**30, -(10**30), 10**400]
)
EXTREME_TS = st.sampled_from([1e12, -1e12, 1e299, 1 << 63, 0, time.time() + 86400 * 365])
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    BIG_INTS,
    EXTREME_TS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=300),
    st.sampled_from(["", "other", "canary", "hello", "event", "x" * 257, "\ud800", "a\udfff"]),
)
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)


def base_record(kind: str, seq: int) -> dict[str, Any]:
    record: dict[str, Any] = {"v": 1, "type": kind, "producer": "fz", "seq": seq, "ts": T0}
    if kind == "hello":
        record.update(engine="sglang", engine_version="1", role="decode", model="m", rank=0, pid=1)
    elif kind == "event":
        record.update(
            detector="canary", kind="digest", mode="log", action="logged", request_id="r",
            pages=[1, 2], pages_total=2, detail={"a": 1},
        )  # fmt: skip
    elif kind == "counters":
        record["counters"] = [["verifications", {"detector": "canary"}, 3]]
    elif kind == "gauges":
        record["gauges"] = [["kv_pool_tokens", {}, 100.0]]
    else:
        record["next_segment"] = "fz.000001.kvs"
    return record


@st.composite
def records(draw: st.DrawFn, seq: int = 2) -> dict[str, Any]:
    kind = draw(st.sampled_from(sorted(schema.RECORD_TYPES)))
    record = base_record(kind, seq)
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["drop", "set", "add", "series"]))
        key = draw(st.sampled_from(sorted(record)))
        if op == "drop":
            record.pop(key, None)
        elif op == "set":
            record[key] = draw(JSON)
        elif op == "add":
            record[draw(st.text(max_size=10))] = draw(JSON)
        elif isinstance(record.get("counters"), list):
            record["counters"].append([draw(JSON), draw(JSON), draw(JSON)])
    return record


def nested(depth: int) -> bytes:
    return b'{"v":1,"type":"event","x":' + b"[" * depth + b"]" * depth + b"}"


@st.composite
def payloads(draw: st.DrawFn, seq: int = 2) -> bytes:
    if draw(st.integers(0, 19)) == 0:
        return nested(draw(st.sampled_from([10, 1000, 30_000])))
    # ensure_ascii writes a lone surrogate as its \\uXXXX escape; the raw bytes come below.
    data = bytearray(json.dumps(draw(records(seq)), allow_nan=True).encode())
    if draw(st.integers(0, 9)) == 0 and b'"' in data:
        at = data.index(b'"') + 1
        data[at:at] = b"\xed\xa0\x80"  # a lone surrogate as raw (invalid UTF-8) bytes
    for _ in range(draw(st.integers(0, 2))):
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[at:]
        else:
            data[at:at] = draw(st.binary(max_size=16) | st.just(kvspool.MAGIC))
    return bytes(data)


@st.composite
def frames(draw: st.DrawFn, seq: int = 2) -> bytes:
    frame = bytearray(kvspool.encode_frame(draw(payloads(seq))))
    op = draw(st.sampled_from(["none", "none", "length", "crc", "cut", "magic", "junk"]))
    if op == "length":
        frame[4:8] = draw(st.integers(0, (1 << 32) - 1)).to_bytes(4, "little")
    elif op == "crc":
        frame[8] ^= 0xFF
    elif op == "cut":
        del frame[draw(st.integers(0, len(frame) - 1)) :]
    elif op == "magic":
        at = draw(st.integers(0, len(frame)))
        frame[at:at] = kvspool.MAGIC
    elif op == "junk":
        frame[0:0] = draw(st.binary(min_size=1, max_size=32))
    return bytes(frame)


@fuzz_settings(400)
@given(blob=st.lists(frames(), min_size=1, max_size=4).map(b"".join))
def test_decoder_raises_only_schema_errors(blob: bytes) -> None:
    for frame in kvspool.iter_frames(blob):
        assert frame.offset < frame.end <= len(blob)
        if frame.payload is not None:
            try:
                kvspool.decode_payload(frame.payload)
            except kvspool.SchemaError as exc:
                assert exc.reason in {"malformed", "schema"}


@fuzz_settings(400)
@given(record=records())
def test_validate_raises_only_schema_errors(record: dict[str, Any]) -> None:
    try:
        kvspool.validate(record)
    except kvspool.SchemaError:
        return


JUNK_ENTRIES = st.lists(st.sampled_from(JUNK_KINDS), max_size=4)


@fuzz_settings(60)
@given(
    bodies=st.lists(frames(), min_size=1, max_size=6),
    good_records=st.integers(1, 200),
    junk=JUNK_ENTRIES,
)
def test_spool_reader_never_raises(bodies: list[bytes], good_records: int, junk: list[str]) -> None:
    hello = kvspool.encode_frame(kvspool.encode_payload(base_record("hello", 1)))
    with tempfile.TemporaryDirectory() as tmp:
        spool = Path(tmp) / "spool"
        spool.mkdir()
        (spool / "fz.000000.kvs").write_bytes(hello + b"".join(bodies))
        good = Producer(spool, "good-decode-r0-1-goodgood", t0=T0)
        good.append(good.hello(), *(good.event(f"good-{i}") for i in range(good_records)))
        add_junk(spool, junk)
        journal = Journal(Path(tmp) / "j.db")
        try:
            state = journal.load()
            reader = SpoolReader(spool, journal, state, idle_grace=0.0, quarantine_dir=spool / "q")
            first = reader.poll()
            assert first.records >= 1 + good_records  # the hostile hello and every good record
            reader.poll()
            assert not list(spool.glob("fz.*.kvs"))  # finished: nothing wedged
            assert not list(spool.glob("good-*.kvs"))
            committed = {i.request_id for i in journal.incidents() if i.producer == good.name}
            assert committed == {f"good-{i}" for i in range(good_records)}
            render_all(state, journal)
        finally:
            journal.close()


# -- engine log lines -------------------------------------------------------------------------

LOG_TEMPLATES = [
    "[2026-01-01 00:00:00 TP{a}] max_total_num_tokens={n}, chunked_prefill_size={b}, "
    "max_prefill_tokens={b}, context_len={c}, available_gpu_mem=12.34 GB",
    "INFO 01-01 00:00:00 gpu_worker.py:1] GPU KV cache size: {n} tokens",
    "INFO Maximum concurrency for {c} tokens per request: {a}.42x",
    "INFO # GPU blocks: {n}, # CPU blocks: {b}",
    "INFO Using max model len {c}",
    "INFO Initializing a V1 LLM engine (v{a}.{b}) with config: model='{m}', max_seq_len={c}, "
    "block_size={b}",
]
NUMBERS = st.one_of(
    st.integers(0, 10**12).map(str),
    st.integers(0, 10**9).map(lambda n: f"{n:,}"),
    st.text("0123456789,_", min_size=1, max_size=40),
    st.integers(30, 6000).map(lambda n: "9" * n),
    st.text(max_size=8),
)


@st.composite
def log_lines(draw: st.DrawFn) -> str:
    line = draw(st.sampled_from(LOG_TEMPLATES)).format(
        n=draw(NUMBERS), a=draw(NUMBERS), b=draw(NUMBERS), c=draw(NUMBERS),
        m=draw(st.text(max_size=20).filter(lambda s: "}" not in s)),
    )  # fmt: skip
    prefix = draw(st.sampled_from(["", "prefill: ", "DECODE : ", "\x1b[32m", "x" * 70_000]))
    line = prefix + line
    if draw(st.booleans()):
        at = draw(st.integers(0, len(line)))
        line = line[:at] + draw(st.text(max_size=20)) + line[at + draw(st.integers(0, 5)) :]
    return line


@fuzz_settings(500)
@given(lines=st.lists(log_lines(), min_size=1, max_size=5))
def test_log_parser_never_raises(lines: list[str]) -> None:
    parser = LogParser()
    for line in lines:
        parser.feed(line)
        with contextlib.suppress(LineError):
            parse_line(line)
