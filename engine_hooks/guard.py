"""The one never-raise guard for every engine hook: the engine never sees a hook's exception.

``Guard(report)`` is an adapter's guard; ``@guard(hook)`` (or ``@guard(hook, fallback)``)
wraps one of its hooks so that any ``Exception`` out of it is passed to ``report(hook, the hook
function, its arguments, the error)`` (itself guarded: a report that fails is dropped) and the
hook returns ``fallback()`` (:func:`none` unless said). The engine-agnostic hooks
(:mod:`engine_hooks.watch`), the SGLang plugin, the vLLM adapter (its connector and the log
handler of its lease watch) and its block ledger each build one ``Guard`` and say what a
failure counts and logs; the guarding is this class's alone.
A hook that must call the engine's own function between two guarded halves (an AROUND hook)
guards each half, never the engine's call: the engine's exceptions are its own.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

from engine_hooks.labels import Hook

F = TypeVar("F", bound=Callable[..., Any])
#: What a guard does with a hook's failure: (hook, the hook function, its arguments, the error).
Report = Callable[[Hook, Callable[..., Any], tuple[Any, ...], Exception], None]


def none() -> None:
    """The fallback of a hook that returns nothing."""
    return None


class Guard:
    """One adapter's guard: what its hooks' failures are reported to."""

    def __init__(self, report: Report) -> None:
        self.report = report

    def __call__(self, hook: Hook, fallback: Callable[[], Any] = none) -> Callable[[F], F]:
        report = self.report

        def wrap(fn: F) -> F:
            @functools.wraps(fn)
            def guarded(*args: Any, **kwargs: Any) -> Any:
                try:
                    return fn(*args, **kwargs)
                except Exception as error:
                    with contextlib.suppress(Exception):  # the guard itself must not raise
                        report(hook, fn, args, error)
                    return fallback()

            return cast(F, guarded)

        return wrap
