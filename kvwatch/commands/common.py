"""What several commands share: the catalogue's choices, time ranges, the journal's path checks."""

from __future__ import annotations

import argparse
import grp
import os
import pwd
import stat
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvspool.catalogue import DETECTOR, KIND, OTHER, ROLE
from kvwatch import config as configuration

# What `incidents` filters on: the catalogue's names ("other" is no detector or kind of its own).
DETECTORS = tuple(v for v in DETECTOR.sorted_values if v != OTHER)
KINDS = tuple(v for v in KIND.sorted_values if v != OTHER)
ROLES = ROLE.sorted_values


def parse_since(text: str, now: float, *, option: str = "--since") -> float:
    """A Unix time from a duration back from now (``1h``) or a UTC date or time (ISO 8601)."""
    try:
        return now - configuration.parse_duration(text, setting=option)
    except configuration.ConfigError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise configuration.ConfigError(
            f"{option} {text!r}: expected a duration (1h, 7d) or a UTC time "
            "(2026-11-30 or 2026-11-30T14:00:00Z)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def choice(option: str, value: str | None, allowed: Sequence[str]) -> None:
    if value is not None and value not in allowed:
        raise configuration.ConfigError(
            f"{option}: unknown {option[2:]} {value!r}{configuration.did_you_mean(value, allowed)}"
        )


def time_range(args: argparse.Namespace, now: float) -> tuple[float | None, float | None]:
    """``--since`` and ``--until`` as Unix times; a range that nothing can match is refused."""
    since = None if args.since is None else parse_since(args.since, now)
    until = None if args.until is None else parse_since(args.until, now, option="--until")
    if since is not None and until is not None and since >= until:
        raise configuration.ConfigError(
            f"--since {args.since} is not before --until {args.until}: nothing can match "
            "(a duration counts back from now: --since 2h --until 1h)"
        )
    return since, until


def _name(lookup: Callable[[int], Any], number: int) -> str:
    try:
        return str(lookup(number)[0])
    except KeyError:
        return str(number)


def _me() -> str:
    return _name(pwd.getpwuid, os.geteuid())


def _blocked(path: Path) -> Path:
    """The first folder above ``path`` this user may not enter (``path`` itself if none)."""
    for folder in reversed(path.parents):
        if not os.access(folder, os.X_OK):
            return folder
    return path


def _who_may(where: Path, bit: int) -> str:
    """Who ``bit`` (read 4 / write 2) of ``where``'s mode lets in: its owner, its group's
    members where the group has the bit, root always."""
    try:
        info = where.stat()
    except OSError:
        return "its owner, or root"
    owner, group = _name(pwd.getpwuid, info.st_uid), _name(grp.getgrgid, info.st_gid)
    mode = f"{owner}:{group} {stat.S_IMODE(info.st_mode):04o}"
    if info.st_mode & (bit << 3):
        return (
            f"{where} is {mode}: run it as {owner} or a member of group {group} "
            f"(usermod -aG {group} {_me()}, then log in again), or with sudo"
        )
    if owner == "root":
        return f"{where} is {mode}: only root may"
    return f"{where} is {mode}: only {owner} (sudo -u {owner} ...) or root may"


def access_problem(what: str, path: str, *, write: bool = False) -> str | None:
    """Why this user cannot read (or, with ``write``, change) the file ``path``, in one line
    naming who may; ``None`` when it can. ``what`` names it: "the journal"."""
    file = Path(path)
    me = _me()
    try:
        is_dir = file.is_dir()
        exists = is_dir or file.exists()
    except PermissionError:
        return f"{what} {path} is not readable by user {me}: {_who_may(_blocked(file), 1)}"
    if not exists:
        return None
    if is_dir:
        return f"{what} {path} is a directory, not a file"
    if not os.access(file, os.R_OK):
        return f"{what} {path} is not readable by user {me}: {_who_may(file, 4)}"
    if write:
        # SQLite writes beside the file too (its -wal and -shm), so both must let this user in.
        beside = [Path(path + end) for end in ("-wal", "-shm")]
        for where in (file, file.parent, *(b for b in beside if b.exists())):
            if not os.access(where, os.W_OK):
                return (
                    f"user {me} may not write {what} {path}, which acknowledging does: "
                    f"{_who_may(where, 2)}"
                )
    return None


def journal_problem(path: str, *, write: bool = False) -> str | None:
    problem = access_problem("the journal", path, write=write)
    if problem:
        return problem
    if not Path(path).exists():
        return f"no journal at {path} (give the daemon's journal path with --journal)"
    return None
