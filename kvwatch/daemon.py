"""``kvwatch daemon``: the spool reader, log watcher and /metrics, in one boring process.

One thread polls (spool, then logs, then retention); the HTTP server answers scrapes from its own
thread, reading the shared state under its lock. SIGTERM or SIGINT stops the loop after the batch
in hand is committed.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Any, Final

import structlog
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from kvwatch import __version__
from kvwatch.config import Config, parse_listen
from kvwatch.journal import MAX_RETIRED_PRODUCERS, Journal
from kvwatch.logwatch import LogWatcher
from kvwatch.metrics import KvwatchCollector
from kvwatch.nvml import Nvml
from kvwatch.spool_reader import SpoolReader
from kvwatch.statuspage import make_app, serve_wsgi

#: How often old journal rows are pruned.
PRUNE_SECONDS: Final = 600.0
#: ... and how often while more producers are kept than the journal's MAX_RETIRED_PRODUCERS.
CROWDED_PRUNE_SECONDS: Final = 60.0
MAX_BACKOFF: Final = 5.0


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.log = structlog.get_logger("kvwatch.daemon")
        self.journal = Journal(config.journal)
        self.state = self.journal.load()
        self.reader = SpoolReader(
            config.spool_dir,
            self.journal,
            self.state,
            allowed_uids=config.uids(),
            idle_grace=config.idle_grace,
            quarantine_dir=config.quarantine,
            quarantine_max=config.quarantine_max,
        )
        self.logs = LogWatcher(config.logs, self.state)
        self.nvml = Nvml(config.nvml)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(KvwatchCollector(self.state, self.nvml))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.stop = threading.Event()
        self.server: Any = None
        self._next_prune = 0.0
        self._last_prune = 0.0
        self._failures = 0

    # -- lifecycle ----------------------------------------------------------------------------

    def serve(self) -> tuple[str, int]:
        """Start the HTTP server; returns the address it bound (port 0 picks a free one)."""
        host, port = parse_listen(self.config.listen)
        tls: dict[str, Any] = {}
        if self.config.tls_cert_file:
            tls = {"certfile": self.config.tls_cert_file, "keyfile": self.config.tls_key_file}
            if self.config.tls_client_ca_file:
                tls["client_cafile"] = self.config.tls_client_ca_file
                tls["client_auth_required"] = True
        self.server = serve_wsgi(
            host, port, make_app(make_wsgi_app(self.registry), self.state, self.config.journal), tls
        )
        bound = self.server.server_address
        return str(bound[0]), int(bound[1])

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        try:
            host, port = self.serve()
        except OSError as exc:
            self.log.error("daemon.listen_failed", listen=self.config.listen, error=str(exc))
            self.close()
            return 2
        self.log.info(
            "daemon.started",
            version=__version__,
            listen=f"{host}:{port}",
            tls=bool(self.config.tls_cert_file),
            spool_dir=self.config.spool_dir,
            journal=self.config.journal,
            logs=[log.path for log in self.config.logs],
            nvml=self.nvml.up,
        )
        try:
            while not self.stop.is_set():
                more = self.run_once()
                if not more:
                    delay = self.config.poll_interval * (2 ** min(self._failures, 6))
                    self.stop.wait(min(delay, MAX_BACKOFF))
        finally:
            self.close()
        self.log.info("daemon.stopped")
        return 0

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.log.info("daemon.stopping", signal=signal.Signals(signum).name)
        self.stop.set()

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        self.logs.close()
        self.nvml.close()
        self.journal.close()

    # -- one round ----------------------------------------------------------------------------

    def run_once(self) -> bool:
        """Poll the spool and the logs once; True when the spool has more to read at once."""
        more = False
        started = time.perf_counter()
        try:
            more = self.reader.poll().more
            ok = True
            self._failures = 0
        except Exception as exc:
            ok = False
            self._failures += 1
            self.log.error("spool.poll_failed", error=str(exc), error_type=type(exc).__name__)
        self._done("spool", ok, started)
        if self.logs.watched:
            started = time.perf_counter()
            try:
                self.logs.poll()
                ok = True
            except Exception as exc:
                ok = False
                self.log.error("logs.poll_failed", error=str(exc), error_type=type(exc).__name__)
            self._done("logs", ok, started)
        now = time.time()
        # Many producers (engine restarts, or a writer minting ids): fold retired ones sooner.
        crowded = len(self.state.producers) > MAX_RETIRED_PRODUCERS
        if now >= self._next_prune or (crowded and now >= self._last_prune + CROWDED_PRUNE_SECONDS):
            self._next_prune = now + PRUNE_SECONDS
            self._last_prune = now
            started = time.perf_counter()
            try:
                deleted = self.journal.prune(
                    self.state,
                    now=now,
                    retention=self.config.retention,
                    records_retention=self.config.records_retention,
                )
                ok = True
                if deleted:
                    self.log.info("journal.pruned", rows=deleted)
            except Exception as exc:
                ok = False
                self.log.error("journal.prune_failed", error=str(exc))
            self._done("journal", ok, started)
        return more

    def _done(self, collector: str, ok: bool, started: float) -> None:
        with self.state.lock:
            self.state.collectors[collector] = (ok, time.perf_counter() - started)
