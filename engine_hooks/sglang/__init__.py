"""kvwatch inside SGLang: the ``sglang.srt.plugins`` entry point ``kvwatch``.

``pip install kvwatch`` in the engine's environment, then every SGLang process that calls
``load_plugins()`` (scheduler, engine, workers) runs :func:`register`, which checks the release's
hook points and registers kvwatch's hooks with SGLang's ``HookRegistry``. Settings come from the
environment (``KVWATCH_MODE``, ``KVWATCH_SPOOL``, ...): see ``README.md`` beside this file.

This package imports SGLang only inside :func:`register` and the hooks, so importing it costs
nothing where SGLang is absent; it never imports the daemon (``kvwatch``).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

from engine_hooks.sglang import compat, hooks_disagg, hooks_engine, hooks_memory, hooks_seal
from engine_hooks.sglang.config import from_env

logger = logging.getLogger("kvwatch.sglang")

#: (target, hook, type name, the optional point it needs or None when required).
C = compat
HOOKS: tuple[tuple[str, Callable[..., Any], str, str | None], ...] = (
    (C.ALLOCATOR + ".__init__", hooks_memory.after_init, "AFTER", None),
    (C.ALLOCATOR + ".clear", hooks_memory.after_clear, "AFTER", None),
    (C.ALLOCATOR + ".alloc", hooks_memory.around_alloc, "AROUND", None),
    (C.ALLOCATOR + ".alloc_extend", hooks_memory.around_alloc, "AROUND", None),
    (C.ALLOCATOR + ".alloc_decode", hooks_memory.around_alloc, "AROUND", None),
    (C.ALLOCATOR + "._release_page_ids", hooks_memory.before_release, "BEFORE", None),
    (C.TOKEN_ALLOCATOR + ".__init__", hooks_memory.after_init, "AFTER", "x"),
    (C.TOKEN_ALLOCATOR + ".clear", hooks_memory.after_clear, "AFTER", "x"),
    (C.TOKEN_ALLOCATOR + ".alloc", hooks_memory.around_alloc, "AROUND", "x"),
    (C.TOKEN_ALLOCATOR + ".free", hooks_memory.before_token_free, "BEFORE", "x"),
    (C.PREFILL_QUEUE + ".add", hooks_disagg.around_prefill_add, "AROUND", None),
    (C.DECODE_QUEUE + ".add", hooks_disagg.around_decode_add, "AROUND", None),
    (C.SCHEDULER + ".__init__", hooks_engine.before_scheduler_init, "BEFORE", "x"),
    (C.SCHEDULER + ".__init__", hooks_engine.after_scheduler_init, "AFTER", "x"),
    (C.SCHEDULER + ".process_batch_result", hooks_disagg.after_process_batch_result, "AFTER", "x"),
    (C.DECODE_QUEUE + "._pre_alloc", hooks_disagg.after_pre_alloc, "AFTER", "x"),
    (C.BATCH_MIXIN + ".process_prebuilt", hooks_disagg.before_process_prebuilt, "BEFORE", "x"),
    (C.BATCH_MIXIN + ".process_prebuilt", hooks_disagg.after_process_prebuilt, "AFTER", "x"),
    (
        C.RESULTS + ".process_batch_result_prebuilt",
        hooks_disagg.after_prebuilt_result,
        "AFTER",
        "x",
    ),
    (C.PREFILL_MIXIN + ".send_kv_chunk", hooks_seal.before_send_kv_chunk, "BEFORE", "x"),
    (
        C.TRANSFER_QUEUE + "._commit_transfer_to_req",
        hooks_seal.before_commit_transfer,
        "BEFORE",
        "x",
    ),
    (C.TRANSFER_QUEUE + "._do_release", hooks_disagg.before_do_release, "BEFORE", "x"),
    (
        C.TRANSFER_QUEUE + "._observe_deferred_kv_release",
        hooks_disagg.after_observe_release,
        "AFTER",
        "x",
    ),
    (
        C.TRANSFER_QUEUE + ".resolve_deferred_releases",
        hooks_disagg.after_resolve_releases,
        "AFTER",
        "x",
    ),
    (
        C.DECODE_MIXIN + "._verify_kv_checksums",
        hooks_engine.around_verify_kv_checksums,
        "AROUND",
        "x",
    ),
    (
        C.DECODE_MIXIN + "._handle_kv_checksum_mismatch",
        hooks_engine.before_kv_checksum_mismatch,
        "BEFORE",
        "x",
    ),
    (C.CANARY_REPORTER + "._format_violation", hooks_engine.after_format_violation, "AFTER", "x"),
)

#: What the last :func:`register` call attached (target names), for tests and ``status``.
attached: list[str] = []
#: The start-up line of the last :func:`register` call that loaded the plugin (one or none).
startup: list[str] = []


def register() -> bool:
    """The plugin entry point. Registers kvwatch's hooks; True if it did. Never raises."""
    try:
        return _register()
    except Exception as error:
        logger.warning("kvwatch: SGLang plugin not loaded (%s: %s)", type(error).__name__, error)
        return False


def _register() -> bool:
    attached.clear()
    startup.clear()
    settings = from_env()
    if settings.off:
        logger.info("kvwatch: KVWATCH_MODE=off, SGLang plugin not loaded")
        return False
    support = compat.check()
    if not support.ok:
        missing = ", ".join(compat.short(t) for t in support.missing_required)
        logger.warning(
            "kvwatch: SGLang %s is not supported (missing hook points: %s); plugin not loaded",
            support.version or "(not installed)",
            missing,
        )
        return False
    registry = importlib.import_module("sglang.srt.plugins.hook_registry")
    for target, hook, type_name, optional in HOOKS:
        if optional is not None and target not in support.present_optional:
            continue
        registry.HookRegistry.register(target, hook, getattr(registry.HookType, type_name))
        attached.append(target)
    skipped = ", ".join(compat.short(t) for t in support.missing_optional) or "none"
    startup[:] = [
        f"kvwatch: SGLang {support.version} plugin loaded, mode={settings.mode}, "
        f"spool={settings.spool}, {len(attached)} hooks; absent here: {skipped}"
    ]
    # SGLang's logging is not set up yet while plugins load: the scheduler says it again once
    # it is (hooks_engine.after_scheduler_init), in the server's log where an operator looks.
    logger.info("%s", startup[0])
    return True


__all__ = ["attached", "register", "startup"]
