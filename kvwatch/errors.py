"""Why something failed, in the one line that the daemon logs and the commands print."""

from __future__ import annotations

import errno
import os
import re
import sqlite3
from typing import Final

_SSL_SOURCE: Final = re.compile(r"\s*\(_ssl\.c:\d+\)")


def reason(exc: BaseException) -> str:
    """``exc`` in one line: an ``OSError``'s own reason ("Permission denied"), else its text."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    # An SSLError made from one message (prometheus_client re-raises the certificate's error
    # so) prints as a tuple: "('Cannot load ...',)". The message, without OpenSSL's source line.
    args = exc.args
    text = args[0] if len(args) == 1 and isinstance(args[0], str) else str(exc)
    return " ".join(_SSL_SOURCE.sub("", text).split())


def poll_failure(exc: BaseException, journal: str, spool: str) -> tuple[str, bool]:
    """What failed a spool poll, naming the part (the journal, its disk, the spool), and whether
    it is the journal: records then wait in the spool (its offsets are not committed either),
    none is lost."""
    text = reason(exc)
    waiting = "records wait in the spool until it works again"
    filename = str(getattr(exc, "filename", "") or "")
    where = os.path.abspath(filename) if filename else ""
    on_journal = isinstance(exc, sqlite3.Error) or (
        bool(where) and where.startswith(os.path.dirname(os.path.abspath(journal)) + os.sep)
    )
    if on_journal or not where.startswith(os.path.abspath(spool)):
        full = "full" in text.lower() or getattr(exc, "errno", None) == errno.ENOSPC
        if full:
            folder = os.path.dirname(os.path.abspath(journal))
            return f"the journal's disk is full ({folder}, {text}): {waiting}", True
        if "readonly" in text.lower() or getattr(exc, "errno", None) == errno.EROFS:
            return f"the journal {journal} cannot be written ({text}): {waiting}", True
        if on_journal:
            return f"the journal {journal} fails ({text}): {waiting}", True
        return f"the spool poll failed ({type(exc).__name__}: {text})", False
    return f"the spool {spool} cannot be read ({filename}: {text})", False
