"""The one never-raise guard for every engine hook: the engine never sees a hook's exception.

``never_raise(on_error, fallback)`` wraps a hook so that any ``Exception`` out of it is passed
to ``on_error(hook function, its arguments, the error)`` (itself guarded) and the hook returns
``fallback()``. The engine-agnostic hooks (``engine_hooks.watch``), the SGLang plugin and the
vLLM connector each say what to count and log; the guarding is this function's alone.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")
OnError = Callable[[Callable[..., Any], tuple[Any, ...], Exception], None]


def never_raise(
    on_error: OnError, fallback: Callable[[], R]
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    def wrap(hook: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(hook)
        def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return hook(*args, **kwargs)
            except Exception as error:
                with contextlib.suppress(Exception):  # the guard itself must not raise
                    on_error(hook, args, error)
                return fallback()

        return guarded

    return wrap
