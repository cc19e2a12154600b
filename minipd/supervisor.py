"""``minipd serve``: start the three processes, watch them, stop them all together.

The supervisor allocates decode's KV pool, its page-tag store and minipd's record of page
ownership (:class:`minipd.kvcache.PageOwners`) in shared memory and hands
them to decode (the owner) and prefill (the remote writer) when it starts them, as an RDMA
engine registers a memory region with its peer. It prints one ready line on stdout once the
router answers. On SIGTERM or Ctrl-C, or when any child dies, it stops every child; each child
also asks the kernel to SIGTERM it if the supervisor dies, so nothing is left behind.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from multiprocessing.context import ForkContext, SpawnContext
from multiprocessing.process import BaseProcess

import torch
import torch.multiprocessing

from minipd import decode, prefill, process, router
from minipd.config import ServeConfig
from minipd.kvcache import PoolShape, make_buffers, make_owners

_START_SECONDS = 180.0
_STOP_SECONDS = 10.0


def _collect(
    ready: queue.Queue[tuple[str, int]], names: set[str], children: list[BaseProcess]
) -> dict[str, int]:
    ports: dict[str, int] = {}
    deadline = time.monotonic() + _START_SECONDS
    while names - ports.keys():
        if time.monotonic() > deadline:
            raise RuntimeError("minipd: workers did not start in time")
        if any(c.exitcode is not None for c in children):
            raise RuntimeError("minipd: a worker exited during start-up")
        try:
            name, port = ready.get(timeout=0.2)
        except queue.Empty:
            continue
        ports[name] = port
    return ports


def _stop(children: list[BaseProcess]) -> None:
    for child in children:
        if child.is_alive() and child.pid is not None:
            os.kill(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_SECONDS
    for child in children:
        child.join(max(0.1, deadline - time.monotonic()))
    for child in children:
        if child.is_alive():
            child.kill()
            child.join(2)


def serve(cfg: ServeConfig) -> int:
    stop = process.stop_event()
    # Fork: the children inherit torch already imported (start-up in seconds, not tens of
    # seconds on a small runner) and the shared pool as it is mapped. Nothing here has started
    # a thread or an OpenMP pool yet, and every child keeps torch single-threaded.
    torch.set_num_threads(1)
    ctx: ForkContext | SpawnContext = (
        mp.get_context("fork") if cfg.device == "cpu" else mp.get_context("spawn")
    )
    device = torch.device(cfg.device)
    shape = PoolShape.for_tokens(cfg.decode_pool_tokens, cfg.page_size, cfg.layers, cfg.head_dim)
    buffers = make_buffers(shape, device, shared=True)
    tags = torch.zeros(shape.num_pages, dtype=torch.int64, device=device)
    if device.type == "cpu":
        tags.share_memory_()  # type: ignore[no-untyped-call]
    owners = make_owners(
        shape.slots, shared=True
    )  # minipd's own record of whose KV each page holds
    ready: queue.Queue[tuple[str, int]] = ctx.Queue()  # type: ignore[assignment]
    me = os.getpid()
    children: list[BaseProcess] = [
        ctx.Process(
            target=decode.main, args=(cfg, buffers, tags, owners, ready, me), name="minipd-decode"
        ),
        ctx.Process(
            target=prefill.main,
            args=(cfg, buffers, tags, owners, ready, me),
            name="minipd-prefill",
        ),
    ]
    try:
        for child in children:
            child.start()
        ports = _collect(ready, {"prefill", "decode"}, children)
        urls = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
        children.append(
            ctx.Process(
                target=router.main,
                args=(cfg, urls["prefill"], urls["decode"], ready, me),
                name="minipd-router",
            )
        )
        children[-1].start()
        port = _collect(ready, {"router"}, children)["router"]
        print(
            f"minipd ready http://{cfg.host}:{port} release={cfg.version} kvwatch={cfg.kvwatch} "
            f"prefill={urls['prefill']} decode={urls['decode']}",
            flush=True,
        )
        while not stop.wait(0.2):
            if any(c.exitcode is not None for c in children):
                print("minipd: a worker exited; stopping", file=sys.stderr, flush=True)
                return 1
        return 0
    except RuntimeError as exc:
        print(str(exc), file=sys.stderr, flush=True)
        return 1
    finally:
        _stop(children)
