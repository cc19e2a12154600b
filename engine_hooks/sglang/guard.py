"""Hooks never raise into SGLang: a failure inside one is counted and logged once, by type."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from engine_hooks.guard import never_raise

logger = logging.getLogger("kvwatch.sglang")
_reported: set[str] = set()


def failed(hook: str, error: BaseException) -> None:
    """Count a hook failure; log its type once per hook (never its arguments: privacy)."""
    from engine_hooks.sglang.runtime import runtime

    try:
        rt = runtime()
        rt.hook_errors += 1
        if rt.all_watches:
            rt.all_watches[0].stats.add("hook_errors", (hook,))
    except Exception:  # counting must not stop the log line below
        pass
    if hook not in _reported:
        _reported.add(hook)
        logger.warning(
            "kvwatch: hook %s failed (%s); counted, engine unaffected", hook, type(error).__name__
        )


def safe(hook: str) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """For BEFORE and AFTER hooks: run, swallow any error, always return None (no changes)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., None]:
        def run(*args: Any, **kwargs: Any) -> None:
            fn(*args, **kwargs)

        functools.update_wrapper(run, fn)
        return never_raise(lambda _fn, _args, error: failed(hook, error), _none)(run)

    return wrap


def _none() -> None:
    return None
