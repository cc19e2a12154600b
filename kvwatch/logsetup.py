"""Structured JSON logs: structlog with a small pipeline of plain callables."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, Final, TextIO

import structlog

#: Keys that could carry user data; the hooks never send them, and no log line may hold them.
FORBIDDEN_KEYS: Final = frozenset({"prompt", "text", "token_ids", "tokens", "kv", "payload"})


def drop_forbidden(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    for key in FORBIDDEN_KEYS & event.keys():
        event[key] = "[dropped]"
    return event


def configure(level: str = "info", stream: TextIO | None = None) -> None:
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            drop_forbidden,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=True),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=False,
    )
