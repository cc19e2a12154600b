"""The fast path's delivery: the alerts the evaluation hands over, posted to every Alertmanager.

As Prometheus's notifier: one send loop per configured Alertmanager (``POST /api/v2/alerts`` to
all of them, as Prometheus sends to every peer and the cluster deduplicates), each fed through its
own bounded queue, apart from the evaluation (:mod:`kvwatch.alerting.evaluate`), which never
waits on a post. When a queue is full the oldest batch is dropped; a batch older than
``MAX_BATCH_AGE`` is not sent. Every post is counted in
``kvwatch_alertmanager_posts_total{result}``.
"""

from __future__ import annotations

import base64
import json
import queue
import ssl
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Final

import structlog

from kvspool import catalogue
from kvwatch.config import Config, ConfigError
from kvwatch.store.state import State

#: Batches waiting per Alertmanager; beyond it the oldest is dropped (counted).
QUEUE_BATCHES: Final = 16
#: A batch older than this is not sent (the Alertmanager stalled): a firing alert re-sent late
#: could land after Prometheus resolved it and re-open it.
MAX_BATCH_AGE: Final = 30.0

PATH: Final = "/api/v2/alerts"

#: (time.monotonic() when queued, the alerts) for one Alertmanager.
_Batch = tuple[float, list[dict[str, Any]]]


class Notifier:
    """One send loop and bounded queue per Alertmanager of ``alertmanager_urls``."""

    def __init__(self, config: Config, state: State) -> None:
        self.log = structlog.get_logger("kvwatch.pager")
        self.state = state
        self.timeout = config.alertmanager_timeout
        self.urls = list(config.alertmanager_urls) if config.alertmanager_enabled else []
        self._headers = {"Content-Type": "application/json"}
        if config.alertmanager_username:
            password = _read_password(config.alertmanager_password_file)
            token = base64.b64encode(f"{config.alertmanager_username}:{password}".encode())
            self._headers["Authorization"] = "Basic " + token.decode()
        try:
            self._tls = ssl.create_default_context(cafile=config.alertmanager_ca_file or None)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            if isinstance(exc, ssl.SSLError):  # its reason, not a tuple and OpenSSL's source line
                reason = f"{exc.reason or exc} (not a PEM CA bundle)"
            else:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError(
                f"cannot load alertmanager_ca_file {config.alertmanager_ca_file}: {reason}"
            ) from None
        self._stop = threading.Event()
        self._queues = [queue.Queue[_Batch | None](QUEUE_BATCHES) for _ in self.urls]
        self._threads: list[threading.Thread] = []

    @property
    def enabled(self) -> bool:
        return bool(self.urls)

    def start(self) -> None:
        for url, batches in zip(self.urls, self._queues, strict=True):
            sender = threading.Thread(
                target=self._send_loop, args=(url, batches), name="kvwatch-pager-send", daemon=True
            )
            self._threads.append(sender)
            sender.start()

    def send(self, batch: list[dict[str, Any]]) -> None:
        """Queue ``batch`` for every Alertmanager (never blocks; a dropped batch is counted)."""
        for batches in self._queues:
            if _put_dropping_oldest(batches, (time.monotonic(), batch)):
                self._count("dropped")

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        for batches in self._queues:
            _put_dropping_oldest(batches, None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._threads = []

    def _send_loop(self, url: str, batches: queue.Queue[_Batch | None]) -> None:
        while True:
            item = batches.get()
            if item is None or self._stop.is_set():
                return
            queued, batch = item
            if time.monotonic() - queued > MAX_BATCH_AGE:
                self._count("dropped")
                continue
            try:
                self.post(url, batch)
            except (OSError, ValueError) as exc:  # URLError and timeouts are OSErrors
                self._count("failed")
                self.log.warning("pager.post_failed", alertmanager=url, error=_post_error(exc))
            else:
                self._count("sent")

    def post(self, url: str, alerts: list[dict[str, Any]]) -> None:
        request = urllib.request.Request(
            url + PATH, data=json.dumps(alerts).encode(), headers=self._headers, method="POST"
        )
        context = self._tls if url.startswith("https:") else None
        with urllib.request.urlopen(request, timeout=self.timeout, context=context) as reply:
            reply.read()

    def _count(self, result: str) -> None:
        key = (catalogue.DaemonCounter.ALERTMANAGER_POSTS, (catalogue.POST_RESULT.check(result),))
        with self.state.lock:
            self.state.daemon[key] += 1


def _put_dropping_oldest(batches: queue.Queue[Any], item: Any) -> bool:
    """Put ``item``; True when the oldest waiting batch was dropped to make room."""
    dropped = False
    while True:
        try:
            batches.put_nowait(item)
            return dropped
        except queue.Full:
            try:
                batches.get_nowait()
                dropped = True
            except queue.Empty:
                pass


def _post_error(exc: BaseException) -> str:
    """Why a post to Alertmanager failed: its HTTP status, the URL's error, else the text."""
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    return " ".join(str(exc).split()) or type(exc).__name__


def _read_password(path: str) -> str:
    if not path:
        raise ConfigError("alertmanager_username needs alertmanager_password_file")
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip()
    except OSError as exc:
        raise ConfigError(
            f"alertmanager_password_file {path}: cannot read it: {exc.strerror}"
        ) from None
