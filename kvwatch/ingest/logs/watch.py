"""Follow engine log files across rotation and feed their pool/context lines into the gauges.

For nodes where the hooks are not installed yet. A file is followed by path: when the path
names a new inode (rename rotation, as logrotate does by default) the old file is read to its end
first; when the file shrinks (``copytruncate``) reading starts again from the top. Lines that
cannot be read are counted by reason, never fatal.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from kvwatch.ingest.logs.parse import MAX_LINE_CHARS, LogParser
from kvwatch.store.state import EngineLogView, State

#: Bytes read per file per poll, so one huge log cannot stall the daemon.
READ_BYTES: Final = 4 << 20


@dataclass(frozen=True, slots=True)
class EngineLog:
    """A log file an engine writes, watched by the daemon (``[[logs]]``, ``--log``)."""

    path: str
    role: str = "other"
    engine: str = "auto"  # "sglang", "vllm" or "auto" (from the lines)
    model: str = ""


class LogFollower:
    """Yields complete lines of one file, followed by path."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.fd: int | None = None
        self.identity: tuple[int, int] | None = None
        self.offset = 0
        self.partial = b""
        self.skipping = False  # inside an over-long line: drop bytes until its newline
        self.errors: dict[str, int] = {}

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    def count(self, reason: str) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + 1

    def lines(self, budget: int = READ_BYTES) -> Iterator[bytes]:
        """The complete lines written since the last call (rotation and truncation handled)."""
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            info = None
        except OSError:
            self.count("read_error")
            info = None
        if self.fd is not None:
            current = os.fstat(self.fd)
            rotated = info is not None and (info.st_dev, info.st_ino) != self.identity
            if not rotated and current.st_size < self.offset:
                self.offset = 0  # truncated in place (copytruncate)
                self.partial = b""
                self.skipping = False
            yield from self._drain(budget)
            if rotated:
                if self.partial and not self.skipping:
                    yield self.partial  # the old file's unterminated last line
                self.partial = b""
                self.skipping = False
                self.close()
        if self.fd is None and info is not None:
            try:
                self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError:
                self.count("read_error")
                return
            opened = os.fstat(self.fd)
            self.identity = (opened.st_dev, opened.st_ino)
            self.offset = 0
            yield from self._drain(budget)

    def _drain(self, budget: int) -> Iterator[bytes]:
        assert self.fd is not None
        while budget > 0:
            try:
                data = os.pread(self.fd, min(budget, 1 << 20), self.offset)
            except OSError:
                self.count("read_error")
                return
            if not data:
                return
            budget -= len(data)
            self.offset += len(data)
            chunks = (self.partial + data).split(b"\n")
            self.partial = chunks.pop()
            for chunk in chunks:
                if self.skipping:
                    self.skipping = False
                    continue
                if len(chunk) > MAX_LINE_CHARS:
                    self.count("long_line")
                    continue
                yield chunk
            if len(self.partial) > MAX_LINE_CHARS:
                if not self.skipping:
                    self.count("long_line")
                self.skipping = True
                self.partial = b""


class LogWatcher:
    """Every engine log: a follower and a parser, feeding ``state.logs``."""

    def __init__(self, logs: list[EngineLog], state: State) -> None:
        self.state = state
        self.log = structlog.get_logger("kvwatch.logs")
        self.watched = [(log, LogFollower(log.path), LogParser(log.role)) for log in logs]
        self._reported: dict[str, int] = {}
        self._missing: set[str] = set()

    def all_present(self) -> bool:
        """Whether every watched file exists; a warning when one goes missing or comes back.

        A missing log is not fatal (the engine may start later, or rotate), but it is never
        silent: the daemon reports ``kvwatch_collector_success{collector="logs"} 0`` meanwhile.
        """
        missing = {log.path for log, _, _ in self.watched if not os.path.isfile(log.path)}
        for path in sorted(missing - self._missing):
            self.log.warning(
                "logs.missing", path=path, message="no such file; it will be read once it appears"
            )
        for path in sorted(self._missing - missing):
            self.log.info("logs.found", path=path)
        self._missing = missing
        return not missing

    def poll(self) -> int:
        """Read what is new in every log; returns the number of lines read."""
        total = 0
        for log, follower, parser in self.watched:
            changed: set[tuple[str | None, int]] = set()
            lines = 0
            for raw in follower.lines():
                lines += 1
                text = raw.decode("utf-8", errors="replace")
                if "\ufffd" in text:
                    follower.count("encoding")
                view = parser.feed(text)
                if view is not None:
                    changed.add((view.role, view.rank))
            total += lines
            with self.state.lock:
                self.state.log_counts[("lines", ())] += lines
                errors = dict(follower.errors)
                for reason, count in parser.errors.items():
                    errors[reason] = errors.get(reason, 0) + count
                for reason, count in errors.items():
                    key = f"{log.path}:{reason}"
                    delta = count - self._reported.get(key, 0)
                    if delta > 0:
                        self._reported[key] = count
                        self.state.log_counts[("errors", (reason,))] += delta
                        self.log.warning(
                            "logs.unreadable_lines", path=log.path, reason=reason, count=delta
                        )
                for changed_key in changed:
                    view = parser.views[changed_key]
                    role = view.role or log.role
                    engine = view.engine if log.engine == "auto" else log.engine
                    self.state.logs[f"{log.path}\x00{role}\x00{view.rank}"] = EngineLogView(
                        role=role,
                        engine=engine,
                        model=log.model or view.model or "",
                        rank=view.rank,
                        gauges=view.gauges(),
                        version=view.version or "",
                    )
                    self.log.info(
                        "logs.engine_config",
                        path=log.path,
                        role=role,
                        engine=engine,
                        rank=view.rank,
                        pool_tokens=view.pool_tokens,
                        context_length_tokens=view.context_length_tokens,
                        unsafe_band_tokens=view.band_tokens,
                    )
        return total

    def close(self) -> None:
        for _, follower, _ in self.watched:
            follower.close()
