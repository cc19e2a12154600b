"""Per-process state of the plugin: who this process is, its watches, its decode tickets.

One SGLang scheduler process serves one role (prefill, decode or unified) on one rank and owns
one KV pool allocator (more with speculative decoding). Each allocator gets its own
:class:`~engine_hooks.KVWatch` (one spool producer); admission and harvested engine detectors
report through the process's first watch.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_hooks import Seal
from engine_hooks.labels import Skip
from engine_hooks.pool import Layout, PagedKVPool
from engine_hooks.sglang.config import Settings, from_env
from engine_hooks.sglang.consensus import Consensus
from engine_hooks.sglang.drain import DrainWatch
from engine_hooks.spool import SpoolWriter
from engine_hooks.watch import KVWatch, Ticket, new_instance

logger = logging.getLogger("kvwatch.sglang")

#: Decode tickets kept per process at most (oldest dropped first): a request whose end we miss
#: must not grow memory without bound.
MAX_TICKETS = 65536


@dataclass(slots=True)
class Held:
    """A decode ticket and where its pages sit in the request's row of ``req_to_token``: the
    ticket's page ``i`` is the page of token ``start + i * page_size``. ``seal``: prefill's
    seal from the transfer's metadata row (``hooks_seal``), once it arrived."""

    watch: KVWatch
    ticket: Ticket
    start: int
    seal: Seal | None = None
    #: Why the transfer's seal cannot be checked here (a writer of another TP slice).
    skip: Skip | None = None


@dataclass(slots=True)
class Process:
    """What the scheduler tells us about this process, before its pool is built."""

    role: str = "unified"
    model: str = ""
    rank: int = 0
    version: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class Runtime:
    """The plugin's state in one process. Created by :func:`runtime`; reset by tests."""

    def __init__(self, settings: Settings, version: str) -> None:
        self.settings = settings
        self.context = Process(role=settings.role or "unified", version=version)
        self.watches: weakref.WeakKeyDictionary[Any, KVWatch] = weakref.WeakKeyDictionary()
        self.all_watches: list[KVWatch] = []
        #: Decode tickets by request instance (a request id is not an identity).
        self.tickets: OrderedDict[str, Held] = OrderedDict()
        self._instances: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self.hook_errors = 0
        #: Aborted transfers released on a timeout, watched for the requests that take them.
        self.drain = DrainWatch(settings.freed_watch_s)
        self._consensus: Consensus | None = None
        self._lock = threading.Lock()

    # -- watches -------------------------------------------------------------------------------

    def new_watch(self, pool: PagedKVPool | None) -> KVWatch:
        ctx = self.context
        spool = SpoolWriter(
            self.settings.spool,
            engine="sglang",
            role=ctx.role,
            model=ctx.model,
            engine_version=ctx.version,
            rank=ctx.rank,
        )
        # Extra identity fields ride on the hello record (the schema checks only its own keys).
        spool.identity.update({k: v for k, v in ctx.extra.items() if k not in spool.identity})
        watch = KVWatch(
            pool,
            role=ctx.role,
            engine="sglang",
            engine_version=ctx.version,
            model=ctx.model,
            rank=ctx.rank,
            mode=self.settings.modes(),
            spool=spool,
            flush_interval=self.settings.flush_interval,
            scrub=self.settings.scrub,
            config_errors=self.settings.config_errors,
        )
        with self._lock:
            self.all_watches.append(watch)
        return watch

    def watch_for(self, allocator: Any) -> KVWatch | None:
        return self.watches.get(allocator)

    def engine_watch(self) -> KVWatch:
        """The watch that admission and harvested engine detectors report through."""
        if self.all_watches:
            return self.all_watches[0]
        return self.new_watch(None)  # joins all_watches: later calls reuse it

    # -- request instances and decode tickets --------------------------------------------------

    @property
    def consensus(self) -> Consensus:
        """This scheduler's attention-TP group (consensus.py), resolved when a request first
        needs it: SGLang builds its groups before it admits any request."""
        if self._consensus is None:
            self._consensus = Consensus.resolve()
        return self._consensus

    def instance_of(self, req: Any) -> str:
        """The instance id of SGLang's ``Req`` object, minted when the hooks first see it (at a
        door or at decode's reserve); a retracted request that comes back keeps it. At TP > 1
        every rank's plugin names it alike (from the request's bootstrap room, which the router
        drew for it): the findings of all ranks on one request are one incident."""
        instance = self._instances.get(req)
        if instance is None:
            room = getattr(req, "bootstrap_room", None)
            if self.consensus.active and isinstance(room, int):
                instance = f"room-{room & (1 << 64) - 1:x}"
            else:
                instance = new_instance()
            self._instances[req] = instance
        return instance

    def keep_ticket(self, watch: KVWatch, ticket: Ticket, start: int = 0) -> None:
        with self._lock:
            self.tickets[ticket.instance] = Held(watch, ticket, start)
            self.tickets.move_to_end(ticket.instance)
            while len(self.tickets) > MAX_TICKETS:
                self.tickets.popitem(last=False)

    def ticket(self, req: Any) -> Held | None:
        instance = self._instances.get(req)
        return None if instance is None else self.tickets.get(instance)

    def drop_ticket(self, req: Any) -> None:
        instance = self._instances.get(req)
        if instance is not None:
            with self._lock:
                self.tickets.pop(instance, None)

    def close(self) -> None:
        self.drain.close()  # the open windows' findings, while the spools are open
        for watch in list(self.all_watches):
            watch.close()


