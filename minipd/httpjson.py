"""JSON over HTTP between minipd's processes and for clients: a threaded server, a client."""

from __future__ import annotations

import http.client
import json
import threading
import traceback
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

Body = dict[str, Any]
Route = Callable[[Body], tuple[int, Body]]

MAX_BODY_BYTES = 256 << 20


def error(status: int, message: str) -> tuple[int, Body]:
    """SGLang's error shape."""
    return status, {"error": {"message": message, "code": status}}


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        return  # requests are logged by the roles, without their content

    def _reply(self, status: int, body: Body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _dispatch(self, method: str) -> None:
        path = urlsplit(self.path).path
        route = self.server.routes.get((method, path))
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self._reply(*error(413, "request body too large"))
            self.close_connection = True
            return
        raw = self.rfile.read(length) if length else b""
        if route is None:
            self._reply(*error(404, f"no route {method} {path}"))
            return
        try:
            body = json.loads(raw) if raw else {}
            if not isinstance(body, dict):
                raise ValueError("body is not a JSON object")
        except ValueError as exc:
            self._reply(*error(400, f"invalid JSON: {exc}"))
            return
        try:
            status, reply = route(body)
        except Exception as exc:
            traceback.print_exc()
            status, reply = error(500, f"internal error: {type(exc).__name__}")
        self._reply(status, reply)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the stdlib's 5 resets connections under concurrent load
    routes: dict[tuple[str, str], Route]


class JsonServer:
    def __init__(self, host: str, port: int, routes: dict[tuple[str, str], Route]) -> None:
        self._server = _Server((host, port), _Handler)
        self._server.routes = routes
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def call(
    base_url: str, path: str, body: Body | None = None, *, timeout: float = 60.0
) -> tuple[int, Body]:
    """POST ``body`` (or GET when None) and return (status, JSON reply).

    A connection failure comes back as status 502 with an error body, never an exception.
    """
    parts = urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        if body is None:
            conn.request("GET", path)
        else:
            data = json.dumps(body).encode()
            conn.request("POST", path, data, {"Content-Type": "application/json"})
        response = conn.getresponse()
        raw = response.read()
        try:
            reply = json.loads(raw) if raw else {}
        except ValueError:
            reply = {}
        return response.status, reply if isinstance(reply, dict) else {}
    except (OSError, http.client.HTTPException) as exc:
        return error(502, f"{base_url}{path} unreachable: {type(exc).__name__}")
    finally:
        conn.close()


def message(reply: Body) -> str:
    err = reply.get("error")
    if isinstance(err, dict):
        return str(err.get("message", ""))
    return str(err or "")
