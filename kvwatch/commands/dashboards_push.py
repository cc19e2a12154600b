"""``kvwatch dashboards push``: upload kvwatch's dashboards and Grafana alert rules to Grafana.

    kvwatch dashboards push --url https://grafana.example.com --token-file /run/secrets/grafana

Through grafana-client, against Grafana's HTTP API:

1. the folder (uid and title ``kvwatch`` by default) is created unless it exists;
2. every ``*.json`` dashboard in ``--dashboards-dir`` is saved into it (``overwrite``: the uid is
   the identity, so a push replaces the previous version);
3. the Grafana-managed alert rules (``kvwatch export grafana-alerts`` writes them; generated from
   the same definitions as the Prometheus rules) are written as one rule group in that folder, each
   query pointed at ``--datasource-uid``.

The token is a Grafana service-account token (Editor role, or Admin for the alert rules), read
from a file so that it never shows in ``ps`` or shell history. Never imports torch.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

from kvwatch import assets, errors

DEFAULT_FOLDER = "kvwatch"
DEFAULT_DATASOURCE_UID = "prometheus"
EXPRESSION_UID = "__expr__"


class PushError(Exception):
    """A push that cannot go on: bad input, or Grafana said no."""


def load_dashboards(directory: Path) -> list[dict[str, Any]]:
    paths = sorted(directory.glob("*.json"))
    if not paths:
        raise PushError(f"no dashboard JSON in {directory} (pass --dashboards-dir)")
    boards = []
    for path in paths:
        try:
            board = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise PushError(f"{path}: not a dashboard: {e}") from e
        if not isinstance(board, dict) or not board.get("uid") or not board.get("title"):
            raise PushError(f"{path}: a dashboard needs a uid and a title")
        boards.append(board)
    return boards


def _duration_seconds(text: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600}
    if len(text) < 2 or text[-1] not in units or not text[:-1].isdigit():
        raise PushError(f"unsupported rule group interval {text!r}")
    return int(text[:-1]) * units[text[-1]]


def rule_groups(
    provisioning: dict[str, Any], folder_uid: str, datasource_uid: str
) -> list[dict[str, Any]]:
    """Grafana's file-provisioning groups turned into bodies for the provisioning HTTP API."""
    groups = provisioning.get("groups")
    if provisioning.get("apiVersion") != 1 or not isinstance(groups, list) or not groups:
        raise PushError("alert rules: expected Grafana provisioning (apiVersion 1, groups)")
    bodies = []
    for group in groups:
        rules = []
        for rule in group["rules"]:
            body = copy.deepcopy(rule)
            for query in body["data"]:
                if query.get("datasourceUid") != EXPRESSION_UID:
                    query["datasourceUid"] = datasource_uid
                    datasource = query.get("model", {}).get("datasource")
                    if isinstance(datasource, dict):
                        datasource["uid"] = datasource_uid
            body.update(folderUID=folder_uid, ruleGroup=group["name"], orgID=group["orgId"])
            rules.append(body)
        bodies.append(
            {
                "title": group["name"],
                "folderUid": folder_uid,
                "interval": _duration_seconds(group["interval"]),
                "rules": rules,
            }
        )
    return bodies


def push(
    api: Any,
    boards: list[dict[str, Any]],
    groups: list[dict[str, Any]],
    folder_uid: str,
    folder_title: str,
) -> list[str]:
    """Do the uploads through a ``grafana_client.GrafanaApi``; returns one line per action."""
    from grafana_client.client import GrafanaClientError

    done = []
    try:
        api.folder.get_folder(folder_uid)
        done.append(f"folder {folder_uid}: exists")
    except GrafanaClientError as e:
        if e.status_code != 404:
            raise
        api.folder.create_folder(folder_title, uid=folder_uid)
        done.append(f"folder {folder_uid}: created")
    for board in boards:
        payload = dict(board, id=None)
        result = api.dashboard.update_dashboard(
            {
                "dashboard": payload,
                "folderUid": folder_uid,
                "overwrite": True,
                "message": "kvwatch dashboards push",
            }
        )
        where = result.get("url", "") if isinstance(result, dict) else ""
        done.append(f"dashboard {board['uid']}: saved {where}".rstrip())
    for group in groups:
        api.alertingprovisioning.update_rule_group(folder_uid, group["title"], group)
        done.append(f"alert rule group {group['title']}: {len(group['rules'])} rules saved")
    return done


