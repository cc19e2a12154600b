"""mark_landed: a transfer that carries no tags marks written exactly the pages it wrote."""

from __future__ import annotations

import random

import pytest
import torch

from engine_hooks import KVWatch, Mode
from engine_hooks.landed import mark_landed
from engine_hooks.pagestate import DevicePages
from tests.engine_hooks.harness import fill, make_pool


def watch(mode: str, device_backend: bool) -> KVWatch:
    w = KVWatch(make_pool("mha", torch.bfloat16, 12), role="decode", engine="minipd", mode=mode)
    assert w.pool is not None
    if device_backend:  # the accelerator backend, run on CPU tensors
        w.state = DevicePages(w.pool, kernel=False)
        w.tags = type(w.tags)(w.state, w.stats, Mode(mode)) if w.tags else None
        w.canary = type(w.canary)(w.pool, w.state, w.stats, Mode(mode)) if w.canary else None
    w.on_free(range(12))
    return w


@pytest.mark.parametrize("device_backend", [False, True], ids=["host", "device"])
def test_only_the_written_pages_are_marked(device_backend: bool) -> None:
    w = watch("log", device_backend)
    assert w.pool is not None and w.state is not None
    w.on_alloc([2, 3, 4, 5])
    ticket = w.on_reserve("reader", [2, 3, 4, 5])
    assert ticket is not None
    fill(w.pool, [2, 4], random.Random(1))  # the transfer wrote two of the four pages
    mark_landed(w, ticket)
    stale = [bool(b) for b in w.state.stale(ticket.pages, ticket.tags)]
    assert stale == [False, True, False, True]


@pytest.mark.parametrize("device_backend", [False, True], ids=["host", "device"])
def test_without_a_canary_every_page_counts_as_written(device_backend: bool) -> None:
    w = watch("off", device_backend)
    assert w.state is not None
    w.on_alloc([2, 3])
    ticket = w.on_reserve("reader", [2, 3])
    assert ticket is not None
    mark_landed(w, ticket)  # the canary cannot tell: the transfer is taken at its word
    assert [bool(b) for b in w.state.stale(ticket.pages, ticket.tags)] == [False, False]
