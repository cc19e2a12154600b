"""``kvwatch init``: the folders the systemd unit creates, for a start without systemd.

The unit makes the spool (``RuntimeDirectory``, mode 2770: the engines' group writes it, setgid
so every segment keeps the daemon's group) and the journal's folder (``StateDirectory``, 0750).
Without systemd nothing does, and the hooks never create the spool (a folder they made would be
one no daemon reads). This command makes the folders a config names with the unit's owners and
modes; a folder that exists with other ones is named, never changed behind the operator's back.
"""

from __future__ import annotations

import argparse
import grp
import os
import pwd
import stat
from pathlib import Path
from typing import Any

from kvwatch import config as configuration
from kvwatch import errors
from kvwatch.commands.clihelp import add_command, fail

#: The unit's modes (deploy/kvwatch.service): RuntimeDirectoryMode, StateDirectoryMode.
SPOOL_MODE = 0o2770
STATE_MODE = 0o750


def folders(config: configuration.Config) -> list[tuple[Path, int]]:
    """The folders the daemon with ``config`` needs, each with the unit's mode."""
    out = [(Path(config.spool_dir), SPOOL_MODE), (Path(config.journal).parent, STATE_MODE)]
    if config.incidents_log:
        out.append((Path(config.incidents_log).parent, STATE_MODE))
    once: dict[Path, int] = {}
    for path, mode in out:
        once.setdefault(path, mode)
    return list(once.items())


def _make(path: Path, mode: int, uid: int, gid: int) -> str | None:
    """Create ``path`` (missing parents 0755, as ``install -d``) owned ``uid:gid`` with
    ``mode``, or check the one there; a line saying what is wrong, or None."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        path.mkdir()
        os.chown(path, uid, gid)
        os.chmod(path, mode)  # after chown, which clears setgid
        print(f"created {path} {_who(uid, gid)} {mode:04o}")
        return None
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} exists and is not a folder"
    have = stat.S_IMODE(info.st_mode)
    if (info.st_uid, info.st_gid, have) != (uid, gid, mode):
        return (
            f"{path} exists as {_who(info.st_uid, info.st_gid)} {have:04o}; the daemon needs "
            f"{_who(uid, gid)} {mode:04o} (chown {_who(uid, gid)} {path}; chmod {mode:04o} {path})"
        )
    print(f"ok {path} {_who(uid, gid)} {mode:04o}")
    return None


def _who(uid: int, gid: int) -> str:
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    try:
        group = grp.getgrgid(gid).gr_name
    except KeyError:
        group = str(gid)
    return f"{user}:{group}"


def run(args: argparse.Namespace) -> int:
    path = args.config
    if not path and os.path.exists(configuration.DEFAULT_CONFIG):
        path = configuration.DEFAULT_CONFIG
    try:
        config = configuration.load(path) if path else configuration.Config()
    except configuration.ConfigError as exc:
        return fail("init", str(exc), 2)
    try:
        uid = pwd.getpwnam(args.user).pw_uid
    except KeyError:
        return fail(
            "init", f"no user {args.user!r}: create it first (useradd --system {args.user})"
        )
    try:
        gid = grp.getgrnam(args.group).gr_gid
    except KeyError:
        return fail("init", f"no group {args.group!r}: create it first (groupadd --system)")
    if os.geteuid() != 0 and os.geteuid() != uid:
        return fail("init", f"run it as root: it gives the folders to {args.user}:{args.group}")
    problems = []
    for folder, mode in folders(config):
        try:
            problem = _make(folder, mode, uid, gid)
        except OSError as exc:
            problem = f"cannot create {folder}: {errors.reason(exc)}"
        if problem:
            problems.append(problem)
    for problem in problems:
        fail("init", problem)
    return 1 if problems else 0


def add_parser(commands: Any) -> argparse.ArgumentParser:
    p = add_command(
        commands,
        "init",
        help="create the spool and journal folders as the systemd unit does (no systemd)",
        description="Create the folders the daemon's config names with the unit's owners and "
        "modes: the spool 2770 (setgid; engines in the group write it), the journal's and the "
        "incidents log's folders 0750. A folder already there with other owners or mode is "
        "named (exit 1), not changed. Run as root, once per boot for a spool on tmpfs, before "
        "the daemon and the engines start.",
        examples=[
            "kvwatch init",
            "kvwatch init --config /etc/kvwatch/kvwatch.toml --user kvwatch --group kvwatch",
        ],
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help=f"the daemon's TOML settings (default: {configuration.DEFAULT_CONFIG} if present)",
    )
    p.add_argument("--user", default="kvwatch", help="the daemon's user (default: kvwatch)")
    p.add_argument("--group", default="kvwatch", help="the daemon's group (default: kvwatch)")
    return p
