"""Hooks never raise into vLLM: a failure is logged by type and counted as ``hook_errors{hook}``.

``@safe(hook)`` (or ``@safe(hook, fallback)``) is :class:`engine_hooks.guard.Guard` with this
adapter's report, for the methods of an object with a ``watch`` (the connector, the log handler
of :mod:`engine_hooks.vllm.lease`): the method returns what one that does nothing would return.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from engine_hooks.guard import Guard
from engine_hooks.labels import Hook

logger = logging.getLogger("kvwatch.vllm")


def failed(hook: Hook, method: Callable[..., Any], args: tuple[Any, ...], error: Exception) -> None:
    """Log the failure and count it on the method's object's watch, once it has one."""
    # The exception's type only: its message could quote request contents.
    logger.warning(
        "kvwatch: %s failed (%s); the engine goes on", method.__name__, type(error).__name__
    )
    watch = args[0].watch
    if watch is not None:
        watch.hook_failed(hook)


safe = Guard(failed)
