"""Decode's side of an aborted transfer that SGLang released on a timeout.

A request that fails while prefill writes its KV into decode's pages (decode aborted it, or the
transfer failed) has its pages held by ``DecodeTransferQueue`` (``_defer_release``) until
prefill acknowledges that its writes into them have stopped: the "drained" release. After
``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`` (30 s by default) SGLang releases
them anyway, the "timeout" release, with a warning in its log ("... timed out ... releasing
anyway"): a write still in flight then lands in whichever request took the pages, which reads
the aborted request's KV as its own.

kvwatch takes SGLang's own decision, not a guess: ``resolve_deferred_releases`` hands each
released request to ``_do_release`` and then, for the same request, its outcome ("drained",
"timeout" or "error") to ``_observe_deferred_kv_release``. On "timeout" the request's pages
(its ticket, from ``_pre_alloc``) are watched for ``KVWATCH_FREED_WATCH_S`` seconds
(:class:`~engine_hooks.takers.Takers`): every request decode reserves them for (``_pre_alloc``)
or whose decode step starts one of them (``decode_pages``) in that time is a taker. When the
window closes (at ``resolve_deferred_releases``, which decode's loop runs every iteration, idle
ones too; or at shutdown) each taker is one finding, ``page_tag``
``freed_before_drain``, on the taker with the aborted request as its source, logged in every
mode (nothing shows whether a late write came). A drained release gives none, nor does clean
traffic, nor a timeout whose pages nobody took in the window.

Prefill's side of the same abort is no finding: prefill frees an aborted request's pages after
``sender.abort()``, and its decode fails the request (a ``Failed`` poll), so no reader serves
what the transfer sent; decode's pages are what the deferred release protects.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine_hooks import Verdict
from engine_hooks.takers import Takers
from engine_hooks.tickets import Ticket
from engine_hooks.watch import KVWatch

#: SGLang's outcome of a deferred release whose drain was never acknowledged.
TIMEOUT = "timeout"


@dataclass(slots=True)
class _Freed:
    watch: KVWatch
    takers: Takers


class DrainWatch:
    """One decode process's timed-out releases, the requests that take their pages since."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.watching: list[_Freed] = []
        #: What decode gave to whom while a window was open: (watch, request id, instance,
        #: pages as given, when). Pages stay as SGLang passed them (on a device, a tensor)
        #: until a window closes: no host copy on the reserve or decode-step path.
        self._taken: list[tuple[KVWatch, str, str, Any, float]] = []
        #: The release ``_do_release`` is doing, until its outcome is said.
        self._releasing: tuple[KVWatch, Ticket] | None = None
        self._lock = threading.Lock()

    def releasing(self, watch: KVWatch | None, ticket: Ticket | None) -> None:
        """``_do_release`` gives back ``ticket``'s pages (None: a request kvwatch holds none of)."""
        self._releasing = None if watch is None or ticket is None else (watch, ticket)

    def outcome(self, outcome: str, now: float | None = None) -> None:
        """SGLang said how the release :meth:`releasing` named ended."""
        releasing, self._releasing = self._releasing, None
        if releasing is None or outcome != TIMEOUT:
            return
        watch, ticket = releasing
        pages = _ints(ticket.pages)  # once per timed-out release, on SGLang's release path
        at = time.time() if now is None else now
        takers = Takers(ticket.request_id, ticket.instance, pages, at)
        with self._lock:
            self.watching.append(_Freed(watch, takers))

    def took(
        self, watch: KVWatch, request_id: str, instance: str, pages: Any, now: float | None = None
    ) -> None:
        """Decode gave ``pages`` to ``request_id`` (``instance``): read at a window's close."""
        if not self.watching:
            return
        at = time.time() if now is None else now
        with self._lock:
            self._taken.append((watch, request_id, instance, pages, at))

    def step(self, now: float | None = None) -> list[Verdict]:
        """Close the windows ``window_s`` old: their takers (only what was taken inside the
        window), then their findings."""
        if not self.watching:
            return []
        at = time.time() if now is None else now
        with self._lock:
            closed = [f for f in self.watching if at - f.takers.since >= self.window_s]
            if not closed:
                return []
            done = {id(f) for f in closed}
            self.watching = [f for f in self.watching if id(f) not in done]
            taken = self._taken
            oldest = min((f.takers.since for f in self.watching), default=None)
            # What no open window can still need goes.
            self._taken = [] if oldest is None else [t for t in taken if t[4] >= oldest]
        return self._report(closed, taken)

    def close(self) -> list[Verdict]:
        with self._lock:
            closed, self.watching = self.watching, []
            taken, self._taken = self._taken, []
        return self._report(closed, taken)

    def _report(
        self, closed: Sequence[_Freed], taken: Sequence[tuple[KVWatch, str, str, Any, float]]
    ) -> list[Verdict]:
        pages: dict[int, list[int]] = {}  # each entry's page ids, read from the device once
        out: list[Verdict] = []
        for freed in closed:
            since, end = freed.takers.since, freed.takers.since + self.window_s
            for i, (watch, rid, instance, given, at) in enumerate(taken):
                if watch is freed.watch and since <= at < end:
                    ids = pages.get(i)
                    if ids is None:
                        ids = pages[i] = _ints(given)
                    freed.takers.took(rid, instance, ids, at)
            out += _findings(freed)
        return out


def _findings(freed: _Freed) -> list[Verdict]:
    detail: dict[str, int | str] = {"freed_pages": len(freed.takers.pages)}
    return freed.watch.freed_before_drain(freed.takers, detail)


def _ints(values: Any) -> list[int]:
    """Page ids from a tensor, an array or a list (a tensor's ``tolist`` is one host copy)."""
    tolist = getattr(values, "tolist", None)
    out = tolist() if callable(tolist) else list(values)
    return [int(v) for v in out] if isinstance(out, list) else [int(out)]
