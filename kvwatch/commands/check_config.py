"""``kvwatch check-config``: is a daemon config valid, before a restart or reload finds out.

As ``promtool check config``: the file is read as the daemon reads it (every key, value and
duration), then what it names is checked where a daemon would fail on it at start (the listen
address, retention, the TLS and Alertmanager files); one line per problem, exit 1.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from kvwatch import config as configuration
from kvwatch.commands.clihelp import add_command, fail

#: Settings that name a file the daemon reads at start.
_FILES = (
    "tls_cert_file", "tls_key_file", "tls_client_ca_file", "alertmanager_ca_file",
    "alertmanager_password_file",
)  # fmt: skip


def problems(config: configuration.Config) -> list[str]:
    """What in a loaded ``config`` would stop a daemon's start (empty when nothing would)."""
    out = []
    try:
        configuration.parse_listen(config.listen)
    except configuration.ConfigError as exc:
        out.append(str(exc))
    for name in _FILES:
        path = getattr(config, name)
        if path and not os.access(path, os.R_OK):
            why = "does not exist" if not os.path.exists(path) else "is not readable by this user"
            out.append(f"{name} {path} {why}")
    if bool(config.tls_cert_file) != bool(config.tls_key_file):
        out.append("tls_cert_file and tls_key_file go together: set both or neither")
    return out


def run(args: argparse.Namespace) -> int:
    path = args.config
    try:
        config = configuration.load(path)
        warnings = configuration.check_retention(config, allow_short=args.allow_short_retention)
    except configuration.ConfigError as exc:
        return fail("check-config", str(exc))
    found = problems(config)
    for problem in found:
        fail("check-config", f"config {path}: {problem}")
    if found:
        return 1
    for warning in warnings:
        print(f"  WARNING: {warning}")
    print(f"  SUCCESS: {path} is valid kvwatch daemon config")
    return 0


def add_parser(commands: Any) -> argparse.ArgumentParser:
    p = add_command(
        commands,
        "check-config",
        help="check a daemon config file, as the daemon would read it",
        description="Read a daemon config (TOML) as the daemon does, every key and value, then "
        "check what would stop a daemon's start: the listen address, the retention, the TLS "
        "and Alertmanager files it names (readable by the user running this). Exit 0 valid, "
        "1 with one line per problem.",
        examples=[
            "kvwatch check-config /etc/kvwatch/kvwatch.toml",
            "sudo -u kvwatch /opt/kvwatch/bin/kvwatch check-config /etc/kvwatch/kvwatch.toml",
        ],
    )
    p.add_argument(
        "config",
        nargs="?",
        default=configuration.DEFAULT_CONFIG,
        help=f"the TOML file (default: {configuration.DEFAULT_CONFIG})",
    )
    p.add_argument(
        "--allow-short-retention",
        action="store_true",
        help="as the daemon's flag: accept a retention under an hour",
    )
    return p
