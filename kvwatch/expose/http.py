"""The daemon's HTTP surface: ``/metrics`` (Prometheus), ``/`` (the status page; JSON with
``Accept: application/json``, which ``kvwatch status`` reads), ``/-/healthy`` (the process
serves), ``/-/ready`` (the journal is open, the first poll committed and the last one could
write the journal; else 503 and why); anything else is 404.
Plain HTTP or TLS (a client certificate required when a CA is given).
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvwatch.expose.page import latest_incidents, render
from kvwatch.expose.status import AlarmSettings, WsgiApp, read_alarm, summarize
from kvwatch.store.state import State


def _reply(
    start_response: Callable[..., Any], status: str, content_type: str, body: bytes
) -> list[bytes]:
    start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body)))])
    return [body]


def make_app(
    metrics_app: WsgiApp,
    state: State,
    journal_path: str | Path,
    ready: Callable[[], bool] = lambda: True,
    *,
    settings: AlarmSettings | None = None,
    node: str | None = None,
) -> WsgiApp:
    """The four paths (module docstring); 404 for anything else."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        text = "text/plain; charset=utf-8"
        if path == "/metrics":
            return metrics_app(environ, start_response)
        if path == "/-/healthy":
            return _reply(start_response, "200 OK", text, b"kvwatch is healthy.\n")
        if path == "/-/ready":
            with state.lock:
                problem, journal_failing = state.poll_problem, state.journal_failing
            if ready() and not journal_failing:
                return _reply(start_response, "200 OK", text, b"kvwatch is ready.\n")
            why = problem if journal_failing else "the first poll has not committed yet"
            if problem and not journal_failing:
                why += f" ({problem})"
            return _reply(
                start_response,
                "503 Service Unavailable",
                text,
                f"kvwatch is not ready: {why}.\n".encode(),
            )
        if path != "/":
            return _reply(
                start_response,
                "404 Not Found",
                text,
                b"404: kvwatch serves /metrics, / (status), /-/healthy and /-/ready.\n",
            )
        alarm = read_alarm(journal_path, settings or AlarmSettings())
        if "application/json" in environ.get("HTTP_ACCEPT", ""):
            summary = summarize(state, alarm).as_dict()
            summary["integrity"] = alarm.as_dict()
            summary["node"] = node or socket.gethostname()
            body = json.dumps(summary, sort_keys=True).encode()
            return _reply(start_response, "200 OK", "application/json", body)
        incidents, acks, error = latest_incidents(journal_path)
        body = render(state, alarm, incidents, error, acks=acks, node=node).encode()
        return _reply(start_response, "200 OK", "text/html; charset=utf-8", body)

    return app


def serve_wsgi(host: str, port: int, app: WsgiApp, tls: dict[str, Any]) -> Any:
    """Serve ``app`` from a daemon thread, as prometheus_client's ``start_http_server`` does
    (same threading server, quiet handler, TLS context with optional client certificates)."""
    from wsgiref.simple_server import make_server

    from prometheus_client.exposition import (
        ThreadingWSGIServer,
        _get_best_family,
        _get_ssl_ctx,
        _SilentHandler,
    )

    class Server(ThreadingWSGIServer):
        pass

    Server.address_family, addr = _get_best_family(host, port)  # type: ignore[no-untyped-call]
    httpd = make_server(addr, port, app, Server, handler_class=_SilentHandler)
    if tls:
        context = _get_ssl_ctx(
            tls["certfile"],
            tls["keyfile"],
            ssl.PROTOCOL_TLS_SERVER,
            tls.get("client_cafile"),
            None,
            tls.get("client_auth_required", False),
        )
        httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True, name="kvwatch-http").start()
    return httpd
