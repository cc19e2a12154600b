"""``kvwatch daemon``: the spool reader, log watcher and /metrics, in one boring process.

One thread polls (spool, then logs, then retention); the HTTP server answers scrapes from its own
thread, reading the shared state under its lock. SIGTERM or SIGINT stops the loop after the batch
in hand is committed. SIGHUP reloads the configuration (:data:`RELOADABLE`: the retention, the
poll timings, the engine logs, the fast path to the pager); a change to another setting (the
spool, the journal, the listen address, TLS, ...) is logged as waiting for a restart, and a file
that does not load is logged and refused, the daemon running on as it was
(``kvwatch_config_last_reload_successful``).

One daemon per journal and per spool: each is locked (``flock``) for the daemon's lifetime, since
two daemons on one spool would record every incident twice.

About 450 lines, in one module on purpose: it is the topology, and every edge from the sources
through the store to the outputs shows here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, Final

import structlog
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from kvspool import heartbeat
from kvwatch import __version__, errors
from kvwatch.alerting.evaluate import Evaluator
from kvwatch.alerting.notify import Notifier
from kvwatch.config import Config, ConfigError, parse_listen
from kvwatch.expose.http import make_app, serve_wsgi
from kvwatch.expose.metrics import KvwatchCollector
from kvwatch.expose.status import AlarmSettings
from kvwatch.ingest.logs.watch import LogWatcher
from kvwatch.ingest.nvml import Nvml
from kvwatch.ingest.spool.reader import SpoolReader
from kvwatch.store.incidents_log import IncidentsLog
from kvwatch.store.journal import MAX_RETIRED_PRODUCERS, Journal, JournalError

#: How often old journal rows are pruned.
PRUNE_SECONDS: Final = 600.0
#: ... and how often while more producers are kept than the journal's MAX_RETIRED_PRODUCERS.
CROWDED_PRUNE_SECONDS: Final = 60.0
MAX_BACKOFF: Final = 5.0
#: The settings that decide where alerts go and how: a change rebuilds the fast path's notifier
#: and evaluator (every Alertmanager's send loop, anew).
_PAGER_SETTINGS: Final = frozenset(
    {"alertmanager_urls", "alertmanager_enabled", "alertmanager_labels", "alertmanager_timeout"}
    | {"alertmanager_resend", "prometheus_scrape_interval", "alertmanager_ca_file"}
    | {"alertmanager_username", "alertmanager_password_file"}
)
#: What a reload (SIGHUP) applies; a change to any other setting waits for a restart.
RELOADABLE: Final = _PAGER_SETTINGS | {
    "retention", "records_retention", "poll_interval", "idle_grace", "logs",
}  # fmt: skip
# Each a Config field: a misspelt name here would never apply, silently.
assert not RELOADABLE - {f.name for f in dataclasses.fields(Config)}, RELOADABLE


class DaemonError(Exception):
    """The daemon cannot start; the message names the file or setting at fault."""


def _missing(path: Path) -> list[Path]:
    """``path`` and its folders that do not exist yet, innermost first ([] when it exists)."""
    out: list[Path] = []
    path = path.absolute()
    while not path.exists() and path != path.parent:
        out.append(path)
        path = path.parent
    return out


def _flock(fd: int, what: str, path: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DaemonError(
            f"another kvwatch daemon is using the {what} {path}; stop it first "
            "(two daemons would record every incident twice)"
        ) from None


def _make_folder(setting: str, path: str) -> None:
    """Create the folder of the file at ``path`` (the ``setting``'s), or a one-line error."""
    folder = Path(path).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise DaemonError(f"{setting} {path}: {folder} exists and is not a folder") from None
    except OSError as exc:
        raise DaemonError(
            f"{setting} {path}: cannot create {folder}: {errors.reason(exc)}"
        ) from None


def lock_journal(path: str) -> int:
    """Create the journal's folder and file if needed and hold an exclusive lock on the file.

    ``flock`` and SQLite's own POSIX locks do not interact on Linux: readers (``kvwatch
    incidents``, the status page) are not blocked.
    """
    journal = Path(path)
    if journal.is_dir():
        raise DaemonError(f"journal {path} is a directory; give a file, e.g. {path}/journal.db")
    _make_folder("journal", path)
    try:
        fd = os.open(journal, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
    except OSError as exc:
        raise DaemonError(f"cannot open the journal {path}: {errors.reason(exc)}") from None
    _flock(fd, "journal", path)
    return fd


def check_incidents_log(path: str) -> None:
    """Refuse to start on an incidents log that cannot be appended to (its folder created if
    missing, as the journal's): found now, not as an error on every poll."""
    log = Path(path)
    if log.is_dir():
        raise DaemonError(f"incidents_log {path} is a directory; give a file")
    _make_folder("incidents_log", path)
    existed = log.exists()
    try:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
    except OSError as exc:
        raise DaemonError(f"cannot open the incidents log {path}: {errors.reason(exc)}") from None
    os.close(fd)
    if not existed:  # the log appears with its first incident
        with contextlib.suppress(OSError):
            log.unlink()


#: While the incidents log cannot be written, its error is logged again at most this often
#: (seconds), or when its reason changes: kvwatch_collector_success says so on every poll.
WRITE_FAILED_EVERY: Final = 60.0


def lock_spool(path: str) -> int | None:
    """An exclusive lock on the spool folder; None while the folder does not exist yet."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise DaemonError(f"spool_dir {path} is a file, not a folder") from None
    except OSError as exc:
        raise DaemonError(f"cannot open the spool folder {path}: {errors.reason(exc)}") from None
    _flock(fd, "spool folder", path)
    return fd


class Daemon:
    def __init__(self, config: Config, load: Callable[[], Config] | None = None) -> None:
        """``load``: how to read the configuration again on SIGHUP (the file and the flags, as
        at start); None: a reload says it cannot."""
        self.config, self._load = config, load
        self.log = structlog.get_logger("kvwatch.daemon")
        self._locks: list[int] = []
        self._spool_lock: int | None = None
        #: The journal file and folders this start creates: removed again if it fails, so that
        #: no empty journal is left for ``kvwatch incidents`` to stumble on.
        self._created = _missing(Path(config.journal))
        try:
            self._locks.append(lock_journal(config.journal))
            self._spool_lock = lock_spool(config.spool_dir)
            if config.incidents_log_path:
                check_incidents_log(config.incidents_log_path)
            try:
                self.journal = Journal(config.journal)
                self.state = self.journal.load()
            except JournalError as exc:
                raise DaemonError(str(exc)) from None  # it names the journal
            except (sqlite3.Error, OSError) as exc:
                raise DaemonError(f"journal {config.journal}: {errors.reason(exc)}") from None
        except BaseException:
            self._unlock()
            self._remove_created()
            raise
        log_path = config.incidents_log_path
        self.incidents_log = log_path and IncidentsLog(
            log_path, max_bytes=config.incidents_log_max_bytes, keep=config.incidents_log_keep
        )
        # spool -> journal; what each commit stored -> the incidents log (drained each round).
        self.reader = SpoolReader(
            config.spool_dir,
            self.journal,
            self.state,
            allowed_uids=config.uids(),
            idle_grace=config.idle_grace,
            quarantine_dir=config.quarantine,
            quarantine_max=config.quarantine_max,
            node=config.node_name,
            on_stored=self.incidents_log.committed if self.incidents_log else None,
        )
        self.logs = LogWatcher(config.logs, self.state)
        if self.incidents_log:
            # Where the log stands, before the first poll stores incidents (ids may be reused).
            try:
                self.incidents_log.recover(self.journal)
            except (OSError, sqlite3.Error) as exc:
                self.log.error(
                    "incidents_log.recover_failed", path=log_path, error=errors.reason(exc)
                )
        try:
            self._outputs(config)
        except ConfigError as exc:
            self.journal.close()
            self._unlock()
            self._remove_created()
            raise DaemonError(str(exc)) from None
        self.stop = threading.Event()
        #: Set once the journal is open and the first poll is committed (``/-/ready``).
        self.ready = threading.Event()
        self._spool_missing = False
        self._exit_code = 0
        #: The incidents log's write failure being reported (its reason), and when last logged.
        self._log_failure: tuple[str, float] | None = None
        self._signals: list[str] = []
        self.server: Any = None
        self._next_prune = 0.0
        self._last_prune = 0.0
        self._failures = 0
        self._next_beat, self._beat_warned = 0.0, False

    def _outputs(self, config: Config) -> None:
        """state + NVML (read at scrape time) -> the collector -> /metrics; the collector's
        state families -> the evaluator -> the notifier -> every Alertmanager (the fast path)."""
        self.notifier = Notifier(config, self.state)  # first: a bad CA file fails the start
        self.nvml = Nvml(config.nvml)
        self._collector = KvwatchCollector(self.state, self.nvml)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self._collector)
        self.evaluator = Evaluator(
            config, self.state, self._collector.state_families, self.notifier.send
        )
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)

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
        app = make_app(
            make_wsgi_app(self.registry),
            self.state,
            self.config.journal,
            self.ready.is_set,
            settings=AlarmSettings(self.config.alarm_window, self.config.alarm_until_ack),
            node=self.config.node_name,
        )
        self.server = serve_wsgi(host, port, app, tls)
        bound = self.server.server_address
        return str(bound[0]), int(bound[1])

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        signal.signal(signal.SIGHUP, self._on_sighup)
        try:
            host, port = self.serve()
        except OSError as exc:
            self.log.error(
                "daemon.listen_failed", listen=self.config.listen, error=errors.reason(exc)
            )
            self.close()
            self._remove_created()
            return 1
        self._created = []  # started: the journal is this daemon's from now on
        self.state.config_reload_ts = time.time()
        self.log.info(
            "daemon.started",
            version=__version__,
            listen=f"{host}:{port}",
            tls=bool(self.config.tls_cert_file),
            spool_dir=self.config.spool_dir,
            journal=self.config.journal,
            incidents_log=self.config.incidents_log_path,
            logs=[log.path for log in self.config.logs],
            nvml=self.nvml.up,
        )
        if self.notifier.enabled:
            self.evaluator.start()
            self.notifier.start()
            self.log.info(
                "pager.started", alertmanagers=self.notifier.urls, node=self.config.node_name
            )
        try:
            while not self.stop.is_set():
                more = self.run_once()
                self._report_signals()
                if not more:
                    delay = self.config.poll_interval * (2 ** min(self._failures, 6))
                    self.stop.wait(min(delay, MAX_BACKOFF))
            self._report_signals()
        finally:
            self.close()
        self.log.info("daemon.stopped")
        return self._exit_code

    # The handlers only record the signal: logging from a handler could wait forever on the log
    # stream's lock, held by the same thread when a write to a full terminal or pipe blocks.

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._signals.append(signal.Signals(signum).name)
        # Not ``self.stop.set()`` here: the handler runs in the main thread, which may hold the
        # Event's lock (inside ``stop.wait``), and setting it would wait on that lock forever.
        threading.Thread(target=self.stop.set, name="kvwatch-stop", daemon=True).start()

    def _on_sighup(self, _signum: int, _frame: FrameType | None) -> None:
        self._signals.append("SIGHUP")

    def _report_signals(self) -> None:
        while self._signals:
            name = self._signals.pop(0)
            if name == "SIGHUP":
                self.reload()
            else:
                self.log.info("daemon.stopping", signal=name)

    def reload(self) -> bool:
        """Read the configuration again (the main thread, between polls) and apply what can be
        applied live; True when it did."""
        if self._load is None:
            self.log.warning("config.reload_unavailable", note="no config source to read again")
            return False
        try:
            new = self._load()
            changed = [
                f.name
                for f in dataclasses.fields(Config)
                if getattr(new, f.name) != getattr(self.config, f.name)
            ]
            if any(name in _PAGER_SETTINGS for name in changed):
                notifier = Notifier(new, self.state)  # first: a bad CA file refuses the reload
            else:
                notifier = None
        except ConfigError as exc:
            with self.state.lock:
                self.state.config_reload_ok = False
            self.log.error("config.reload_failed", error=str(exc), note="running as before")
            return False
        waiting = [name for name in changed if name not in RELOADABLE]
        applied = [name for name in changed if name in RELOADABLE]
        for name in applied:
            setattr(self.config, name, getattr(new, name))
        self.reader.idle_grace = self.config.idle_grace
        if "logs" in applied:
            self.logs.close()
            self.logs = LogWatcher(self.config.logs, self.state)
        if notifier is not None:
            self.evaluator.close()
            self.notifier.close()
            self.notifier = notifier
            self.evaluator = Evaluator(
                self.config, self.state, self._collector.state_families, self.notifier.send
            )
            if self.notifier.enabled:
                self.evaluator.start()
                self.notifier.start()
        with self.state.lock:
            self.state.config_reload_ok = True
            self.state.config_reload_ts = time.time()
        self.log.info("config.reloaded", applied=applied)
        if waiting:
            self.log.warning(
                "config.restart_needed",
                settings=waiting,
                note="these take effect when the daemon restarts",
            )
        return True

    def close(self) -> None:
        self.evaluator.close()
        self.notifier.close()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        self.logs.close()
        self.nvml.close()
        self.journal.close()
        self._unlock()

    def _remove_created(self) -> None:
        """Undo what a failed start created: the journal (with SQLite's side files), then the
        folders made for it, if still empty."""
        created, self._created = self._created, []
        if not created:
            return
        journal = created[0]
        for path in (journal, *(Path(f"{journal}{end}") for end in ("-wal", "-shm", "-journal"))):
            with contextlib.suppress(OSError):
                path.unlink()
        for folder in created[1:]:
            with contextlib.suppress(OSError):
                folder.rmdir()

    def _unlock(self) -> None:
        for fd in [*self._locks, self._spool_lock]:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._locks, self._spool_lock = [], None

    # -- one round ----------------------------------------------------------------------------

    def _beat(self) -> None:
        """Leave the heartbeat the hooks look for in the spool (kvspool.heartbeat); a failure
        is one warning, never a failed poll: reading matters more than being seen to."""
        now = time.monotonic()
        if now < self._next_beat:
            return
        self._next_beat = now + heartbeat.BEAT_SECONDS
        try:
            heartbeat.beat(self.config.spool_dir)
        except OSError as exc:
            if not self._beat_warned:
                self._beat_warned = True
                self.log.warning(
                    "spool.heartbeat_failed",
                    directory=self.config.spool_dir,
                    error=errors.reason(exc),
                    note="engines will log that no daemon reads this spool",
                )
        else:
            self._beat_warned = False

    def run_once(self) -> bool:
        """Poll the spool and the logs once; True when the spool has more to read at once."""
        more = False
        started = time.perf_counter()
        try:
            more = self.reader.poll().more
            ok = self._spool_present()
            if ok:
                self._beat()
            self._failures = 0
            self.ready.set()  # the journal is open and a poll has committed
            problem, journal_failing = "", False
            if not ok:
                problem = f"the spool folder {self.config.spool_dir} is missing or unreadable"
        except Exception as exc:
            ok = False
            self._failures += 1
            problem, journal_failing = errors.poll_failure(
                exc, self.config.journal, self.config.spool_dir
            )
            self.log.error(
                "spool.poll_failed",
                error=str(exc),
                error_type=type(exc).__name__,
                cause=problem,
            )
        with self.state.lock:
            self.state.poll_problem, self.state.journal_failing = problem, journal_failing
        self._done("spool", ok, started)
        self.evaluator.wake()
        if self.logs.watched:
            started = time.perf_counter()
            try:
                self.logs.poll()
                ok = self.logs.all_present()
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
                    records_retention=min(self.config.records_retention, self.config.retention),
                )
                ok = True
                if self.incidents_log:  # journal -> incidents log: ids below may come again
                    self.incidents_log.pruned(now - self.config.retention)
                if deleted:
                    self.log.info("journal.pruned", rows=deleted)
            except Exception as exc:
                ok = False
                self.log.error("journal.prune_failed", error=str(exc))
            self._done("journal", ok, started)
        if self.incidents_log:  # after a prune too, before the next poll reuses an id
            self._ship_incidents(self.incidents_log)
        return more

    def _ship_incidents(self, log: IncidentsLog) -> None:
        """Append what the journal committed to the incidents log (what is not written now is
        written on a later round: the journal keeps the mark)."""
        started = time.perf_counter()
        try:
            log.drain(self.journal)  # this thread's connection, as the reader's
            ok = True
        except (OSError, sqlite3.Error) as exc:
            ok = False
            reason, now = errors.reason(exc), time.monotonic()
            last = self._log_failure
            if last is None or last[0] != reason or now - last[1] >= WRITE_FAILED_EVERY:
                self.log.error("incidents_log.write_failed", path=str(log.path), error=reason)
                self._log_failure = (reason, now)
        else:
            if self._log_failure is not None:
                self.log.info("incidents_log.write_recovered", path=str(log.path))
                self._log_failure = None
        self._done("incidents_log", ok, started)

    def _spool_present(self) -> bool:
        """False (collector_success 0, a warning) while the spool folder is missing; takes the
        folder's lock when it appears, and stops the daemon if another one holds it."""
        if self._spool_lock is None:
            try:
                self._spool_lock = lock_spool(self.config.spool_dir)
            except DaemonError as exc:
                self.log.error("daemon.spool_taken", error=str(exc))
                self._exit_code = 1
                self.stop.set()
                return False
        present = self._spool_lock is not None and os.path.isdir(self.config.spool_dir)
        if not present and not self._spool_missing:
            self.log.warning(
                "spool.missing",
                spool_dir=self.config.spool_dir,
                message="no spool folder: nothing is being verified until the engines create it",
            )
        self._spool_missing = not present
        return present

    def _done(self, collector: str, ok: bool, started: float) -> None:
        with self.state.lock:
            self.state.collectors[collector] = (ok, time.perf_counter() - started)
