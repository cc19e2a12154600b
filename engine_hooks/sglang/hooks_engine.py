"""Hooks on the scheduler and on SGLang's own detectors.

- ``Scheduler.__init__`` (BEFORE): the process's role, model and rank, before its pool is built;
  (AFTER): pool versus context (``max_total_num_tokens``, ``context_len``), the same numbers as
  SGLang's startup log line.
- ``_verify_kv_checksums`` (AROUND) and ``_handle_kv_checksum_mismatch`` (BEFORE), v0.5.21+:
  every request SGLang's ``--disaggregation-enable-kv-checksum`` verified, and every mismatch,
  as ``engine_checksum`` coverage and events.
- ``kv_canary.runner.violation_reporter._format_violation`` (AFTER), v0.5.22+: every
  ``--kv-canary`` violation as an ``engine_canary`` event. The row's token ids are not copied.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from engine_hooks.labels import Detector, Hook, Kind, Skip
from engine_hooks.sglang.guard import safe
from engine_hooks.sglang.runtime import runtime
from kvspool import schema

logger = logging.getLogger("kvwatch.sglang")

ROLES = {"prefill": "prefill", "decode": "decode", "null": "unified", "none": "unified"}


def _attr(obj: Any, *names: str) -> Any:
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return None


def _text(value: Any) -> str:
    text = getattr(value, "value", value)
    return "" if text is None else str(text)


def context_from_server_args(server_args: Any, rank: int | None = None) -> None:
    """Role, model, rank and engine settings of this process, from SGLang's ``ServerArgs``."""
    rt = runtime()
    ctx = rt.context
    mode = _text(_attr(server_args, "disaggregation_mode")).lower()
    if not rt.settings.role:
        ctx.role = ROLES.get(mode, "unified")
    model = _attr(server_args, "served_model_name", "model_path")
    ctx.model = _text(model)[: schema.MAX_STRING_CHARS]
    if rank is not None:
        ctx.rank = int(rank)
    ctx.extra.update(
        {
            "disaggregation_mode": mode or "null",
            "transfer_backend": _text(_attr(server_args, "disaggregation_transfer_backend")),
            "page_size": int(_attr(server_args, "page_size") or 1),
            "kv_canary": _text(_attr(server_args, "kv_canary")),
            "kv_checksum": bool(_attr(server_args, "disaggregation_enable_kv_checksum")),
        }
    )


def _tp_rank(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    if "tp_rank" in kwargs:  # v0.5.19: Scheduler(server_args, port_args, gpu_id, tp_rank, ...)
        return int(kwargs["tp_rank"])
    if len(args) >= 5 and isinstance(args[4], int):
        return int(args[4])
    try:
        parallel = importlib.import_module("sglang.srt.runtime_context").get_parallel()
        return int(parallel.tp_rank)
    except Exception:
        return None


@safe(Hook.STARTUP)
def before_scheduler_init(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    server_args = kwargs.get("server_args", args[0] if args else None)
    if server_args is not None:
        context_from_server_args(server_args, _tp_rank((scheduler, *args), kwargs))


def report_pool(pool_tokens: int, context_length: int, page_size: int) -> None:
    rt = runtime()
    watches = list(rt.all_watches) or [rt.engine_watch()]
    for watch in watches:
        watch.report_pool(pool_tokens, context_length, page_size)
        watch.flush()


@safe(Hook.STARTUP)
def after_scheduler_init(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    pool = int(getattr(scheduler, "max_total_num_tokens", 0) or 0)
    context = int(getattr(getattr(scheduler, "model_config", None), "context_len", 0) or 0)
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    page_size = int(
        getattr(allocator, "page_size", 0) or runtime().context.extra.get("page_size", 1)
    )
    report_pool(pool, context, page_size)
    _say_loaded(page_size)


def _say_loaded(page_size: int) -> None:
    """The plugin's start-up line, in the scheduler's log (SGLang's logging is set up by now),
    with the role and page size (at page size 1 a page is one token slot)."""
    from engine_hooks.sglang import startup

    if startup:
        rt = runtime()
        logger.info("%s; role=%s, page size %d", startup[0], rt.context.role, page_size)


# -- SGLang's own checksum ----------------------------------------------------------------------


def around_verify_kv_checksums(original: Any, scheduler: Any, batch: Any, *a: Any, **k: Any) -> Any:
    pending = _checksums_pending(scheduler, batch)
    result = original(scheduler, batch, *a, **k)
    if pending:
        _checksums_verified(pending)
    return result


@safe(Hook.VERIFY, list)
def _checksums_pending(scheduler: Any, batch: Any) -> list[Any]:
    """The batch's requests SGLang's checksum will verify (the rest counted as skipped)."""
    if getattr(scheduler, "kv_checksum_computer", None) is None:
        watch = runtime().engine_watch()
        for _ in getattr(batch, "reqs", ()):
            watch.skip(Detector.ENGINE_CHECKSUM, Skip.MODE_OFF)
        return []
    return [r for r in batch.reqs if getattr(r, "expected_kv_checksum", 0)]


@safe(Hook.VERIFY)
def _checksums_verified(pending: list[Any]) -> None:
    verified = sum(1 for r in pending if not getattr(r, "expected_kv_checksum", 0))
    runtime().engine_watch().verified(Detector.ENGINE_CHECKSUM, verified)


@safe(Hook.VERIFY)
def before_kv_checksum_mismatch(scheduler: Any, req: Any, msg: Any = "", *a: Any, **k: Any) -> None:
    watch = runtime().engine_watch()
    # SGLang aborts the request itself (HTTP 500): the mismatch was enforced.
    instance = runtime().instance_of(req)
    detail: dict[str, int | str] = {"source": "sglang"}
    watch.engine_finding(
        Detector.ENGINE_CHECKSUM,
        Kind.DIGEST,
        str(req.rid),
        detail,
        enforced=True,
        instance=instance,
    )


# -- SGLang's own kv-canary ---------------------------------------------------------------------


@safe(Hook.VERIFY)
def after_format_violation(result: Any, *args: Any, **kwargs: Any) -> None:
    row = kwargs.get("row", args[0] if args else None)
    if row is None or len(row) < 8:
        return
    watch = runtime().engine_watch()
    reporter = importlib.import_module("sglang.srt.kv_canary.runner.violation_reporter")
    bits = int(row[7])
    reasons = [b.name.lower() for b in reporter.FailReason if bits & int(b)]
    try:
        tag = reporter.CanaryLaunchTag(int(row[0])).name.lower()
    except ValueError:
        tag = "unknown"
    # slot index is a KV location (like a page id); stored/expected tokens are never copied.
    detail: dict[str, int | str] = {
        "source": "sglang",
        "launch_tag": tag,
        "fail_reason": "+".join(reasons) or "none",
        "slot": int(row[1]),
    }
    watch.engine_finding(Detector.ENGINE_CANARY, Kind.OTHER, "", detail, enforced=False)
