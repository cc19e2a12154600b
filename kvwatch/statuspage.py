"""The daemon's status page at ``/``: the node's integrity at a glance, for a node with no Grafana.

Three parts: the integrity state (any mismatch, aborted admission or lost record turns it red),
pool against context for each engine role with the unsafe band drawn (like the incident's
checker), and the latest incidents from the journal. Server-rendered HTML with inline SVG: no
script, no external asset, refreshed by the browser every few seconds.
"""

from __future__ import annotations

import html
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvspool.catalogue import unsafe_band
from kvwatch import __version__
from kvwatch.journal import Journal, JournalError
from kvwatch.metrics import engine_views
from kvwatch.state import State

LATEST_INCIDENTS = 50
REFRESH_SECONDS = 5

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


@dataclass(frozen=True)
class Health:
    mismatches: dict[str, float]  # by detector
    aborted_admissions: float
    lost_records: float
    rejected_records: float
    live_producers: int
    last_record_ts: float

    @property
    def alarm(self) -> bool:
        return bool(sum(self.mismatches.values()) or self.aborted_admissions or self.lost_records)


def health(state: State) -> Health:
    with state.lock:
        totals = state.hook_counter_totals()
        mismatches: dict[str, float] = {}
        aborted = 0.0
        for (family, labels), value in totals.items():
            if family == "kvwatch_mismatches" and value:
                mismatches[labels[0]] = mismatches.get(labels[0], 0.0) + value
            elif family == "kvwatch_aborted_admissions":
                aborted += value
        lost = state.daemon.get(("spool_lost_records", ()), 0.0)
        rejected = sum(v for (n, _), v in state.daemon.items() if n == "spool_rejected")
        return Health(
            mismatches, aborted, lost, rejected, state.live_producers, state.last_record_ts
        )


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _pool_chart(rows: list[tuple[tuple[str, ...], dict[str, float]]]) -> str:
    if not rows:
        return '<p class="empty">No engine has reported its KV pool yet.</p>'
    scale = max(max(g.get("kv_pool_tokens", 0), g.get("context_length_tokens", 0)) for _, g in rows)
    scale = scale or 1.0
    width, bar = 720.0, 18
    parts = []
    for (role, engine, model, rank, source), gauges in rows:
        pool = gauges.get("kv_pool_tokens", 0.0)
        context = gauges.get("context_length_tokens", 0.0)
        band = unsafe_band(context, pool)
        share = band / context if context else 0.0
        pool_w, context_w = width * pool / scale, width * context / scale
        band_rect = ""
        if band > 0:
            band_rect = (
                f'<rect class="band" x="{pool_w:.1f}" y="0" width="{context_w - pool_w:.1f}" '
                f'height="{2 * bar + 4}"><title>unsafe band: {band:,.0f} tokens</title></rect>'
            )
        verdict = (
            f'<span class="bad">unsafe band {band:,.0f} tokens ({share:.0%} of the window): '
            f"prompts of {pool + 1:,.0f} to {context:,.0f} tokens pass the context check but "
            "do not fit the pool</span>"
            if band > 0
            else '<span class="good">the pool holds the whole context</span>'
        )
        parts.append(
            f'<div class="pool-row" data-role="{_e(role)}" data-band="{band:.0f}">'
            f'<div class="label">{_e(role)} · {_e(engine)} · {_e(model) or "-"} · rank '
            f"{_e(rank)} · from {_e(source)}</div>"
            f'<svg width="{width + 2:.0f}" height="{2 * bar + 6}" role="img" '
            f'aria-label="pool {pool:,.0f} tokens, context {context:,.0f} tokens">'
            f'<rect class="context" x="0" y="0" width="{context_w:.1f}" height="{bar}"/>'
            f'<rect class="pool" x="0" y="{bar + 4}" width="{pool_w:.1f}" height="{bar}"/>'
            f"{band_rect}</svg>"
            f'<div class="numbers">pool {pool:,.0f} · context {context:,.0f} · {verdict}</div>'
            "</div>"
        )
    return "\n".join(parts)


def _incidents_table(incidents: list[dict[str, Any]], error: str | None) -> str:
    if error:
        return f'<p class="bad">The journal could not be read: {_e(error)}</p>'
    if not incidents:
        return '<p class="empty">No incidents in the journal.</p>'
    head = "".join(
        f"<th>{h}</th>"
        for h in ("time (UTC)", "node", "role", "engine", "request", "detector", "kind", "pages")
    )
    rows = []
    for inc in incidents:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(inc["time"]))
        pages = ",".join(str(p) for p in inc["pages"][:16])
        if inc["pages_total"] > 16:
            pages += f" (+{inc['pages_total'] - 16})"
        cells = (when, inc["node"], inc["role"], inc["engine"], inc["request_id"],
                 inc["detector"], inc["kind"], pages)  # fmt: skip
        rows.append("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>")
    return f'<table id="incident-table"><tr>{head}</tr>{"".join(rows)}</table>'