def run(args: argparse.Namespace) -> int:
    try:
        from grafana_client.api import GrafanaApi
        from grafana_client.client import GrafanaException
    except ImportError:
        print(
            "kvwatch dashboards push: grafana-client (a kvwatch dependency) is missing; "
            "reinstall kvwatch",
            file=sys.stderr,
        )
        return 1  # a broken installation, not a usage error
    import niquests

    try:
        try:
            token = args.token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise PushError(
                f"cannot read the token file {args.token_file}: {errors.reason(e)}"
            ) from e
        if not token:
            raise PushError(f"{args.token_file} is empty")
        boards = load_dashboards(args.dashboards_dir or assets.directory("dashboards"))
        groups: list[dict[str, Any]] = []
        if not args.no_alert_rules:
            rules = args.alert_rules or assets.path("grafana-alerts", "kvwatch-alert-rules.json")
            try:
                provisioning = json.loads(rules.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise PushError(f"{rules}: {errors.reason(e)} (pass --alert-rules)") from e
            groups = rule_groups(provisioning, args.folder, args.datasource_uid)
        api: Any = GrafanaApi.from_url(args.url, credential=token, timeout=args.timeout)
        for line in push(api, boards, groups, args.folder, args.folder_title):
            print(line)
    except niquests.exceptions.RequestException as e:
        # Before OSError: niquests' connection errors are OSErrors too. Their text is the
        # transport's internals (pools, retries); say what an operator can act on.
        reason = "timed out" if isinstance(e, niquests.exceptions.Timeout) else "unreachable"
        print(
            f"kvwatch dashboards push: Grafana at {args.url} is {reason} "
            f"({type(e).__name__}); check --url and that Grafana is up",
            file=sys.stderr,
        )
        return 1
    except GrafanaException as e:
        print(f"kvwatch dashboards push: Grafana at {args.url}: {_one_line(e)}", file=sys.stderr)
        return 1
    except (OSError, PushError, assets.AssetError) as e:
        print(f"kvwatch dashboards push: {_one_line(e)}", file=sys.stderr)
        return 1
    return 0


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text!r}")
    if not value <= 3600:
        raise argparse.ArgumentTypeError(f"must be at most 3600 seconds, got {text!r}")
    return value


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``dashboards push`` to the ``kvwatch`` command's subparsers; returns ``dashboards``."""
    from kvwatch.commands.clihelp import Formatter

    dashboards: argparse.ArgumentParser = subparsers.add_parser(
        "dashboards",
        help="kvwatch's Grafana dashboards and alert rules",
        description="Put kvwatch's dashboards and Grafana alert rules into Grafana.",
        epilog="example:\n  kvwatch dashboards push --url https://grafana:3000 --token-file token",
        formatter_class=Formatter,
    )
    commands = dashboards.add_subparsers(dest="dashboards_command", required=True)
    p = commands.add_parser(
        "push",
        help="upload the dashboards and the Grafana alert rules to Grafana",
        description=(
            "Create the folder unless it exists, save every dashboard into it (the uid is the "
            "identity: a push replaces the previous version), and write the Grafana-managed "
            "alert rules as one rule group querying --datasource-uid. The token is a Grafana "
            "service-account token (Editor, or Admin for the alert rules), read from a file so "
            "that it never shows in ps or shell history."
        ),
        epilog=(
            "examples:\n  kvwatch dashboards push --url https://grafana.example.com:3000 "
            "--token-file /run/secrets/grafana-token"
        ),
        formatter_class=Formatter,
    )
    p.add_argument("--url", required=True, help="Grafana's base URL, e.g. https://grafana:3000")
    p.add_argument(
        "--token-file",
        required=True,
        type=Path,
        help="file holding a Grafana service-account token",
    )
    p.add_argument("--folder", default=DEFAULT_FOLDER, help="folder uid (default: %(default)s)")
    p.add_argument(
        "--folder-title", default=DEFAULT_FOLDER, help="folder title (default: %(default)s)"
    )
    p.add_argument(
        "--datasource-uid",
        default=DEFAULT_DATASOURCE_UID,
        help="uid of the Prometheus data source the alert rules query (default: %(default)s)",
    )
    p.add_argument(
        "--dashboards-dir",
        type=Path,
        help="folder of dashboard JSON to push (default: the dashboards installed with kvwatch)",
    )
    p.add_argument(
        "--alert-rules",
        type=Path,
        help="Grafana alert provisioning JSON (default: the rules installed with kvwatch)",
    )
    p.add_argument("--no-alert-rules", action="store_true", help="push the dashboards only")
    p.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=30.0,
        help="seconds per HTTP request (default: %(default)s)",
    )
    p.set_defaults(func=run, _parser=p)
    return dashboards


__all__ = ["PushError", "add_parser", "load_dashboards", "push", "rule_groups", "run"]
