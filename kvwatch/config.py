"""The daemon's configuration: a TOML file, then command-line flags on top.

Every setting, with what it does and its default, is in the example ``deploy/kvwatch.toml``
(``kvwatch export deploy``): commented out where the default applies. The fast path to the pager
(``node``, ``alertmanager_*``, ``prometheus_scrape_interval``) is :mod:`kvwatch.alerting.evaluate`'s
and :mod:`kvwatch.alerting.notify`'s.
"""

from __future__ import annotations

import difflib
import os
import pwd
import re
import socket
import tomllib
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Final

from kvspool.catalogue import ENGINE, OTHER, ROLE
from kvwatch.ingest.logs.watch import EngineLog

#: 9100-9999 is fully allocated on Prometheus's exporter port list; this one is outside it,
#: below the Linux ephemeral range, and not a well-known default of any exporter.
DEFAULT_PORT: Final = 29321
DEFAULT_LISTEN: Final = f"127.0.0.1:{DEFAULT_PORT}"
#: Where the unit and the README install the settings: what ``kvwatch status`` reads when
#: given neither ``--url`` nor ``--config``.
DEFAULT_CONFIG: Final = "/etc/kvwatch/kvwatch.toml"
DEFAULT_SPOOL_DIR: Final = "/run/kvwatch/spool"
DEFAULT_JOURNAL: Final = "/var/lib/kvwatch/journal.db"
#: The incidents log's file name, beside the journal unless configured.
INCIDENTS_LOG_NAME: Final = "incidents.jsonl"

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_UNITS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
#: Below this, a retention is almost always a unit mistake (``30`` meant days, not seconds):
#: refused unless the operator confirms it (``--allow-short-retention``).
MIN_RETENTION: Final = 3600.0
#: Roles and engines a watched log may name (the spool's catalogue; "auto": from the lines).
LOG_ROLES: Final = ROLE.sorted_values
LOG_ENGINES: Final = (*(e for e in ENGINE.sorted_values if e != OTHER), "auto")


