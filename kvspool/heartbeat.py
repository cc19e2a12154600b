"""The daemon's heartbeat in the spool folder: how the hooks tell that a daemon reads it.

The daemon touches :data:`HEARTBEAT_NAME` in the folder it reads, at most every
:data:`BEAT_SECONDS` while it polls; a writer whose folder has no heartbeat, or one older than
:data:`STALE_SECONDS`, says so in the engine's log (once, and again when a daemon is back): a
misspelt ``KVWATCH_SPOOL``, or a daemon that is down, must not look like a working install.
The file holds nothing but the daemon's pid; its mtime is the beat. Not a ``*.kvs`` name, so no
reader takes it for a segment.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Final

HEARTBEAT_NAME: Final = "kvwatch-daemon.heartbeat"
#: How often the daemon refreshes it (at most), and the age from which a writer warns.
BEAT_SECONDS: Final = 5.0
STALE_SECONDS: Final = 60.0


def beat(directory: str | os.PathLike[str]) -> None:
    """Refresh the heartbeat (the daemon's side). Raises OSError when it cannot."""
    path = Path(directory) / HEARTBEAT_NAME
    try:
        os.utime(path)
    except FileNotFoundError:
        # Readable by the spool's group (the engines); replaced whole, never half written.
        tmp = path.with_name(f".{HEARTBEAT_NAME}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o640)
        try:
            os.write(fd, f"{os.getpid()}\n".encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)


def age(directory: str | os.PathLike[str], now: float | None = None) -> float | None:
    """Seconds since the daemon's last beat in ``directory``; None when it never beat there."""
    try:
        mtime = os.stat(Path(directory) / HEARTBEAT_NAME).st_mtime
    except OSError:
        return None
    return max(0.0, (time.time() if now is None else now) - mtime)
