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
    {"alloc", "free", "reserve", "seal", "verify", "step", "resolve", "admission", "startup"}
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


def _require(record: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = record.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise SchemaError("malformed", f"field {key!r} missing or not {kind}")
    return value


def _check_str(record: dict[str, Any], key: str) -> None:
    value = _require(record, key, str)
    if len(value) > MAX_STRING_CHARS:
        raise SchemaError("malformed", f"field {key!r} longer than {MAX_STRING_CHARS}")


def _check_series(items: object, names: dict[str, tuple[str, ...]]) -> None:
    if not isinstance(items, list):
        raise SchemaError("malformed", "series list is not a list")
    for item in items:
        if not (isinstance(item, list) and len(item) == 3):
            raise SchemaError("malformed", "series entry is not [name, labels, value]")
        name, labels, value = item
        if name not in names:
            raise SchemaError("malformed", f"unknown series {name!r}")
        if not isinstance(labels, dict) or set(labels) != set(names[name]):
            raise SchemaError("malformed", f"series {name!r} has wrong labels")
        if not all(isinstance(v, str) and len(v) <= MAX_STRING_CHARS for v in labels.values()):
            raise SchemaError("malformed", f"series {name!r} has a non-string label")
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise SchemaError("malformed", f"series {name!r} has a bad value")


def validate(record: object) -> dict[str, Any]:
    """Return ``record`` if it is a valid record of this schema, else raise :class:`SchemaError`."""
    if not isinstance(record, dict):
        raise SchemaError("malformed", "record is not a JSON object")
    version = record.get("v")
    if version != SCHEMA_VERSION:
        raise SchemaError("schema", f"unknown schema version {version!r}")
    kind = record.get("type")
    if kind not in RECORD_TYPES:
        raise SchemaError("schema", f"unknown record type {kind!r}")
    _check_str(record, "producer")
    seq = _require(record, "seq", int)
    if seq < 1:
        raise SchemaError("malformed", "seq must be >= 1")
    _require(record, "ts", (int, float))
    if kind == HELLO:
        for key in ("engine", "engine_version", "role", "model"):
            _check_str(record, key)
        _require(record, "rank", int)
        _require(record, "pid", int)
    elif kind == COUNTERS:
        _check_series(record.get("counters"), COUNTER_LABELS)
    elif kind == GAUGES:
        _check_series(record.get("gauges"), GAUGE_LABELS)
    elif kind == EVENT:
        for key in ("detector", "kind", "mode", "action", "request_id"):
            _check_str(record, key)
        pages = _require(record, "pages", list)
        if len(pages) > MAX_EVENT_PAGES or not all(
            isinstance(p, int) and not isinstance(p, bool) for p in pages
        ):
            raise SchemaError("malformed", "pages must be at most MAX_EVENT_PAGES integers")
        _require(record, "pages_total", int)
        detail = record.get("detail", {})
        if not isinstance(detail, dict) or not all(
            isinstance(v, int | str) and not isinstance(v, bool) for v in detail.values()
        ):
            raise SchemaError("malformed", "detail must map names to integers or strings")
    elif kind == SEAL:
        _check_str(record, "next_segment")
    return record


def decode_payload(payload: bytes) -> dict[str, Any]:
    """Parse and validate one payload; raises :class:`SchemaError`."""
    try:
        record = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SchemaError("malformed", f"payload is not JSON: {exc}") from None
    return validate(record)