class ConfigError(ValueError):
    pass


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for a near miss, else a list of what is allowed."""
    options = sorted(choices)
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    if close:
        return f" (did you mean {close[0]!r}?)"
    return f" (one of: {', '.join(options)})"


#: The shortest spool poll interval (seconds).
MIN_POLL_INTERVAL: Final = 0.01


def parse_duration(value: object, *, setting: str = "duration") -> float:
    """Seconds from ``"90s"``, ``"15m"``, ``"1h"``, ``"30d"``, ``"2w"``, ``"250ms"``.

    A bare number is refused: ``retention = 30`` has cost people their evidence when 30 days
    was meant and 30 seconds was taken.
    """
    text = str(value)
    match = _DURATION.match(text)
    negative = text.strip().startswith("-") and _DURATION.match(text.strip()[1:])
    if negative and not isinstance(value, bool):
        raise ConfigError(
            f"{setting}: not a duration: {value!r} is negative (use e.g. 90s, 15m, 1h, 30d)"
        )
    if isinstance(value, bool) or match is None:
        raise ConfigError(f"{setting}: not a duration: {value!r} (use e.g. 90s, 15m, 1h, 30d)")
    if match.group(2) is None:
        raise ConfigError(
            f"{setting}: {value!r} has no unit; write it with one, e.g. {match.group(1)}s, "
            f"{match.group(1)}m, {match.group(1)}h or {match.group(1)}d"
        )
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT``; ``:PORT`` is every interface, as exporters read it."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(
            f"listen: expected HOST:PORT or :PORT, got {value!r} (e.g. 127.0.0.1:{DEFAULT_PORT})"
        )
    return host.strip("[]") or "0.0.0.0", int(port)


def check_retention(config: Config, *, allow_short: bool) -> list[str]:
    """Refuse a retention that would prune evidence within the hour, unless confirmed.

    Returns warnings to log: a records_retention longer than retention acts as the retention
    (the daemon prunes per-record rows with the incidents they account for), said when it was
    set rather than left at its default.
    """
    for name in ("retention", "records_retention"):
        seconds = getattr(config, name)
        if seconds <= 0:
            raise ConfigError(f"{name}: must be more than 0, got {seconds:g}s")
        if seconds < MIN_RETENTION and not allow_short:
            raise ConfigError(
                f"{name}: {seconds:g}s would delete incidents within the hour; "
                "pass --allow-short-retention if you mean it"
            )
    warnings = []
    # Left at its default, a records_retention longer than a short retention is no news.
    was_set = config.records_retention != Config.records_retention
    if was_set and config.records_retention > config.retention:
        warnings.append(
            f"records_retention {show_duration(config.records_retention)} is longer than "
            f"retention {show_duration(config.retention)}: per-record rows are kept only as "
            "long as the incidents they account for; using the retention"
        )
    return warnings


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
    incidents_log: str = ""
    incidents_log_max_bytes: int = 64 << 20
    incidents_log_keep: int = 5
    node: str = ""
    alertmanager_urls: list[str] = field(default_factory=list)
    alertmanager_enabled: bool = True
    alertmanager_labels: dict[str, str] = field(default_factory=dict)
    alertmanager_timeout: float = 10.0
    alertmanager_resend: float = 60.0
    prometheus_scrape_interval: float = 15.0
    alertmanager_ca_file: str = ""
    alertmanager_username: str = ""
    alertmanager_password_file: str = ""
    #: The integrity alarm (status page, ``kvwatch status``): an incident raises it for this
    #: long after its last finding (the alert rule's 5 minutes), unless acknowledged first...
    alarm_window: float = 300.0
    #: ... or, with this on, until acknowledged (``kvwatch ack``), however old.
    alarm_until_ack: bool = False

    @property
    def node_name(self) -> str:
        """The ``node`` label Prometheus gives this daemon's target: the setting, else the host
        name."""
        return self.node or socket.gethostname()

    @property
    def quarantine(self) -> str:
        return self.quarantine_dir or str(Path(self.spool_dir) / "quarantine")

    @property
    def incidents_log_path(self) -> str | None:
        """Where incidents are appended as JSON lines: beside the journal unless set; None
        when set to "off"."""
        if self.incidents_log == "off":
            return None
        return self.incidents_log or str(Path(self.journal).parent / INCIDENTS_LOG_NAME)

    def uids(self) -> list[int]:
        return self.allowed_uids or [os.geteuid()]


@dataclass(frozen=True)
class Range:
    """The values a numeric setting takes: ``low`` (included unless ``above``) to ``high``."""

    low: float
    high: float
    above: bool = False  # low itself is refused: "more than low"
    duration: bool = True  # shown with a unit (seconds), else a whole number

    def show(self, value: float, like: float) -> str:
        return show_duration(value, like) if self.duration else f"{value:.15g}"

    def check(self, name: str, value: float) -> None:
        span = f"(from {self.show(self.low, self.low)} to {self.show(self.high, self.high)})"
        if self.above and not value > self.low:
            raise ConfigError(
                f"{name}: must be more than {self.show(self.low, self.low)}, "
                f"got {self.show(value, self.low)} {span}"
            )
        if not self.above and not value >= self.low:
            raise ConfigError(
                f"{name}: must be at least {self.show(self.low, self.low)}, "
                f"got {self.show(value, self.low)} {span}"
            )
        if not value <= self.high:
            raise ConfigError(
                f"{name}: must be at most {self.show(self.high, self.high)}, "
                f"got {self.show(value, self.high)} {span}"
            )


def show_duration(seconds: float, like: float | None = None) -> str:
    """``seconds`` in the largest unit that ``like`` (default: itself) is at least one of."""
    ref = seconds if like is None else like
    if ref == 0:
        return f"{seconds:g}s"
    for unit in ("w", "d", "h", "m", "s"):
        if abs(ref) >= _UNITS[unit] and (ref / _UNITS[unit]).is_integer():
            return f"{seconds / _UNITS[unit]:g}{unit}"
    return f"{seconds * 1000:g}ms" if abs(ref) < 1 else f"{seconds:g}s"


#: Ten years: a retention beyond it is a typo (``1e30d``), not a policy.
MAX_RETENTION: Final = 3650 * 86400.0
#: Every numeric setting's range, checked after the file and the flags are read.
RANGES: Final = {
    "retention": Range(0.0, MAX_RETENTION, above=True),
    "records_retention": Range(0.0, MAX_RETENTION, above=True),
    # 0s would spin a core polling the spool; nothing an engine writes needs under 10ms, and a
    # poll a minute apart already leaves the status page a minute stale.
    "poll_interval": Range(MIN_POLL_INTERVAL, 60.0),
    "idle_grace": Range(0.1, 3600.0),
    "alertmanager_timeout": Range(0.1, 300.0),
    # Alertmanager resolves an alert not re-sent within its resolve_timeout (5m by default).
    "alertmanager_resend": Range(1.0, 3600.0),
    "prometheus_scrape_interval": Range(0.1, 3600.0),
    # 0 would delete every quarantined segment, the evidence, as soon as it is moved there.
    "quarantine_max": Range(1, 100_000, duration=False),
    "incidents_log_max_bytes": Range(4096, 1 << 40, duration=False),
    "incidents_log_keep": Range(0, 1000, duration=False),
    "alarm_window": Range(1.0, 366 * 86400.0),
}
#: A uid: 0 to 2^32 - 2 (the last is (uid_t) -1, "no user").
UID_RANGE: Final = Range(0, 2**32 - 2, duration=False)


_DURATIONS: Final = {
    "retention",
    "records_retention",
    "poll_interval",
    "idle_grace",
    "alertmanager_timeout",
    "alertmanager_resend",
    "prometheus_scrape_interval",
    "alarm_window",
}
_STRINGS: Final = {
    "spool_dir",
    "journal",
    "listen",
    "quarantine_dir",
    "tls_cert_file",
    "tls_key_file",
    "tls_client_ca_file",
    "incidents_log",
    "node",
    "alertmanager_ca_file",
    "alertmanager_username",
    "alertmanager_password_file",
}
_BOOLEANS: Final = {"nvml", "alertmanager_enabled", "alarm_until_ack"}
#: Labels an alert of the rule file already has: an external label never overrides them.
_RULE_LABELS: Final = frozenset({"alertname", "severity", "node"})
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
KNOWN_SETTINGS: Final = frozenset({f.name for f in fields(Config)} | {"allowed_users"})


def _uid(user: object) -> int:
    if isinstance(user, int) and not isinstance(user, bool):
        return user
    if isinstance(user, str) and user.isdigit():
        return int(user)  # a numeric uid, as --allowed-user documents: no passwd entry needed
    try:
        return pwd.getpwnam(str(user)).pw_uid
    except KeyError:
        raise ConfigError(f"allowed_users: no user {user!r}") from None


def _list(key: str, value: object) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigError(f"{key}: expected a list, got {value!r}")
    return value


def from_mapping(data: dict[str, Any], base: Config | None = None) -> Config:
    config = base or Config()
    for key in sorted(set(data) - KNOWN_SETTINGS):
        raise ConfigError(f"unknown setting {key!r}{did_you_mean(key, KNOWN_SETTINGS)}")
    for key, value in data.items():
        _apply(config, key, value)
    parse_listen(config.listen)
    for name, allowed in RANGES.items():
        allowed.check(name, getattr(config, name))
    for uid in config.allowed_uids:
        UID_RANGE.check("allowed_users", uid)
    return config


def _apply(config: Config, key: str, value: Any) -> None:
    """Set one known setting from the config file's (or a flag's) value."""
    if key in _DURATIONS:
        setattr(config, key, parse_duration(value, setting=key))
    elif key in _LISTS:
        attribute, one = _LISTS[key]
        setattr(config, attribute, [one(v) for v in _list(key, value)])
    elif key in _BOOLEANS:
        # Strictly a TOML boolean: "false" as a string is truthy and was read as true.
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false (no quotes), got {value!r}")
        setattr(config, key, value)
    elif key == "alertmanager_labels":
        config.alertmanager_labels = _external_labels(value)
    elif key in ("quarantine_max", "incidents_log_max_bytes", "incidents_log_keep"):
        setattr(config, key, _integer(key, value))
    elif key in _STRINGS:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        setattr(config, key, value)


def _alertmanager_url(value: object) -> str:
    text = str(value)
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(
            f"alertmanager_urls: {value!r} is not an http(s) URL (e.g. http://127.0.0.1:9093)"
        )
    return text.rstrip("/")


def _external_labels(value: object) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ConfigError(f"alertmanager_labels: expected a table of labels, got {value!r}")
    labels: dict[str, str] = {}
    for name, text in value.items():
        if not _LABEL_NAME.match(name) or name.startswith("__"):
            raise ConfigError(f"alertmanager_labels: {name!r} is not a Prometheus label name")
        if not isinstance(text, str):
            raise ConfigError(f"alertmanager_labels: {name} must be a string, got {text!r}")
        if name == "replica":
            # An HA pair's replica label is dropped before alerts reach Alertmanager (or the
            # two replicas page twice); a daemon sending it would never merge with the rule.
            raise ConfigError(
                "alertmanager_labels: leave out 'replica' (alert_relabel_configs drops it from "
                "Prometheus's alerts; give the labels that remain)"
            )
        if name in _RULE_LABELS:
            raise ConfigError(
                f"alertmanager_labels: {name!r} is set by the alert itself (set node with the "
                "node setting)"
            )
        labels[name] = text
    return labels


def _integer(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: expected a whole number, got {value!r}")
    return value


_LOG_KEYS: Final = frozenset({"path", "role", "engine", "model"})


def _engine_log(entry: object) -> EngineLog:
    if isinstance(entry, str):
        return parse_log_flag(entry)
    if not isinstance(entry, dict) or "path" not in entry:
        raise ConfigError(f"[[logs]] entry needs a path: {entry!r}")
    for key in sorted(set(entry) - _LOG_KEYS):
        raise ConfigError(f"[[logs]] unknown key {key!r}{did_you_mean(key, _LOG_KEYS)}")
    return _checked_log(
        str(entry["path"]),
        str(entry.get("role", OTHER)),
        str(entry.get("engine", "auto")),
        str(entry.get("model", "")),
    )


def _checked_log(path: str, role: str, engine: str, model: str = "") -> EngineLog:
    if role not in LOG_ROLES:
        raise ConfigError(f"log {path}: unknown role {role!r}{did_you_mean(role, LOG_ROLES)}")
    if engine not in LOG_ENGINES:
        raise ConfigError(
            f"log {path}: unknown engine {engine!r}{did_you_mean(engine, LOG_ENGINES)}"
        )
    if not path:
        raise ConfigError("log: empty path")
    return EngineLog(path=path, role=role, engine=engine, model=model)


def parse_log_flag(value: str) -> EngineLog:
    """``--log ROLE:ENGINE:PATH`` or ``--log ROLE:PATH`` or ``--log PATH`` (an absolute path).

    Every part is checked: ``prefill:sgl:/x.log`` is an unknown engine, not a file named
    ``sgl:/x.log``.
    """
    if value.startswith(("/", ".")):
        return _checked_log(value, OTHER, "auto")
    parts = value.split(":", 2)
    if len(parts) == 3 and not parts[2].startswith("/") and parts[1].startswith("/"):
        parts = [parts[0], f"{parts[1]}:{parts[2]}"]  # ROLE:/path:with:colons
    if len(parts) == 3:
        return _checked_log(parts[2], parts[0], parts[1])
    if len(parts) == 2:
        return _checked_log(parts[1], parts[0], "auto")
    raise ConfigError(
        f"--log {value!r}: expected ROLE:ENGINE:PATH, ROLE:PATH or an absolute PATH "
        "(e.g. prefill:sglang:/var/log/sglang/prefill.log)"
    )


def load(path: str | os.PathLike[str] | None) -> Config:
    if path is None:
        return Config()
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except IsADirectoryError:
        raise ConfigError(f"config {path} is a directory, not a TOML file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config {path} is not UTF-8 text (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path}: {exc}") from None
    try:
        return from_mapping(data)
    except ConfigError as exc:
        raise ConfigError(f"config {path}: {exc}") from None


#: Settings that are lists: the Config attribute each sets, and how one item is read.
_LISTS: Final[dict[str, tuple[str, Callable[[Any], Any]]]] = {
    "allowed_users": ("allowed_uids", _uid),
    "logs": ("logs", _engine_log),
    "alertmanager_urls": ("alertmanager_urls", _alertmanager_url),
    "allowed_uids": ("allowed_uids", lambda v: _integer("allowed_uids", v)),
}
