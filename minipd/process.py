"""What every minipd child process does: die with its parent, stop cleanly on a signal, and
serve its role's routes until told to stop (:func:`serve`)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
from collections.abc import Callable
from multiprocessing.queues import Queue
from types import FrameType
from typing import Protocol

from minipd import httpjson
from minipd.logs import setup

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGTERM us when the supervisor dies, so a ``kill -9`` leaves no orphan."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except OSError:
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def single_threaded_torch() -> None:
    """One intra-op thread per worker: three processes share the machine, and oversubscribed
    torch thread pools spin (a 30x slower decode step on a 2-core runner)."""
    import torch

    torch.set_num_threads(1)


def stop_event() -> threading.Event:
    """An event set by SIGTERM or SIGINT (Ctrl-C reaches the whole process group)."""
    stop = threading.Event()

    def handle(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    return stop


def wait(stop: threading.Event) -> None:
    while not stop.wait(0.2):
        pass


class Worker(Protocol):
    def routes(self) -> dict[tuple[str, str], httpjson.Route]: ...
    def close(self) -> None: ...


def serve(
    role: str,
    port: int,
    log_dir: str | None,
    ready: Queue[tuple[str, int]],
    parent_pid: int,
    worker: Callable[[logging.Logger], Worker],
) -> None:
    """A role's child process: ``worker(logger)`` built, its routes served on 127.0.0.1 at
    ``port`` (the bound port put on ``ready``) until SIGTERM or SIGINT, then closed."""
    die_with_parent(parent_pid)
    single_threaded_torch()
    stop = stop_event()
    running = worker(setup(role, log_dir))
    server = httpjson.JsonServer("127.0.0.1", port, running.routes())
    server.start()
    ready.put((role, server.port))
    wait(stop)
    server.stop()
    running.close()
