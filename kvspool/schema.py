"""The spool record schema: what a record may say, and the fixed label sets.

Records are JSON objects. Every record carries ``v`` (schema version), ``type``, ``producer``,
``seq`` (per producer, from 1, no gaps unless records were lost) and ``ts`` (Unix seconds).
Nothing in a record may carry prompt text, token ids or KV bytes: only request ids, page ids,
digests and counts. :func:`validate` is the single gate the daemon applies.
"""

from __future__ import annotations

import json
from typing import Any, Final

SCHEMA_VERSION: Final = 1

#: The largest payload a producer writes and a reader accepts.
MAX_RECORD_BYTES: Final = 64 * 1024
#: An event names at most this many pages; ``pages_total`` keeps the true count.
MAX_EVENT_PAGES: Final = 256
MAX_STRING_CHARS: Final = 256

# Record types.
HELLO: Final = "hello"
COUNTERS: Final = "counters"
GAUGES: Final = "gauges"
EVENT: Final = "event"
SEAL: Final = "seal"
RECORD_TYPES: Final = frozenset({HELLO, COUNTERS, GAUGES, EVENT, SEAL})

# Fixed label values. Anything else a producer sends is mapped to "other" by the daemon.
OTHER: Final = "other"
ROLES: Final = frozenset({"prefill", "decode", "unified", OTHER})
ENGINES: Final = frozenset({"sglang", "vllm", "minipd", OTHER})
DETECTORS: Final = frozenset(
    {"canary", "checksum", "page_tag", "admission", "engine_canary", "engine_checksum"}
)
KINDS: Final = frozenset(
    {
        "unwritten_page",  # a reserved page still holds its canary at admit: nobody wrote it
        "write_to_free_page",  # a free page's canary was overwritten before its next allocation
        "digest",  # the reader's Adler-32 over the pages differs from the writer's seal
        "page_count",  # the reader holds a different number of pages than the writer sealed
        "stale_tag",  # a page's generation changed while a request still referenced it
        "double_free",  # a page returned to the free list while already free
        "aborted_admitted",  # an aborted request passed an admission queue
        OTHER,
    }
)
SKIP_REASONS: Final = frozenset(
    {"mode_off", "unsupported_layout", "no_seal", "no_pool", "hook_error", OTHER}
)
QUEUES: Final = frozenset({"prefill_bootstrap", "decode_prealloc", OTHER})
HOOKS: Final = frozenset(
    {
        "alloc",
        "free",
        "reserve",
        "seal",
        "verify",
        "step",
        "resolve",
        "admission",
        "startup",
        "flush",
    }
)
DROP_REASONS: Final = frozenset({"spool_full", "write_error", "oversize", "closed"})
MODES: Final = frozenset({"off", "log", "enforce"})
ACTIONS: Final = frozenset({"logged", "enforced"})

#: Counter name -> the label names it carries, in order.
COUNTER_LABELS: Final[dict[str, tuple[str, ...]]] = {
    "verifications": ("detector",),
    "verifications_skipped": ("detector", "reason"),
    "mismatches": ("detector", "kind"),
    "aborted_admissions": ("queue",),
    "hook_seconds": ("hook",),
    "hook_errors": ("hook",),
    "spool_dropped": ("reason",),
}
#: Gauge name -> label names.
GAUGE_LABELS: Final[dict[str, tuple[str, ...]]] = {
    "kv_pool_tokens": (),
    "context_length_tokens": (),
    "page_size_tokens": (),
}
#: Label name -> its fixed value set.
LABEL_VALUES: Final[dict[str, frozenset[str]]] = {
    "detector": DETECTORS,
    "kind": KINDS,
    "reason": SKIP_REASONS | DROP_REASONS,
    "queue": QUEUES,
    "hook": HOOKS,
    "role": ROLES,
    "engine": ENGINES,
}


class SchemaError(ValueError):
    """A payload that is not a valid record; ``reason`` is a bounded label value."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def bounded(label: str, value: object) -> str:
    """The value if it is in ``label``'s fixed set, else ``"other"``."""
    allowed = LABEL_VALUES.get(label)
    text = str(value)
    if allowed is None or text in allowed:
        return text
    return OTHER


def encode_payload(record: dict[str, Any]) -> bytes:
    return json.dumps(record, separators=(",", ":"), allow_nan=False).encode()


