"""What else turns up in a spool directory, for the fuzz test and the hostile-spool test."""

from __future__ import annotations

import os
from pathlib import Path

JUNK_KINDS = ("fifo", "dir", "empty", "badname", "symlink", "private")


def add_junk(spool: Path, kinds: list[str]) -> None:
    """FIFOs, directories, zero-length files, bad names, symbolic links and abandoned private
    files: none of it may block or stop the reader."""
    for n, kind in enumerate(kinds):
        name = f"junk{n}-decode-r0-1-0000000{n}.000000.kvs"
        if kind == "fifo":
            os.mkfifo(spool / name)
        elif kind == "dir":
            (spool / name).mkdir()
        elif kind == "empty":
            (spool / name).write_bytes(b"")
        elif kind == "badname":
            (spool / f"bad name {n}.kvs").write_bytes(b"KVWR")
        elif kind == "symlink":
            (spool / name).symlink_to("/etc/hostname")
        else:
            (spool / f".{name}.new").write_bytes(b"")
