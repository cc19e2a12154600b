"""The daemon's logs: structlog, JSON lines for machines, coloured lines for a person at a TTY."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, Final, TextIO

import structlog

#: Keys that could carry user data; the hooks never send them, and no log line may hold them.
FORBIDDEN_KEYS: Final = frozenset({"prompt", "text", "token_ids", "tokens", "kv", "payload"})
LEVELS: Final = ("debug", "info", "warning", "error")
#: auto: human-readable on a terminal, JSON lines otherwise (journald, kubectl logs, files).
FORMATS: Final = ("auto", "json", "human")


def drop_forbidden(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    for key in FORBIDDEN_KEYS & event.keys():
        event[key] = "[dropped]"
    return event


def configure(level: str = "info", stream: TextIO | None = None, fmt: str = "json") -> None:
    out = stream or sys.stderr
    human = fmt == "human" or (fmt == "auto" and out.isatty())
    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=out.isatty(), sort_keys=True)
        if human
        else structlog.processors.JSONRenderer(sort_keys=True)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            drop_forbidden,
            # The console renderer formats exceptions itself (and warns if this ran first).
            *([] if human else [structlog.processors.format_exc_info]),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
