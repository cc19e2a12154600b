"""Who may own a spool segment, and what the daemon knows of the segments it ignores.

The rule: a segment is read when its owner is one of ``allowed_users`` (default: the daemon's
own user) or a member of the spool folder's group while that group may write the folder. The
unit creates ``/run/kvwatch/spool`` as ``kvwatch:kvwatch`` mode 2770 (setgid, so every segment
gets group ``kvwatch`` and the daemon can read it); the engines' user joins group ``kvwatch``.
Whoever the folder lets write is who may write records: a user outside both is ignored, and
loudly (:class:`Ignored`, ``kvwatch_spool_ignored_segments``, the status page).
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Final

#: Group membership is looked up again after this long (an engine user added to the group is
#: trusted without a daemon restart).
_REFRESH_SECONDS: Final = 60.0


def user_name(uid: int) -> str:
    """The user's name, or ``uid N`` where the passwd database has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid {gid}"


def in_group(uid: int, gid: int) -> bool:
    """``uid``'s primary group is ``gid``, or the group database lists it as a member."""
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return False  # no passwd entry: no group membership the daemon can check
    if user.pw_gid == gid:
        return True
    try:
        return user.pw_name in grp.getgrgid(gid).gr_mem
    except KeyError:
        return False


class OwnerRule:
    """``rule(uid)``: may a segment owned by ``uid`` be read from ``directory``?"""

    def __init__(self, directory: str | os.PathLike[str], allowed_uids: Collection[int]) -> None:
        self.directory = Path(directory)
        self.allowed_uids = frozenset(allowed_uids)
        self._members: dict[tuple[int, int], tuple[bool, float]] = {}

    def group(self) -> int | None:
        """The spool folder's gid when its group may write it, else None."""
        try:
            info = os.stat(self.directory)
        except OSError:
            return None
        return info.st_gid if info.st_mode & stat.S_IWGRP else None

    def __call__(self, uid: int, gid: int | None = None) -> bool:
        if uid in self.allowed_uids:
            return True
        gid = self.group() if gid is None else gid
        if gid is None:
            return False
        now = time.monotonic()
        cached = self._members.get((uid, gid))
        if cached is None or now - cached[1] >= _REFRESH_SECONDS:
            cached = (in_group(uid, gid), now)
            self._members[(uid, gid)] = cached
        return cached[0]

    def describe(self) -> str:
        """Who may write, for the status line: ``uid 0 (root), members of group kvwatch``."""
        users = ", ".join(f"{user_name(u)} ({u})" for u in sorted(self.allowed_uids))
        gid = self.group()
        return users + (f", members of group {group_name(gid)}" if gid is not None else "")


@dataclass(slots=True)
class Ignored:
    """A segment the daemon leaves unread while it is in the spool."""

    #: ``owner``: its owner may not write the spool; ``unreadable``: the daemon cannot open it.
    reason: str
    uid: int
    user: str
    #: Detection events in it (unknown for an unreadable segment: 0).
    findings: int = 0
    #: The size its findings were counted at (counted again when it grows).
    size: int = -1
