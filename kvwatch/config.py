"""The daemon's configuration: a TOML file, then command-line flags on top.

Example (``deploy/kvwatch.toml``)::

    spool_dir = "/run/kvwatch/spool"
    journal = "/var/lib/kvwatch/journal.db"
    listen = "127.0.0.1:29321"
    nvml = true
    retention = "30d"            # incidents, rejects, gaps
    records_retention = "2d"     # the per-record accounting rows
    allowed_users = ["sglang"]   # who may write spool segments (default: the daemon's own user)

    [[logs]]
    path = "/var/log/sglang/prefill.log"
    role = "prefill"
    engine = "sglang"
"""

from __future__ import annotations

import os
import pwd
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Final

from kvwatch.logwatch import EngineLog

#: 9100-9999 is fully allocated on Prometheus's exporter port list; this one is outside it,
#: below the Linux ephemeral range, and not a well-known default of any exporter.
DEFAULT_PORT: Final = 29321
DEFAULT_LISTEN: Final = f"127.0.0.1:{DEFAULT_PORT}"
DEFAULT_SPOOL_DIR: Final = "/run/kvwatch/spool"
DEFAULT_JOURNAL: Final = "/var/lib/kvwatch/journal.db"

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_UNITS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


class ConfigError(ValueError):
    pass


def parse_duration(value: str | float | int) -> float:
    """Seconds from ``90``, ``"90s"``, ``"15m"``, ``"1h"``, ``"30d"``, ``"2w"``."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    match = _DURATION.match(str(value))
    if match is None:
        raise ConfigError(f"not a duration: {value!r} (use e.g. 90s, 15m, 1h, 30d)")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"listen must be HOST:PORT, got {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


@dataclass
class Config:
    spool_dir: str = DEFAULT_SPOOL_DIR
    journal: str = DEFAULT_JOURNAL
    listen: str = DEFAULT_LISTEN
    nvml: bool = True
    retention: float = 30 * 86400.0
    records_retention: float = 2 * 86400.0
    poll_interval: float = 0.25
    idle_grace: float = 5.0
    allowed_uids: list[int] = field(default_factory=list)
    quarantine_dir: str = ""
    quarantine_max: int = 32
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    logs: list[EngineLog] = field(default_factory=list)

    @property
    def quarantine(self) -> str:
        return self.quarantine_dir or str(Path(self.spool_dir) / "quarantine")

    def uids(self) -> list[int]:
        return self.allowed_uids or [os.geteuid()]


_DURATIONS: Final = {"retention", "records_retention", "poll_interval", "idle_grace"}


def _uid(user: object) -> int:
    if isinstance(user, int) and not isinstance(user, bool):
        return user
    if isinstance(user, str) and user.isdigit():
        return int(user)  # a numeric uid, as --allowed-user documents: no passwd entry needed
    try:
        return pwd.getpwnam(str(user)).pw_uid
    except KeyError:
        raise ConfigError(f"allowed_users: no user {user!r}") from None


def from_mapping(data: dict[str, Any], base: Config | None = None) -> Config:
    config = base or Config()
    known = {f.name for f in fields(Config)} | {"allowed_users"}
    unknown = set(data) - known
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}")
    for key, value in data.items():
        if key in _DURATIONS:
            setattr(config, key, parse_duration(value))
        elif key == "allowed_users":
            config.allowed_uids = [_uid(u) for u in value]
        elif key == "logs":
            config.logs = [_engine_log(entry) for entry in value]
        elif key == "nvml":
            config.nvml = bool(value)
        elif key in ("allowed_uids",):
            config.allowed_uids = [int(v) for v in value]
        elif key == "quarantine_max":
            config.quarantine_max = int(value)
        else:
            setattr(config, key, str(value))
    parse_listen(config.listen)
    return config


def _engine_log(entry: object) -> EngineLog:
    if isinstance(entry, str):
        return parse_log_flag(entry)
    if not isinstance(entry, dict) or "path" not in entry:
        raise ConfigError(f"[[logs]] entry needs a path: {entry!r}")
    extra = set(entry) - {"path", "role", "engine", "model"}
    if extra:
        raise ConfigError(f"[[logs]] unknown key(s): {', '.join(sorted(extra))}")
    return EngineLog(
        path=str(entry["path"]),
        role=str(entry.get("role", "other")),
        engine=str(entry.get("engine", "auto")),
        model=str(entry.get("model", "")),
    )


def parse_log_flag(value: str) -> EngineLog:
    """``--log ROLE:ENGINE:PATH`` or ``--log ROLE:PATH`` or ``--log PATH``."""
    parts = value.split(":", 2)
    if len(parts) == 3 and parts[0] and parts[1] in ("sglang", "vllm", "auto"):
        return EngineLog(path=parts[2], role=parts[0], engine=parts[1])
    if len(parts) >= 2 and parts[0] in ("prefill", "decode", "unified"):
        return EngineLog(path=value.split(":", 1)[1], role=parts[0])
    return EngineLog(path=value)


def load(path: str | os.PathLike[str] | None) -> Config:
    if path is None:
        return Config()
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return from_mapping(data)