# Validation runs on every record the daemon reads, so it uses exact type() checks (which
# also keep bools out of int fields) and no per-field helper calls on the common path.


def _malformed(message: str) -> SchemaError:
    return SchemaError("malformed", message)


def _check_strings(record: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        value = record.get(key)
        if type(value) is not str or len(value) > MAX_STRING_CHARS:
            raise _malformed(f"field {key!r} missing, not a string or too long")


def _check_series(items: object, names: dict[str, tuple[str, ...]]) -> None:
    if type(items) is not list:
        raise _malformed("series list is not a list")
    for item in items:
        if type(item) is not list or len(item) != 3:
            raise _malformed("series entry is not [name, labels, value]")
        name, labels, value = item
        label_names = names.get(name) if type(name) is str else None
        if label_names is None:
            raise _malformed(f"unknown series {name!r}")
        if type(labels) is not dict or len(labels) != len(label_names):
            raise _malformed(f"series {name!r} has wrong labels")
        for label in label_names:
            text = labels.get(label)
            if type(text) is not str or len(text) > MAX_STRING_CHARS:
                raise _malformed(f"series {name!r} has a missing or bad label {label!r}")
        if type(value) not in (int, float) or value < 0:
            raise _malformed(f"series {name!r} has a bad value")


def _check_hello(record: dict[str, Any]) -> None:
    _check_strings(record, ("engine", "engine_version", "role", "model"))
    if not all(type(record.get(k)) is int and abs(record[k]) < 1 << 63 for k in ("rank", "pid")):
        raise _malformed("hello needs integer rank and pid")


def _check_counters(record: dict[str, Any]) -> None:
    _check_series(record.get("counters"), COUNTER_LABELS)


def _check_gauges(record: dict[str, Any]) -> None:
    _check_series(record.get("gauges"), GAUGE_LABELS)


def _check_event(record: dict[str, Any]) -> None:
    _check_strings(record, ("detector", "kind", "mode", "action", "request_id"))
    pages = record.get("pages")
    if (
        type(pages) is not list
        or len(pages) > MAX_EVENT_PAGES
        or not all(type(p) is int for p in pages)
    ):
        raise _malformed("pages must be at most MAX_EVENT_PAGES integers")
    if type(total := record.get("pages_total")) is not int or abs(total) >= 1 << 63:
        raise _malformed("pages_total must be an integer")
    # Optional: the request instance (one admission of request_id; ids can repeat).
    instance = record.get("instance", "")
    if type(instance) is not str or len(instance) > MAX_STRING_CHARS:
        raise _malformed("field 'instance' not a string or too long")
    detail = record.get("detail", {})
    if type(detail) is not dict or not all(type(v) in (int, str) for v in detail.values()):
        raise _malformed("detail must map names to integers or strings")


def _check_seal(record: dict[str, Any]) -> None:
    _check_strings(record, ("next_segment",))


_CHECKS = {
    HELLO: _check_hello,
    COUNTERS: _check_counters,
    GAUGES: _check_gauges,
    EVENT: _check_event,
    SEAL: _check_seal,
}


def validate(record: object) -> dict[str, Any]:
    """Return ``record`` if it is a valid record of this schema, else raise :class:`SchemaError`."""
    if type(record) is not dict:
        raise _malformed("record is not a JSON object")
    version = record.get("v")
    if version != SCHEMA_VERSION or type(version) is not int:
        raise SchemaError("schema", f"unknown schema version {version!r}")
    check = _CHECKS.get(kind) if type(kind := record.get("type")) is str else None
    if check is None:
        raise SchemaError("schema", f"unknown record type {record.get('type')!r}")
    producer, seq = record.get("producer"), record.get("seq")
    if type(producer) is not str or len(producer) > MAX_STRING_CHARS:
        raise _malformed("field 'producer' missing, not a string or too long")
    if type(seq) is not int or not 0 < seq < 1 << 63:  # SQLite INTEGER
        raise _malformed("seq must be an integer >= 1")
    if type(record.get("ts")) not in (int, float) or not abs(record["ts"]) < 1e300:  # NaN, inf
        raise _malformed("ts must be a number")
    check(record)
    return record


def decode_payload(payload: bytes) -> dict[str, Any]:
    """Parse and validate one payload; raises :class:`SchemaError`."""
    try:
        record = json.loads(payload)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise SchemaError("malformed", f"payload is not JSON: {exc}") from None
    return validate(record)
