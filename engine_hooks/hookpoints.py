"""The decorator of :class:`~engine_hooks.watch.KVWatch`'s hooks: timed, guarded, counted.

Each hook is timed into ``hook_seconds{hook}``; a failure inside it is caught by the one guard
(:mod:`engine_hooks.guard`), counted under ``hook_errors{hook}`` and as the skip reason
``hook_error`` of each detector whose verification the hook would have run
(:data:`HOOK_DETECTORS`), and the hook returns its fallback.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from engine_hooks.guard import Guard
from engine_hooks.labels import Detector, Hook, Skip
from kvspool.catalogue import HOOK

P = ParamSpec("P")
R = TypeVar("R")

#: The hooks of :class:`~engine_hooks.watch.KVWatch`, each named where it is defined
#: (:func:`hook`), and the flush.
HOOKS: set[str] = {Hook.FLUSH}
#: The detectors whose verification a hook's failure skips.
HOOK_DETECTORS: dict[Hook, tuple[Detector, ...]] = {
    Hook.ALLOC: (Detector.CANARY, Detector.PAGE_TAG),
    Hook.FREE: (Detector.PAGE_TAG,),
    Hook.RESERVE: (Detector.CANARY, Detector.PAGE_TAG),
    Hook.SEAL: (Detector.CHECKSUM,),
    Hook.VERIFY: (Detector.CANARY, Detector.CHECKSUM, Detector.PAGE_TAG),
    Hook.STEP: (Detector.PAGE_TAG,),
    Hook.LANDED: (Detector.PAGE_TAG,),
    Hook.WROTE: (Detector.PAGE_TAG,),
    Hook.RESOLVE: (),
    Hook.ADMISSION: (Detector.ADMISSION,),
    Hook.STARTUP: (),
}


def _failed(
    hook: Hook, _method: Callable[..., Any], args: tuple[Any, ...], _error: Exception
) -> None:
    """A hook of the watch ``args[0]`` failed: counted, and the verifications it skipped."""
    watch = args[0]
    watch.hook_failed(hook)
    for detector in HOOK_DETECTORS.get(hook, ()):
        watch.skip(detector, Skip.HOOK_ERROR)


_GUARD = Guard(_failed)


def hook(name: Hook, fallback: Callable[[], Any]) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Time a hook of a watch into ``hook_seconds{hook}`` and guard it."""
    HOOKS.add(HOOK.check(name))
    labels = (str(name),)

    def wrap(method: Callable[P, R]) -> Callable[P, R]:
        guarded = _GUARD(name, fallback)(method)

        @functools.wraps(method)
        def timed(*args: P.args, **kwargs: P.kwargs) -> R:
            watch: Any = args[0]
            started = time.perf_counter()
            try:
                result: R = guarded(*args, **kwargs)
                return result
            finally:
                watch._stats.add("hook_seconds", labels, time.perf_counter() - started)

        return timed

    return wrap