_RUNTIME: Runtime | None = None


def runtime() -> Runtime:
    global _RUNTIME
    if _RUNTIME is None:
        from engine_hooks.sglang.compat import sglang_version

        _RUNTIME = Runtime(from_env(), sglang_version())
    return _RUNTIME


def reset(settings: Settings | None = None, version: str | None = None) -> Runtime:
    """Start over with fresh state (tests; a forked process). Closes the old watches."""
    global _RUNTIME
    if _RUNTIME is not None:
        _RUNTIME.close()
    from engine_hooks.sglang.compat import sglang_version

    _RUNTIME = Runtime(settings or from_env(), version or sglang_version())
    return _RUNTIME


# -- describing SGLang's pools to the hooks --------------------------------------------------


def describe_pool(kvcache: Any, page_size: int) -> tuple[PagedKVPool | None, Skip | None]:
    """The allocator's KV cache as a :class:`PagedKVPool`, or ``(None, reason)``.

    MHA (``MHATokenToKVPool``: ``k_buffer`` then ``v_buffer``, one ``[slots, heads, dim]`` tensor
    per layer) and MLA (``MLATokenToKVPool``: ``kv_buffer``, ``[slots, 1, dim]`` per layer) in the
    default token-major layout. fp8 pools store uint8; ``dtype`` is the logical type.
    """
    layout = getattr(kvcache, "kv_cache_layout", "nhd")
    if getattr(kvcache, "use_hnd", False) or layout not in ("nhd", None):
        return None, Skip.UNSUPPORTED_LAYOUT
    buffers: list[torch.Tensor] | None = None
    k, v = getattr(kvcache, "k_buffer", None), getattr(kvcache, "v_buffer", None)
    if isinstance(k, list | tuple) and isinstance(v, list | tuple) and k:
        buffers = [*k, *v]
    else:
        kv = getattr(kvcache, "kv_buffer", None)
        if isinstance(kv, list | tuple) and kv:
            buffers = list(kv)
    if not buffers or not all(isinstance(b, torch.Tensor) for b in buffers):
        return None, Skip.UNSUPPORTED_LAYOUT
    kv_dtype = getattr(kvcache, "dtype", None)
    if not isinstance(kv_dtype, torch.dtype) or buffers[0].dtype != torch.uint8:
        kv_dtype = None
    try:
        return PagedKVPool(buffers, page_size, layout=Layout.TOKENS, kv_dtype=kv_dtype), None
    except (ValueError, RuntimeError, TypeError):
        return None, Skip.UNSUPPORTED_LAYOUT
