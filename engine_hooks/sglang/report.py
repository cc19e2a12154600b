"""One log line per mismatch: detector, kind, request id and instance, page count. Never KV,
tokens or text."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from engine_hooks import Verdict

logger = logging.getLogger("kvwatch.sglang")


def log_verdicts(verdicts: Iterable[Verdict]) -> None:
    for v in verdicts:
        if v.ok:
            continue
        logger.warning(
            "kvwatch mismatch: detector=%s kind=%s request=%s instance=%s pages=%d first_pages=%s"
            " action=%s",
            v.detector,
            v.kind,
            v.request_id or "-",
            v.instance or "-",
            len(v.pages),
            list(v.pages[:8]),
            "enforced" if v.blocks else "logged",
        )
