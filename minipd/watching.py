"""kvwatch inside minipd, through engine_hooks' public API only."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from engine_hooks import DEFAULT_SPOOL_DIR, KVWatch, PagedKVPool, Verdict
from minipd.config import ServeConfig
from minipd.httpjson import Body, error
from minipd.kvcache import KVPool
from minipd.model import MODEL_NAME


def describe(pool: KVPool, tag_store: torch.Tensor | None = None) -> PagedKVPool:
    """The pool as the hooks see it (all K then all V; the canary stamps layer 0's K)."""
    return PagedKVPool(pool.buffers, pool.page_size, tag_store=tag_store)


def make_watch(cfg: ServeConfig, role: str, pool: PagedKVPool, pool_tokens: int) -> KVWatch | None:
    """The role's hooks, or None with ``--kvwatch off`` and no scrub (the engine runs as if
    not installed). A scrub with ``--kvwatch off`` installs them with every detector off."""
    if not cfg.kvwatch_on:
        return None
    watch = KVWatch(
        pool,
        role=role,
        engine="minipd",
        engine_version=cfg.version,
        model=MODEL_NAME,
        mode=cfg.kvwatch,
        spool=cfg.kvwatch_spool or DEFAULT_SPOOL_DIR,
        scrub=cfg.kvwatch_scrub,
    )
    watch.report_pool(pool_tokens, cfg.context_length, cfg.page_size)
    return watch


class Seen:
    """Which (request instance, detector, kind) mismatches were logged already: a request that
    fails a per-step check in log mode fails it at every step, and one log line says it."""

    def __init__(self, limit: int = 10000) -> None:
        self.limit = limit
        self.keys: set[tuple[str, str, str]] = set()

    def first(self, v: Verdict) -> bool:
        key = (v.instance or v.request_id, v.detector, v.kind or "")
        if key in self.keys:
            return False
        if len(self.keys) >= self.limit:
            self.keys.clear()
        self.keys.add(key)
        return True


def settle(
    logger: logging.Logger, verdicts: Iterable[Verdict], seen: Seen | None = None
) -> Verdict | None:
    """Log each mismatch (ids and counts only); return the first that must fail its request."""
    blocking = None
    for v in verdicts:
        if v.ok:
            continue
        if v.blocks and blocking is None:
            blocking = v
        if seen is not None and not seen.first(v):
            continue
        action = "request failed" if v.blocks else "logged, request served"
        logger.warning(
            "kvwatch mismatch rid=%s detector=%s kind=%s pages=%d (%s)",
            v.request_id or "-",
            v.detector,
            v.kind,
            len(v.pages),
            action,
        )
    return blocking


def hook_seconds(watch: KVWatch | None) -> dict[str, float]:
    """Time spent in each hook so far (kvwatch's own ``hook_seconds`` counter)."""
    return {} if watch is None else watch.hook_seconds()


def blocked(verdict: Verdict) -> tuple[int, Body]:
    """The reply for a request kvwatch stopped: a server error, and none of its text."""
    return error(
        500,
        f"kvwatch: KV verification failed ({verdict.detector}: {verdict.kind}); "
        "the request was stopped before its reply was sent",
    )