STYLE = """
body{font:14px system-ui,sans-serif;margin:24px;color:#1d2330;background:#f6f7f9}
header{color:#5a6270;margin-bottom:16px}
section{background:#fff;border-radius:8px;padding:16px 20px;margin-bottom:16px;
 box-shadow:0 1px 2px rgba(0,0,0,.08)}
#state.ok{border-left:8px solid #2e9e5b} #state.alarm{border-left:8px solid #d33a2c}
#state h1{margin:0 0 6px;font-size:22px}
.bad{color:#c0281b;font-weight:600} .good{color:#23804a}
rect.context{fill:#c7cdd6} rect.pool{fill:#3b6fd4}
rect.band{fill:#d33a2c;fill-opacity:.25;stroke:#d33a2c;stroke-dasharray:4 3}
.pool-row{margin:10px 0} .label{font-weight:600;margin-bottom:4px} .numbers{color:#444}
table{border-collapse:collapse;width:100%} th,td{text-align:left;padding:4px 8px;
 border-bottom:1px solid #e3e6ea;font-variant-numeric:tabular-nums}
.empty{color:#777}
"""


def render(state: State, incidents: list[dict[str, Any]], error: str | None = None) -> str:
    h = health(state)
    if h.alarm:
        total = sum(h.mismatches.values())
        headline = f"INTEGRITY ALERT: {total:,.0f} KV mismatch(es)"
        if h.aborted_admissions:
            headline += f", {h.aborted_admissions:,.0f} aborted request(s) admitted"
        if h.lost_records:
            headline += f", {h.lost_records:,.0f} spool record(s) lost"
    else:
        headline = "Integrity OK: no KV mismatch, no aborted admission, no lost record"
    by_detector = ", ".join(f"{d}: {v:,.0f}" for d, v in sorted(h.mismatches.items())) or "none"
    last = (
        time.strftime("%H:%M:%S UTC", time.gmtime(h.last_record_ts))
        if h.last_record_ts
        else "never"
    )
    latest, _info = engine_views(state)
    rows = sorted(latest.items())
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{REFRESH_SECONDS}">
<title>kvwatch · {_e(socket.gethostname())}</title><style>{STYLE}</style></head>
<body>
<header>kvwatch {_e(__version__)} on <b>{_e(socket.gethostname())}</b> ·
 page made {time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())} ·
 <a href="/metrics">/metrics</a></header>
<section id="state" class="{"alarm" if h.alarm else "ok"}">
<h1>{_e(headline)}</h1>
<div>mismatches by detector: <span id="by-detector">{_e(by_detector)}</span> ·
 live producers: {h.live_producers} · last record: {_e(last)} ·
 rejected records: {h.rejected_records:,.0f}</div>
</section>
<section id="pools"><h2>KV pool against context length</h2>
<p>Grey: the advertised context. Blue: the KV pool. Red: the unsafe band, prompts long enough to
pass the context check that the pool cannot hold.</p>
{_pool_chart(rows)}
</section>
<section id="incidents"><h2>Latest incidents</h2>
{_incidents_table(incidents, error)}
</section>
</body></html>
"""


def latest_incidents(journal_path: str | Path) -> tuple[list[dict[str, Any]], str | None]:
    """The newest incidents, read through a read-only connection of this request's own."""
    try:
        journal = Journal(journal_path, readonly=True)
    except (JournalError, OSError) as exc:
        return [], str(exc)
    try:
        return journal.incidents()[-LATEST_INCIDENTS:][::-1], None
    except Exception as exc:  # the page must render even when the journal cannot be read
        return [], str(exc)
    finally:
        journal.close()


def make_app(metrics_app: WsgiApp, state: State, journal_path: str | Path) -> WsgiApp:
    """``/`` is the status page; everything else goes to the Prometheus exposition app."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "/") not in ("/", "/index.html"):
            return metrics_app(environ, start_response)
        incidents, error = latest_incidents(journal_path)
        body = render(state, incidents, error).encode()
        start_response(
            "200 OK",
            [("Content-Type", "text/html; charset=utf-8"), ("Content-Length", str(len(body)))],
        )
        return [body]

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
