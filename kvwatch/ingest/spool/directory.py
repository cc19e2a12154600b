"""The spool directory's hygiene: listing it (segment names, sizes, the lag), opening a segment
safely (no links, only regular files whose owner may write the spool), the segments left unread
(``ignored``, with the findings they hold), and what happens after a segment is read: removed,
or quarantined when it had rejects, abandoned private files removed, vanished segments and
producers with no segment left retired.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import stat
import time
from pathlib import Path
from typing import Final

from kvspool import SchemaError, decode_payload, iter_frames
from kvspool.framing import SEGMENT_SUFFIX
from kvspool.records import Event
from kvspool.writer import PRIVATE_SUFFIX
from kvwatch.ingest.spool.owner import Ignored, user_name
from kvwatch.ingest.spool.sink import BatchSink

SEGMENT_NAME: Final = re.compile(
    r"^([A-Za-z0-9_-]{1,200})\.([0-9]{1,12})" + re.escape(SEGMENT_SUFFIX) + "$"
)
_OPEN_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: How much of an ignored segment is read to count the findings in it (a segment is 8 MiB).
_IGNORED_SCAN_BYTES: Final = 64 << 20
#: A producer's private segment name, left behind when it was killed while creating one.
_PRIVATE_NAME: Final = re.compile(
    r"^\.[A-Za-z0-9_-]{1,200}\.[0-9]{1,12}" + re.escape(SEGMENT_SUFFIX + PRIVATE_SUFFIX) + "$"
)


class SpoolDirectory(BatchSink):
    """The directory's side of the reader (see the module)."""

    quarantine_dir: Path | None
    quarantine_max: int

    def _list(self) -> tuple[dict[str, list[tuple[int, str]]], dict[str, int]]:
        groups: dict[str, list[tuple[int, str]]] = {}
        sizes: dict[str, int] = {}
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            self._warn_once("missing", "spool.directory_missing", directory=str(self.directory))
            return groups, sizes
        for entry in entries:
            name = entry.name
            if name.endswith(PRIVATE_SUFFIX) and _PRIVATE_NAME.match(name):
                self._remove_abandoned(name)
                continue
            if not name.endswith(SEGMENT_SUFFIX):
                continue
            match = SEGMENT_NAME.match(name)
            if match is None:
                with self.state.lock:
                    self._reject_file(name, "name", "not <producer>.<index>.kvs")
                continue
            groups.setdefault(match.group(1), []).append((int(match.group(2)), name))
            with contextlib.suppress(OSError):
                sizes[name] = entry.stat(follow_symlinks=False).st_size
        return groups, sizes

    def _lag(self, sizes: dict[str, int]) -> int:
        lag = 0
        for name, size in sizes.items():
            segment = self.state.segments.get(name)
            if name in self._flagged:
                continue  # ignored files (wrong owner, not regular) are not lag
            if segment is None:
                lag += size
            elif not segment.finished:
                lag += max(0, size - segment.offset)
        return lag

    def _open(self, name: str) -> int | bool:
        """The segment's descriptor; else whether it is done with (True: gone, a link, or
        unreadable, and counted; False: try again next poll)."""
        try:
            return os.open(self.directory / name, _OPEN_FLAGS)
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                self._reject_file(name, "not_regular", "a symbolic link")
                return True
            self._warn_once("open:" + name, "spool.open_failed", segment=name, error=str(exc))
            if exc.errno in (errno.EACCES, errno.EPERM):
                self._ignore(name, "unreadable", None)
                return True  # not a live producer: nothing of it is verified
            return False

    def _trusted(self, name: str, fd: int, info: os.stat_result) -> bool:
        """Whether the open segment is a regular file its owner may write; if not, it is
        rejected (once) and ignored."""
        if not stat.S_ISREG(info.st_mode):
            self._reject_file(name, "not_regular", "not a regular file")
            return False
        if not self.owner_rule(info.st_uid):
            who = f"owned by {user_name(info.st_uid)} (uid {info.st_uid}), who may not write"
            self._reject_file(name, "owner", f"{who} the spool")
            self._ignore(name, "owner", fd)
            return False
        return True

    def _ignore(self, name: str, reason: str, fd: int | None) -> None:
        """Keep ``name`` in :attr:`State.ignored` with its owner and, when the daemon can read
        it (``fd``), the detection events it holds: findings the journal does not have."""
        try:
            info = os.fstat(fd) if fd is not None else os.lstat(self.directory / name)
        except OSError:
            return
        ignored = self.state.ignored.get(name)
        if ignored is None or ignored.reason != reason:
            ignored = Ignored(reason, info.st_uid, user_name(info.st_uid))
            self.state.ignored[name] = ignored
        if fd is None or ignored.size == info.st_size:
            return
        findings = 0
        data = os.pread(fd, min(info.st_size, _IGNORED_SCAN_BYTES), 0)
        for _offset, _end, payload, _error, _open in iter_frames(data, final=True):
            if payload is not None:
                with contextlib.suppress(SchemaError):
                    findings += type(decode_payload(payload)) is Event
        ignored.findings, ignored.size = findings, info.st_size

    def _retire(self, present_producers: set[str], present_segments: set[str]) -> None:
        now = time.time()
        for segment in self.state.segments.values():
            if segment.name not in present_segments and not segment.removed:
                if not segment.finished:
                    self.log.warning(
                        "spool.segment_vanished", segment=segment.name, offset=segment.offset
                    )
                segment.finished = segment.removed = True
                self._batch.segments[segment.name] = segment
        for producer in self.state.producers.values():
            if not producer.retired and producer.name not in present_producers:
                producer.retired = True
                producer.retired_at = now
                self._batch.producers[producer.name] = producer
                self.log.info("spool.producer_retired", producer=producer.name)

    def _remove_finished(self) -> None:
        for segment in self._to_remove:
            path = self.directory / segment.name
            try:
                if segment.rejects and self.quarantine_dir is not None:
                    self._quarantine(path)
                else:
                    path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._warn_once(
                    "unlink:" + segment.name,
                    "spool.remove_failed",
                    segment=segment.name,
                    error=str(exc),
                )
                continue
            segment.removed = True
            self._batch.segments[segment.name] = segment

    def _forget_removed(self) -> None:
        """A removed segment stays in the journal for the retention, not in memory (which would
        grow with every segment ever read). A file that comes back under a removed name is read
        as new: its records are rejected by their producer's sequence numbers and counted."""
        segments = self.state.segments
        for name in [name for name, segment in segments.items() if segment.removed]:
            del segments[name]

    def _quarantine(self, path: Path) -> None:
        assert self.quarantine_dir is not None
        self.quarantine_dir.mkdir(mode=0o700, exist_ok=True)
        # shutil.move copies and removes where a rename cannot (another filesystem: EXDEV).
        shutil.move(path, self.quarantine_dir / path.name)
        self.log.warning("spool.segment_quarantined", segment=path.name)
        kept = sorted(self.quarantine_dir.iterdir(), key=lambda p: p.stat().st_mtime)
        for old in kept[: max(0, len(kept) - self.quarantine_max)]:
            with contextlib.suppress(OSError):
                old.unlink()

    def _remove_abandoned(self, name: str) -> None:
        """A producer killed while creating a segment leaves its private file: remove it once
        nobody holds its lock and it has been idle for ``idle_grace`` (never the file of a
        producer creating one right now, which holds the lock)."""
        try:
            fd = os.open(self.directory / name, _OPEN_FLAGS)
        except OSError:
            return
        try:
            info = os.fstat(fd)
            if (
                not stat.S_ISREG(info.st_mode)
                or not self.owner_rule(info.st_uid)
                or locked(fd)
                or time.time() - info.st_mtime < self.idle_grace
            ):
                return
            with contextlib.suppress(OSError):
                os.unlink(self.directory / name)
                self.log.info("spool.abandoned_removed", file=name, bytes=info.st_size)
        finally:
            os.close(fd)


def locked(fd: int) -> bool:
    """True while a producer holds the segment's exclusive flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False
