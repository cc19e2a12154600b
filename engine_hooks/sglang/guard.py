"""Hooks never raise into SGLang: a failure inside one is counted and logged once, by type.

``@safe(hook)`` is :class:`engine_hooks.guard.Guard` with this plugin's report: the hook returns
None (BEFORE and AFTER hooks make no changes) or its ``fallback()``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from engine_hooks.guard import Guard
from engine_hooks.labels import Hook

logger = logging.getLogger("kvwatch.sglang")
_reported: set[str] = set()


def failed(hook: Hook, _fn: Callable[..., Any], _args: tuple[Any, ...], error: Exception) -> None:
    """Count a hook failure; log its type once per hook (never its arguments: privacy)."""
    from engine_hooks.sglang.runtime import runtime

    try:
        rt = runtime()
        rt.hook_errors += 1
        if rt.all_watches:
            rt.all_watches[0].hook_failed(hook)
    except Exception:  # counting must not stop the log line below
        pass
    if hook not in _reported:
        _reported.add(hook)
        logger.warning(
            "kvwatch: hook %s failed (%s); counted, engine unaffected", hook, type(error).__name__
        )


safe = Guard(failed)
