"""``kvwatch status``: this node's verdict from the running daemon, in the terminal."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from kvwatch import config as configuration
from kvwatch.commands.clihelp import add_command, fail, number, paint, use_colour

STATUS_EXIT = {"ok": 0, "warning": 3, "alarm": 4}


#: The longest ``status --timeout`` (seconds): a health check that waits longer is stuck.
STATUS_MAX_TIMEOUT = 3600.0


def status_url(args: argparse.Namespace) -> str:
    if args.url:
        return _daemon_url(str(args.url))
    path = args.config
    if not path and os.path.exists(configuration.DEFAULT_CONFIG):
        path = configuration.DEFAULT_CONFIG  # the installed daemon's, as the unit starts it
    settings = configuration.load(path) if path else None
    host, port = configuration.parse_listen(
        settings.listen if settings else configuration.DEFAULT_LISTEN
    )
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"  # every interface includes loopback
    scheme = "https" if settings and settings.tls_cert_file else "http"
    return f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}"


def _daemon_url(text: str) -> str:
    """``--url``: an http(s) URL, or the daemon's ``HOST:PORT`` (its listen setting), as
    http."""
    url = text.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise configuration.ConfigError(
            f"--url {text!r}: expected HOST:PORT or an http(s) URL "
            f"(e.g. 127.0.0.1:{configuration.DEFAULT_PORT} or "
            f"https://10.0.0.7:{configuration.DEFAULT_PORT})"
        )
    return url


def run(args: argparse.Namespace) -> int:
    def error(message: str, code: int) -> int:
        if args.json:  # a machine reading --json gets JSON, whatever went wrong
            print(json.dumps({"error": message, "exit_code": code}, sort_keys=True))
        return fail("status", message, code)

    try:
        url = status_url(args)
    except configuration.ConfigError as exc:
        return error(str(exc), 2)
    request = urllib.request.Request(url + "/", headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as reply:
            summary: dict[str, Any] = json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return error(f"the daemon at {url} answered HTTP {exc.code}", 1)
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return error(
            f"no kvwatch daemon answers at {url} ({reason}); is it running? "
            "(systemctl status kvwatch)",
            1,
        )
    except ValueError:
        return error(f"{url} did not answer with kvwatch's status JSON", 1)
    if args.json:
        print(json.dumps(summary, sort_keys=True, indent=2))
    else:
        colour = use_colour(sys.stdout, args.color)
        print(paint(summary["headline"], summary["level"], colour))
        for check in summary["checks"]:
            mark = {"ok": "ok  ", "warning": "WARN", "alarm": "ALRM"}[check["level"]]
            print(f"  {paint(mark, check['level'], colour)}  {check['name']:<12} {check['line']}")
    return STATUS_EXIT.get(summary["level"], 1)


def add_parser(commands: Any) -> argparse.ArgumentParser:
    status = add_command(
        commands,
        "status",
        help="this node's verdict from the running daemon, in the terminal",
        description="The status page's summary: the headline (the worst of integrity, spool "
        "access, unsafe band, coverage and freshness) and one line per check. Exit 0 ok, 3 "
        "warning, 4 alarm, 1 when no daemon answers (with --json, an object with the error), "
        "2 for a usage error. The integrity alarm counts affected requests (incidents) until "
        "each is acknowledged (kvwatch ack) or its last finding is older than the daemon's "
        "alarm_window (unless alarm_until_ack is set).",
        examples=["kvwatch status", "kvwatch status --url 10.0.0.7:29321 --json"],
    )
    status.add_argument(
        "--url",
        help="the daemon's HOST:PORT (its listen setting) or an http(s) URL (default: from "
        f"--config's listen, else "
        f"{configuration.DEFAULT_LISTEN})",
    )
    status.add_argument(
        "--config",
        help="the daemon's TOML config, to find its listen address "
        f"(default: {configuration.DEFAULT_CONFIG} when it exists)",
    )
    status.add_argument("--json", action="store_true", help="the summary as JSON")
    status.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="colour the verdict; auto: on a terminal, unless NO_COLOR is set",
    )
    status.add_argument(
        "--timeout",
        type=number(0, STATUS_MAX_TIMEOUT, above=True, unit="s"),
        default=5.0,
        help="seconds to wait for the daemon",
    )

    return status
