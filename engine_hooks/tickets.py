"""Requests as the hooks know them: instance ids, small integer keys, decode tickets.

A request id is not an identity (clients reuse them): each admission of a request is an
*instance* (:func:`new_instance`), and the per-page holder record names instances by small
integer keys (:class:`RequestKeys`, no content). A :class:`Ticket` is a request's claim on
decode pages, which every decode step's batch check reads.
"""

from __future__ import annotations

import itertools
import secrets
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine_hooks.pagestate import UNKNOWN, Ints

# Requests remembered as page holders (see RequestKeys): a page whose holder was forgotten
# has an unattributed source.
_REQUEST_KEYS = 1 << 16


class RequestKeys:
    """Request instances as small integer keys for the per-page holder record (no content).

    Keys count up from 1 and are never reused; the table keeps the ``limit`` most recently
    used, so a page whose holder was forgotten is unattributed, never misattributed."""

    def __init__(self, limit: int = _REQUEST_KEYS) -> None:
        self.limit = limit
        self._next = 1
        self._by_key: OrderedDict[int, tuple[str, str]] = OrderedDict()
        self._by_request: dict[tuple[str, str], int] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def key(self, request_id: str, instance: str = "") -> int:
        """The key of a request instance (``UNKNOWN`` for an anonymous one)."""
        if not request_id and not instance:
            return UNKNOWN
        ident = (request_id[:128], instance[:128])
        key = self._by_request.get(ident)
        if key is not None and key in self._by_key:
            self._by_key.move_to_end(key)
            return key
        key, self._next = self._next, self._next + 1
        self._by_key[key] = ident
        self._by_request[ident] = key
        while len(self._by_key) > self.limit:
            old, old_ident = self._by_key.popitem(last=False)
            if self._by_request.get(old_ident) == old:
                del self._by_request[old_ident]
        return key

    def get(self, key: int) -> tuple[str, str] | None:
        """(request id, instance) of a key, or None if forgotten or not a request's."""
        return self._by_key.get(key)


# Request instances: a random per-process prefix and a counter (unique without coordination).
_INSTANCE_PREFIX = secrets.token_hex(4)
_INSTANCE_COUNTER = itertools.count(1)


def new_instance() -> str:
    """A fresh request instance id: one admission of a request. A request id is not an
    identity (clients reuse them); events are keyed by the instance, the id stays a field."""
    return f"{_INSTANCE_PREFIX}-{next(_INSTANCE_COUNTER):x}"


@dataclass(slots=True)
class Ticket:
    """A request's claim on decode pages: the page ids and their generations when reserved."""

    request_id: str
    pages: Ints
    tags: Ints
    instance: str = ""
    # The same as one [2, n] tensor (page ids; tags), reused by every decode step's batch
    # check: a view of a buffer with room to grow, which ``extend`` appends to in place on
    # the host (through a numpy view) and which is rebuilt when full or on a device.
    # (Not constructor arguments: public fields may follow without shifting positions.)
    _stacked: torch.Tensor | None = field(default=None, init=False, repr=False)
    _buffer: torch.Tensor | None = field(default=None, init=False, repr=False)
    _host: np.ndarray | None = field(default=None, init=False, repr=False)
    _host_stacked: np.ndarray | None = field(default=None, init=False, repr=False)
    _count: int = field(default=0, init=False, repr=False)

    @property
    def page_count(self) -> int:
        return len(self.pages)

    def stacked(self, device: torch.device) -> torch.Tensor:
        if self._stacked is None:
            n = len(self.pages)
            buffer = torch.empty((2, n + n // 2 + 8), dtype=torch.int64, device=device)
            buffer[0, :n] = _int64(self.pages, device)
            buffer[1, :n] = _int64(self.tags, device)
            self._buffer, self._count = buffer, n
            self._host = buffer.numpy() if buffer.device.type == "cpu" else None
            self._stacked = buffer[:, :n]
            self._host_stacked = None if self._host is None else self._host[:, :n]
        return self._stacked

    def repoint(self, pages: Ints, tags: Ints) -> None:
        """The request's row now names other pages (a radix-cache dedup re-pointed it): the
        ticket follows, and its cached tensors are rebuilt at the next step."""
        self.pages, self.tags = pages, tags
        self._stacked = self._buffer = self._host = self._host_stacked = None

    def host_stacked(self) -> np.ndarray:
        """:meth:`stacked` of a host pool as a numpy view (numpy joins many small arrays in
        half the time of ``torch.cat``)."""
        if self._host_stacked is None:
            self.stacked(torch.device("cpu"))
        assert self._host_stacked is not None
        return self._host_stacked

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        stacked = self.stacked(device)
        return stacked[0], stacked[1]

    def _append(self, pages: Ints, tags: Ints) -> None:
        """``extend`` added these pages to ``self.pages`` and ``self.tags``."""
        start, end = self._count, self._count + len(pages)
        host = self._host
        if host is None or self._buffer is None or end > host.shape[1]:
            self._stacked = self._buffer = self._host = self._host_stacked = None  # rebuilt
            return
        if end == start + 1 and isinstance(pages, list) and isinstance(tags, list):
            host[0, start], host[1, start] = pages[0], tags[0]  # one decode page: no slicing
        else:
            host[0, start:end] = pages
            host[1, start:end] = tags
        self._count = end
        self._stacked = self._buffer[:, :end]
        self._host_stacked = host[:, :end]


def owners_of(tickets: Sequence[Ticket]) -> list[tuple[str, int]]:
    return [(t.request_id, t.page_count) for t in tickets]


def instances_of(tickets: Sequence[Ticket]) -> tuple[str, ...]:
    return tuple(t.instance for t in tickets)


def _int64(values: Ints, device: torch.device) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=torch.int64)
    # Through numpy: torch.tensor(list) is far slower per element (docs/performance.md).
    return torch.from_numpy(np.asarray(values, dtype=np.int64)).to(device)
