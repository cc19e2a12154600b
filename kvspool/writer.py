"""The spool writer: one append-only segment file per engine process, on tmpfs.

Torch-free, so that tests and tools run real producers without an engine.

One framed record per ``write()`` on an ``O_APPEND`` descriptor; every record has the producer
id and a sequence number. The writer never raises into the engine and never waits on the daemon:
a record it cannot write (spool full, disk error, oversize) is dropped, counted by reason, and
shows up at the daemon as a gap in the sequence. The active segment holds an exclusive ``flock``
so the daemon can tell a live producer from a dead one; a full segment is sealed with a final
record naming its successor.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Final

from kvspool import heartbeat, records
from kvspool.framing import SEGMENT_SUFFIX, encode_frame
from kvspool.schema import SchemaError, decode_payload, encode_payload

#: Where engines write and the daemon reads, unless configured otherwise.
DEFAULT_SPOOL_DIR: Final = "/run/kvwatch/spool"
#: The private name a segment has while its producer creates and locks it.
PRIVATE_SUFFIX: Final = ".new"
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
# After a failure to open a segment, wait this long before trying again.
_RETRY_SECONDS = 1.0
# How often a writer looks for the daemon's heartbeat (one stat).
_DAEMON_CHECK_SECONDS = 30.0
#: The engine's log (Python logging): told once when the spool cannot be written.
logger = logging.getLogger("kvwatch.spool")


class SpoolWriter:
    """Appends records for one producer (one engine process) to its spool segments."""

    def __init__(
        self,
        directory: str | os.PathLike[str] = DEFAULT_SPOOL_DIR,
        *,
        engine: str,
        role: str,
        model: str = "",
        engine_version: str = "",
        rank: int = 0,
        segment_bytes: int = 8 << 20,
        max_segments: int = 8,
    ) -> None:
        self.directory = Path(directory)
        self.segment_bytes = segment_bytes
        self.max_segments = max_segments
        self.identity: dict[str, Any] = {
            "engine": engine,
            "engine_version": engine_version,
            "role": role,
            "model": model[: records.MAX_STRING_CHARS],
            "rank": rank,
            "pid": os.getpid(),
            "node": socket.gethostname()[: records.MAX_STRING_CHARS],
        }
        tag = _UNSAFE.sub("_", f"{engine}-{role}-r{rank}")
        self.producer = f"{tag}-{os.getpid()}-{secrets.token_hex(4)}"
        self.dropped: Counter[str] = Counter()
        self.written = 0
        self._lock = threading.Lock()
        self._seq = 0
        self._segment_index = 0
        self._fd: int | None = None
        self._size = 0
        self._retry_at = 0.0
        self._retry_full = False
        self._next_check = 0.0
        self._closed = False
        #: The spool failure the engine's log was told of (until a segment opens again).
        self._warned = False
        self._told_invalid = False
        self._missing = False
        self._told_unread = False
        self._next_daemon_check = 0.0

    # -- public -------------------------------------------------------------------------------

    @property
    def seq(self) -> int:
        return self._seq

    @property
    def segment_path(self) -> Path:
        return self.directory / self._segment_name(self._segment_index)

    def write(self, record_type: str, fields: dict[str, Any]) -> bool:
        """Append one record; True if it reached the spool. Never raises."""
        try:
            with self._lock:
                return self._write_locked(record_type, fields)
        except Exception:  # the engine must never see a spool failure
            self.dropped["write_error"] += 1
            return False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._close_fd()

    # -- internals ----------------------------------------------------------------------------

    def _segment_name(self, index: int) -> str:
        return f"{self.producer}.{index:06d}{SEGMENT_SUFFIX}"

    def _payload(self, record_type: str, fields: dict[str, Any], seq: int) -> bytes:
        record = {
            "v": records.SCHEMA_VERSION,
            "type": record_type,
            "producer": self.producer,
            **fields,
            "seq": seq,
            "ts": time.time(),
        }
        return encode_payload(record)

    def _frame(self, record_type: str, fields: dict[str, Any]) -> bytes:
        self._seq += 1
        return encode_frame(self._payload(record_type, fields, self._seq))

    def _checked(self, record_type: str, fields: dict[str, Any]) -> bytes | None:
        """The record's payload, numbered ``seq + 1``; None (counted ``invalid``, told once;
        ``oversize``) for one the daemon's reader would reject: one the schema refuses, or a
        hello or seal, which only the writer itself writes where they belong. A refused record
        takes no sequence number: refused here, not lost there."""
        why = ""
        if record_type in (records.HELLO, records.NEXT_SEGMENT):
            why = f"a {record_type} record is the writer's own"
        else:
            try:
                payload = self._payload(record_type, fields, self._seq + 1)
                if len(payload) > records.MAX_RECORD_BYTES:
                    self.dropped["oversize"] += 1
                    return None
                decode_payload(payload)
                return payload
            except SchemaError as exc:
                why = str(exc)
            except (TypeError, ValueError, OverflowError) as exc:
                why = f"not encodable: {exc}"
        self.dropped["invalid"] += 1
        if not self._told_invalid:
            self._told_invalid = True
            logger.error(
                "kvwatch: a %r record was refused (the daemon would reject it): %s; such"
                " records are dropped and counted (kvwatch_spool_dropped_records_total"
                '{reason="invalid"})',
                record_type[:32],
                why[:200],
            )
        return None

    def _write_locked(self, record_type: str, fields: dict[str, Any]) -> bool:
        if self._closed:
            self._seq += 1
            self.dropped["closed"] += 1
            return False
        payload = self._checked(record_type, fields)
        if payload is None:
            return False
        numbered = self._seq + 1
        if self._fd is not None and time.monotonic() >= self._next_check:
            self._check_segment_still_there()
            if time.monotonic() >= self._next_daemon_check:
                self._check_daemon()
        if self._fd is None and not self._open_segment():
            self._seq += 1  # the lost record leaves a gap the daemon counts
            return False
        if self._seq + 1 == numbered:  # no hello took its number: the checked payload as is
            self._seq = numbered
            frame = encode_frame(payload)
        else:
            frame = self._frame(record_type, fields)
        if self._size + len(frame) > self.segment_bytes:
            self._seq -= 1  # re-framed below, after the seal and the next segment's hello
            self._rotate()
            if not self._open_segment():
                self._seq += 1
                return False
            frame = self._frame(record_type, fields)
        return self._append(frame)

    def _append(self, frame: bytes) -> bool:
        assert self._fd is not None
        try:
            written = os.write(self._fd, frame)
        except OSError:
            self.dropped["write_error"] += 1
            self._close_fd()  # reopen a fresh segment later: the directory may be gone
            return False
        self._size += written
        if written != len(frame):  # ENOSPC mid-record: the reader sees a torn frame and resyncs
            self.dropped["write_error"] += 1
            return False
        self.written += 1
        return True

    def _check_segment_still_there(self) -> None:
        """A segment unlinked under us (spool directory removed) would swallow every record."""
        self._next_check = time.monotonic() + _RETRY_SECONDS
        assert self._fd is not None
        if os.fstat(self._fd).st_nlink == 0:
            self._close_fd()
            self._segment_index += 1

    def _rotate(self) -> None:
        next_name = self._segment_name(self._segment_index + 1)
        frame = self._frame(records.NEXT_SEGMENT, {"next_segment": next_name})
        self._append(frame)
        self._close_fd()
        self._segment_index += 1

    def _own_segments(self) -> int:
        prefix = self.producer + "."
        return sum(1 for name in os.listdir(self.directory) if name.startswith(prefix))

    def _open_segment(self) -> bool:
        now = time.monotonic()
        if now < self._retry_at:
            self.dropped[self._drop_reason()] += 1
            return False
        self._retry_full = self._missing = False
        try:
            # Never created here: a folder the daemon's install did not make is one no daemon
            # reads (a misspelt KVWATCH_SPOOL), and records written there would look delivered.
            if not self.directory.is_dir():
                self._missing = True
                raise FileNotFoundError(errno.ENOENT, "no such folder", str(self.directory))
            if self._own_segments() >= self.max_segments:
                self._retry_full = True
                raise OSError("spool full")
            # Each segment starts with who wrote it, so the daemon can label it on its own.
            hello = self._frame(records.HELLO, self.identity)
            try:
                fd = self._create_locked(self.segment_path, hello)
            except OSError:
                self._seq -= 1  # the hello never reached the spool: no gap for it
                raise
        except OSError as exc:
            self._retry_at = now + _RETRY_SECONDS
            self.dropped[self._drop_reason()] += 1
            if not self._retry_full:
                self._segment_index += 1  # never append to a file we did not create
            self._warn(exc)
            return False
        if self._warned:
            logger.warning("kvwatch: the spool %s is written again", self.directory)
            self._warned = False
        self._fd = fd
        self._size = len(hello)
        self.written += 1
        self._check_daemon()
        return True

    def _drop_reason(self) -> str:
        return "spool_full" if self._retry_full else "no_spool" if self._missing else "write_error"

    def _check_daemon(self) -> None:
        """Say once in the engine's log when no daemon has beaten in the folder lately (and
        once when one does again): records written there are not read."""
        self._next_daemon_check = time.monotonic() + _DAEMON_CHECK_SECONDS
        age = heartbeat.age(self.directory)
        unread = age is None or age > heartbeat.STALE_SECONDS
        if unread and not self._told_unread:
            self._told_unread = True
            since = "never" if age is None else f"last {age:,.0f}s ago"
            logger.warning(
                "kvwatch: no kvwatch daemon reads the spool %s (its heartbeat %s: %s). Records"
                " are kept there unread: start the daemon, or set KVWATCH_SPOOL to the folder it"
                " reads",
                self.directory,
                heartbeat.HEARTBEAT_NAME,
                since,
            )
        elif not unread and self._told_unread:
            self._told_unread = False
            logger.warning("kvwatch: a kvwatch daemon reads the spool %s again", self.directory)

    def _warn(self, exc: OSError) -> None:
        """One warning per failure, not per record: the drop counter counts each record."""
        if self._warned:
            return
        self._warned = True
        if self._retry_full:
            why = f"{self.max_segments} segments of this process unread (is the daemon running?)"
        elif self._missing:
            why = (
                "the folder does not exist. The hooks never create it: the kvwatch daemon's"
                " install does (the unit's RuntimeDirectory; without systemd, `kvwatch init`);"
                " is KVWATCH_SPOOL the daemon's spool_dir?"
            )
        else:
            why = f"{exc.strerror or exc}; set KVWATCH_SPOOL to a folder this user can write"
        logger.warning(
            "kvwatch: cannot write the spool %s: %s. Detection records are dropped and counted "
            "(kvwatch_spool_dropped_records_total) until it can be written",
            self.directory,
            why,
        )

    @staticmethod
    def _create_locked(path: Path, hello: bytes) -> int:
        """Create the segment under a private name, lock it, write its hello, then rename it
        into place: the daemon never sees a live segment without its lock (it would take it for
        abandoned), nor a segment without its hello (a kill between the two left one)."""
        private = path.with_name(f".{path.name}{PRIVATE_SUFFIX}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
        fd = os.open(private, flags, 0o640)
        try:
            _share_with_spool_group(fd, path.parent)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else knows the file yet
            if os.write(fd, hello) != len(hello):  # ENOSPC: try a whole segment again later
                raise OSError(errno.ENOSPC, "short write of the segment's hello")
            if path.exists():
                raise FileExistsError(path)
            os.rename(private, path)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(private)
            raise
        return fd

    def _close_fd(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # also releases the flock
            self._fd = None


def _share_with_spool_group(fd: int, directory: Path) -> None:
    """Give a new segment the spool folder's group, readable by it (mode 0640): the daemon
    reads the engines' segments through that group. A setgid folder (the unit's 2770) does it
    already; this covers a folder that is not setgid and an engine whose umask drops group
    read. Best effort: an engine outside the group keeps its own, and the daemon says so."""
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o640)
        gid = os.stat(directory).st_gid
        if os.fstat(fd).st_gid != gid:
            os.fchown(fd, -1, gid)  # allowed to the file's owner when it is in that group
