"""Why something failed, in the one line that the daemon logs and the commands print."""

from __future__ import annotations

import re
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
