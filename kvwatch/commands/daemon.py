"""``kvwatch daemon``: the settings from the config and the flags, then the daemon
(:class:`kvwatch.daemon.Daemon`)."""

from __future__ import annotations

import argparse
from typing import Any

from kvwatch import config as configuration
from kvwatch.commands.clihelp import add_command, fail

#: The settings a flag of the same name overrides (when given).
_OVERRIDES = (
    "spool_dir", "journal", "listen", "retention", "records_retention", "incidents_log", "node",
    "poll_interval", "idle_grace",
)  # fmt: skip


def settings(args: argparse.Namespace) -> configuration.Config:
    """The config file with the flags over it, checked; logs what it adjusted. At start and on
    every reload (SIGHUP), the same way."""
    config = configuration.load(args.config)
    overrides: dict[str, object] = {
        key: getattr(args, key) for key in _OVERRIDES if getattr(args, key) is not None
    }
    if args.no_nvml:
        overrides["nvml"] = False
    if args.allowed_user:
        overrides["allowed_users"] = args.allowed_user
    config = configuration.from_mapping(overrides, config)
    if args.log:
        config.logs = config.logs + [configuration.parse_log_flag(v) for v in args.log]
    warnings = configuration.check_retention(config, allow_short=args.allow_short_retention)
    import structlog

    for warning in warnings:
        structlog.get_logger("kvwatch.config").warning("config.adjusted", message=warning)
    return config


def run(args: argparse.Namespace) -> int:
    from kvwatch import logsetup
    from kvwatch.daemon import Daemon, DaemonError

    logsetup.configure(args.log_level, fmt=args.log_format)
    try:
        config = settings(args)
    except configuration.ConfigError as exc:
        return fail("daemon", str(exc), 2)
    try:
        daemon = Daemon(config, load=lambda: settings(args))
    except DaemonError as exc:
        return fail("daemon", str(exc))
    return daemon.run()


def add_parser(commands: Any) -> argparse.ArgumentParser:
    d = add_command(
        commands,
        "daemon",
        help="read the spool, engine logs and NVML; keep the journal; serve /metrics",
        description="The per-node daemon. Settings come from --config (TOML), flags override "
        "them. HTTP: /metrics, / (status page), /-/healthy, /-/ready. Logs go to stderr: "
        "coloured lines on a terminal, JSON lines otherwise. SIGTERM/SIGINT stop it after the "
        "batch in hand is committed; SIGHUP reloads the config (retention, poll timings, engine "
        "logs, Alertmanager settings; other changes wait for a restart, a file that does not "
        "load is refused). One daemon per journal and per spool folder.",
        examples=[
            "kvwatch daemon --config /etc/kvwatch/kvwatch.toml",
            "kvwatch daemon --spool-dir /run/kvwatch/spool --listen :29321 "
            "--log prefill:sglang:/var/log/sglang/prefill.log",
        ],
    )
    d.add_argument("--config", metavar="FILE", help="TOML settings file (default: none)")
    d.add_argument(
        "--spool-dir",
        dest="spool_dir",
        metavar="DIR",
        help=f"where the engine hooks write (default: {configuration.DEFAULT_SPOOL_DIR})",
    )
    d.add_argument(
        "--journal",
        metavar="FILE",
        help="SQLite incident journal, on persistent disk "
        f"(default: {configuration.DEFAULT_JOURNAL})",
    )
    d.add_argument(
        "--incidents-log",
        dest="incidents_log",
        metavar="FILE",
        help="append every incident as a JSON line here, for a log shipper; 'off' for none "
        f"(default: {configuration.INCIDENTS_LOG_NAME} beside the journal)",
    )
    d.add_argument(
        "--node",
        metavar="NAME",
        help="this node's name in the journal, incidents, status and pages: the same as the "
        "node label Prometheus gives this target (default: the config's node, else the host "
        "name; on Kubernetes, the pod's spec.nodeName)",
    )
    d.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help=f"HTTP address; :PORT means every interface (default: {configuration.DEFAULT_LISTEN})",
    )
    d.add_argument(
        "--log",
        action="append",
        metavar="ROLE:ENGINE:PATH",
        help="an engine log to watch, repeatable; ROLE is one of "
        f"{', '.join(configuration.LOG_ROLES)}, ENGINE one of "
        f"{', '.join(configuration.LOG_ENGINES)}; ROLE:PATH and an absolute PATH also work "
        "(default: none)",
    )
    d.add_argument("--no-nvml", action="store_true", help="do not read GPU memory through NVML")
    d.add_argument(
        "--retention",
        metavar="DURATION",
        help="keep incidents, rejects and gaps this long, with a unit: 30d, 12h (default: 30d)",
    )
    d.add_argument(
        "--records-retention",
        dest="records_retention",
        metavar="DURATION",
        help="keep per-record accounting rows this long, with a unit (default: 2d)",
    )
    d.add_argument(
        "--allow-short-retention",
        action="store_true",
        help="accept a retention under one hour (otherwise refused as a likely unit mistake)",
    )
    d.add_argument(
        "--poll-interval",
        dest="poll_interval",
        metavar="DURATION",
        help="time between spool polls, with a unit, e.g. 250ms (default: 250ms)",
    )
    d.add_argument(
        "--idle-grace",
        dest="idle_grace",
        metavar="DURATION",
        help="how long a silent producer's unlocked segment waits before it counts as abandoned,"
        " with a unit (default: 5s)",
    )
    d.add_argument(
        "--allowed-user",
        action="append",
        metavar="USER",
        help="user name or uid allowed to own spool segments, repeatable "
        "(default: the daemon's own user; members of the spool folder's group are allowed "
        "when that group may write it)",
    )
    from kvwatch.logsetup import FORMATS, LEVELS

    d.add_argument("--log-level", choices=LEVELS, default="info", help="least severe log level")
    d.add_argument(
        "--log-format",
        choices=FORMATS,
        default="auto",
        help="auto: coloured human-readable lines on a terminal, JSON lines otherwise",
    )
    return d
