"""What several commands share: the catalogue's choices, time ranges, the journal's path checks."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

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


def journal_problem(path: str) -> str | None:
    journal = Path(path)
    if not journal.exists():
        return f"no journal at {path} (give the daemon's journal path with --journal)"
    if journal.is_dir():
        return f"the journal {path} is a directory, not a journal file"
    if not os.access(journal, os.R_OK):
        return f"the journal {path} is not readable by this user (try sudo, or the kvwatch user)"
    return None
