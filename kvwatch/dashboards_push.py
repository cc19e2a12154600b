"""``kvwatch dashboards push``: upload kvwatch's dashboards and Grafana alert rules to Grafana.

    kvwatch dashboards push --url https://grafana.example.com --token-file /run/secrets/grafana

Through grafana-client (the ``dashboards`` extra), against Grafana's HTTP API:

1. the folder (uid and title ``kvwatch`` by default) is created unless it exists;
2. every ``*.json`` dashboard in ``--dashboards-dir`` is saved into it (``overwrite``: the uid is
   the identity, so a push replaces the previous version);
3. the Grafana-managed alert rules (``alerts/grafana/kvwatch-alert-rules.json``, generated from the
   same definitions as the Prometheus rules) are written as one rule group in that folder, each
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

_CHECKOUT = Path(__file__).resolve().parent.parent
DEFAULT_DASHBOARDS = _CHECKOUT / "dashboards"
DEFAULT_ALERT_RULES = _CHECKOUT / "alerts" / "grafana" / "kvwatch-alert-rules.json"
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
            "kvwatch dashboards push needs grafana-client: pip install 'kvwatch[dashboards]'",
            file=sys.stderr,
        )
        return 2
    import niquests

    try:
        token = args.token_file.read_text(encoding="utf-8").strip()
        if not token:
            raise PushError(f"{args.token_file} is empty")
        boards = load_dashboards(args.dashboards_dir)
        groups: list[dict[str, Any]] = []
        if not args.no_alert_rules:
            try:
                provisioning = json.loads(args.alert_rules.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise PushError(f"{args.alert_rules}: {e} (pass --alert-rules)") from e
            groups = rule_groups(provisioning, args.folder, args.datasource_uid)
        api: Any = GrafanaApi.from_url(args.url, credential=token, timeout=args.timeout)
        for line in push(api, boards, groups, args.folder, args.folder_title):
            print(line)
    except (GrafanaException, niquests.exceptions.RequestException) as e:
        # Before OSError: niquests' connection errors are OSErrors too.
        print(f"kvwatch dashboards push: Grafana at {args.url}: {e}", file=sys.stderr)
        return 1
    except (OSError, PushError) as e:
        print(f"kvwatch dashboards push: {e}", file=sys.stderr)
        return 1
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``dashboards push`` to the ``kvwatch`` command's subparsers; returns ``dashboards``."""
    dashboards: argparse.ArgumentParser = subparsers.add_parser(
        "dashboards", help="kvwatch's Grafana dashboards and alert rules"
    )
    commands = dashboards.add_subparsers(dest="dashboards_command", required=True)
    p = commands.add_parser(
        "push",
        help="upload the dashboards and the Grafana alert rules to Grafana",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    p.add_argument("--dashboards-dir", type=Path, default=DEFAULT_DASHBOARDS)
    p.add_argument("--alert-rules", type=Path, default=DEFAULT_ALERT_RULES)
    p.add_argument("--no-alert-rules", action="store_true", help="push the dashboards only")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per HTTP request")
    p.set_defaults(func=run)
    return dashboards


__all__ = ["PushError", "add_parser", "load_dashboards", "push", "rule_groups", "run"]
