"""``kvwatch dashboards push`` against a real HTTP server on 127.0.0.1 that answers like Grafana.

grafana-client is not mocked: it sends real HTTP requests, which the server records.
"""

from __future__ import annotations

import argparse
import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from alerts import definitions
from kvwatch.commands import dashboards_push

REPO = Path(__file__).resolve().parents[2]
TOKEN = "glsa_kvwatch_test_token_0123456789"


@dataclass
class FakeGrafana:
    """Records every request; folders and dashboards are kept so a second push sees them."""

    url: str = ""
    requests: list[tuple[str, str, dict[str, str], Any]] = field(default_factory=list)
    folders: set[str] = field(default_factory=set)
    reject_auth: bool = False


def _handler(state: FakeGrafana) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def _reply(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            headers = {k.lower(): v for k, v in self.headers.items()}
            state.requests.append((self.command, self.path, headers, body))
            if state.reject_auth or headers.get("authorization") != f"Bearer {TOKEN}":
                self._reply(401, {"message": "invalid API key"})
                return
            if self.command == "GET" and self.path.startswith("/api/folders/"):
                uid = self.path.rsplit("/", 1)[1]
                if uid in state.folders:
                    self._reply(200, {"uid": uid, "title": uid})
                else:
                    self._reply(404, {"message": "folder not found"})
            elif self.command == "POST" and self.path == "/api/folders":
                assert isinstance(body, dict)
                state.folders.add(body["uid"])
                self._reply(200, {"uid": body["uid"], "title": body["title"]})
            elif self.command == "POST" and self.path == "/api/dashboards/db":
                assert isinstance(body, dict)
                uid = body["dashboard"]["uid"]
                self._reply(200, {"status": "success", "uid": uid, "url": f"/d/{uid}/x"})
            elif self.command == "PUT" and self.path.startswith("/api/v1/provisioning/folder/"):
                self._reply(200, body)
            else:
                self._reply(404, {"message": "not found"})

        do_GET = do_POST = do_PUT = _handle  # noqa: N815 (http.server's naming)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@pytest.fixture
def grafana(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGrafana]:
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    state = FakeGrafana()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def _cli(argv: list[str]) -> argparse.Namespace:
    """The wiring the kvwatch CLI uses: ``dashboards_push.add_parser(subparsers)``."""
    parser = argparse.ArgumentParser(prog="kvwatch")
    dashboards_push.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def _push(grafana: FakeGrafana, tmp_path: Path, *extra: str) -> int:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    args = _cli(["dashboards", "push", "--url", grafana.url, "--token-file", str(token), *extra])
    result: int = args.func(args)
    return result


def test_push_uploads_dashboards_and_alert_rules(
    grafana: FakeGrafana, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _push(grafana, tmp_path, "--datasource-uid", "prom-main") == 0
    calls = [(method, path) for method, path, _, _ in grafana.requests]
    assert calls == [
        ("GET", "/api/folders/kvwatch"),
        ("POST", "/api/folders"),
        ("POST", "/api/dashboards/db"),
        ("POST", "/api/dashboards/db"),
        ("PUT", "/api/v1/provisioning/folder/kvwatch/rule-groups/kvwatch"),
    ]
    for _, _, headers, _ in grafana.requests:
        assert headers["authorization"] == f"Bearer {TOKEN}"

    committed = {
        json.loads(p.read_text())["uid"]: json.loads(p.read_text())
        for p in (REPO / "dashboards").glob("*.json")
    }
    sent = [body for _, path, _, body in grafana.requests if path == "/api/dashboards/db"]
    assert (
        {b["dashboard"]["uid"] for b in sent}
        == set(committed)
        == {
            "kvwatch-overview",
            "kvwatch-node",
        }
    )
    for body in sent:
        assert body["folderUid"] == "kvwatch" and body["overwrite"] is True
        board = body["dashboard"]
        assert board["id"] is None
        assert {k: v for k, v in board.items() if k != "id"} == committed[board["uid"]]

    group = grafana.requests[-1][3]
    assert group["title"] == "kvwatch" and group["folderUid"] == "kvwatch"
    assert group["interval"] == 15
    assert [r["title"] for r in group["rules"]] == [a.name for a in definitions.ALERTS]
    for rule in group["rules"]:
        assert rule["folderUID"] == "kvwatch" and rule["ruleGroup"] == "kvwatch"
        assert rule["orgID"] == 1
        query, *expressions = rule["data"]
        assert query["datasourceUid"] == "prom-main"
        assert query["model"]["datasource"]["uid"] == "prom-main"
        # Expressions, and the queries a description states a second number from
        # (definitions.Context): those point at the data source too.
        for e in expressions:
            assert e["datasourceUid"] in ("__expr__", "prom-main"), e
            if e["datasourceUid"] == "prom-main":
                assert e["model"]["datasource"]["uid"] == "prom-main"

    out = capsys.readouterr().out
    assert "folder kvwatch: created" in out
    assert "dashboard kvwatch-overview: saved /d/kvwatch-overview/x" in out
    assert f"alert rule group kvwatch: {len(definitions.ALERTS)} rules saved" in out

    # A second push finds the folder and overwrites the same uids.
    grafana.requests.clear()
    assert _push(grafana, tmp_path) == 0
    assert [(m, p) for m, p, _, _ in grafana.requests][:2] == [
        ("GET", "/api/folders/kvwatch"),
        ("POST", "/api/dashboards/db"),
    ]
    rules = grafana.requests[-1][3]["rules"]
    assert rules[0]["data"][0]["datasourceUid"] == "prometheus"


def test_dashboards_only(grafana: FakeGrafana, tmp_path: Path) -> None:
    assert _push(grafana, tmp_path, "--no-alert-rules", "--folder", "ops") == 0
    paths = [path for _, path, _, _ in grafana.requests]
    assert paths == ["/api/folders/ops", "/api/folders", "/api/dashboards/db", "/api/dashboards/db"]


def test_rejected_token_is_a_clear_error(
    grafana: FakeGrafana, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    grafana.reject_auth = True
    assert _push(grafana, tmp_path) == 1
    err = capsys.readouterr().err
    assert "kvwatch dashboards push: Grafana at http://127.0.0.1:" in err
    assert len(grafana.requests) == 1


def test_unreachable_grafana_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    port = server.server_address[1]
    server.server_close()  # nothing listens there now
    state = FakeGrafana(url=f"http://127.0.0.1:{port}")
    assert _push(state, tmp_path, "--timeout", "5") == 1
    assert "kvwatch dashboards push: Grafana at" in capsys.readouterr().err


def test_bad_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    args = _cli(["dashboards", "push", "--url", "http://127.0.0.1:9", "--token-file", str(empty)])
    assert args.func(args) == 1
    assert "is empty" in capsys.readouterr().err
    token = tmp_path / "token"
    token.write_text(TOKEN)
    args = _cli(
        [
            "dashboards",
            "push",
            "--url",
            "http://127.0.0.1:9",
            "--token-file",
            str(token),
            "--dashboards-dir",
            str(tmp_path),
        ]
    )
    assert args.func(args) == 1
    assert "no dashboard JSON" in capsys.readouterr().err
    missing = _cli(["dashboards", "push", "--url", "x", "--token-file", str(tmp_path / "nope")])
    assert missing.func(missing) == 1


def test_push_module_does_not_import_torch() -> None:
    code = (
        "import sys, kvwatch.commands.dashboards_push as m, grafana_client.api; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
