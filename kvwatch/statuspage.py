"""The daemon's HTTP surface and its status page, for a node with no Grafana.

Paths: ``/metrics`` (Prometheus), ``/`` (this page; JSON with ``Accept: application/json``, which
``kvwatch status`` reads), ``/-/healthy`` (the process serves), ``/-/ready`` (the journal is
open and the first poll committed); anything else is 404.

The page: a headline that is the worst of five checks (integrity; spool access: segments left
unread, by owner; the unsafe band; coverage: a
live producer, a detector that verifies, the spool present; freshness of the last record), each
with the line an on-call needs; pool against context for each engine role with the unsafe band
drawn; whose KV the latest incident's reader received (its sources); the latest incidents from
the journal. Server-rendered HTML with inline SVG: no script,
no external asset, refreshed by the browser every few seconds.
"""

from __future__ import annotations

import html
import json
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvspool.catalogue import unsafe_band
from kvwatch import __version__
from kvwatch.incidents import exposed_count
from kvwatch.journal import Journal, JournalError
from kvwatch.metrics import engine_views
from kvwatch.state import State

LATEST_INCIDENTS = 50
REFRESH_SECONDS = 5
#: With a live producer, no record for this long means the hooks or the daemon have stalled.
STALE_SECONDS = 120.0
#: Check levels, best to worst; the headline takes the worst.
LEVELS = ("ok", "warning", "alarm")

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
        # The events the journal holds count too: a producer whose counter snapshot never
        # came (an engine killed right after the event) must not read "no KV mismatch".
        incidents: dict[str, float] = {}
        for (name, labels), value in state.daemon.items():
            if name == "incidents" and value:
                incidents[labels[0]] = incidents.get(labels[0], 0.0) + value
        for detector, value in incidents.items():
            mismatches[detector] = max(mismatches.get(detector, 0.0), value)
        lost = state.daemon.get(("spool_lost_records", ()), 0.0)
        rejected = sum(v for (n, _), v in state.daemon.items() if n == "spool_rejected")
        return Health(
            mismatches, aborted, lost, rejected, state.live_producers, state.last_record_ts
        )


@dataclass(frozen=True)
class Check:
    name: str  # integrity, unsafe_band, coverage, freshness
    level: str  # one of LEVELS
    line: str  # what an on-call needs to read


@dataclass(frozen=True)
class Summary:
    checks: tuple[Check, ...]

    @property
    def level(self) -> str:
        return max((c.level for c in self.checks), key=LEVELS.index)

    @property
    def headline(self) -> str:
        worst = [c for c in self.checks if c.level == self.level]
        if self.level == "ok":
            return "OK: " + "; ".join(c.line for c in worst[:1])
        return f"{self.level.upper()}: {worst[0].line}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "level": self.level,
            "headline": self.headline,
            "checks": [{"name": c.name, "level": c.level, "line": c.line} for c in self.checks],
        }


def summarize(state: State, now: float | None = None) -> Summary:
    """The five checks, from the daemon's state alone."""
    now = time.time() if now is None else now
    h = health(state)
    checks = [
        _integrity(h),
        spool_access(state),
        _band(state),
        _coverage(state, h),
        _freshness(h, now),
    ]
    return Summary(tuple(checks))


def _integrity(h: Health) -> Check:
    if not h.alarm:
        return Check(
            "integrity", "ok", "integrity: no KV mismatch, no aborted admission, no lost record"
        )
    parts = []
    if h.mismatches:
        by = ", ".join(f"{d} {v:,.0f}" for d, v in sorted(h.mismatches.items()))
        parts.append(f"{sum(h.mismatches.values()):,.0f} KV mismatch(es) ({by})")
    if h.aborted_admissions:
        parts.append(f"{h.aborted_admissions:,.0f} aborted request(s) admitted")
    if h.lost_records:
        parts.append(f"{h.lost_records:,.0f} spool record(s) lost")
    return Check(
        "integrity",
        "alarm",
        "INTEGRITY ALERT: " + ", ".join(parts) + "; see kvwatch incidents --exposed",
    )


def spool_access(state: State) -> Check:
    """Segments the daemon leaves unread, by owner: an alarm when findings sit in them or no
    producer's segments are read at all (nothing on the node is verified), else a warning."""
    with state.lock:
        ignored = list(state.ignored.values())
        live = state.live_producers
    if not ignored:
        return Check("spool_access", "ok", "every segment in the spool is read")
    owners = Counter((i.user, i.uid, i.reason) for i in ignored)
    parts = [
        f"{n} spool segment(s) of {user} (uid {uid}) "
        + ("ignored: that user may not write the spool" if why == "owner" else "unreadable")
        for (user, uid, why), n in sorted(owners.items(), key=lambda kv: (-kv[1], kv[0]))
    ]
    findings = sum(i.findings for i in ignored)
    line = "; ".join(parts)
    if findings:
        line += f"; {findings:,} finding(s) in them are not in the journal"
    elif not live:
        line += "; no producer's segments are read: nothing on this node is verified"
    fixes = {
        "owner": "add that user to the spool folder's group or to allowed_users",
        "unreadable": "make the spool folder setgid with the daemon's group (mode 2770)",
    }
    line += f" ({'; '.join(fixes[r] for r in sorted({i.reason for i in ignored}))})"
    return Check("spool_access", "alarm" if findings or not live else "warning", line)


def _band(state: State) -> Check:
    latest, _ = engine_views(state)
    worst: tuple[float, str] | None = None
    for (role, engine, _model, _rank, _source), gauges in latest.items():
        pool = gauges.get("kv_pool_tokens", 0.0)
        context = gauges.get("context_length_tokens", 0.0)
        if context > pool > 0:
            share = (context - pool) / context
            line = (
                f"unsafe band on {role} ({engine}): prompts of {pool + 1:,.0f} to "
                f"{context:,.0f} tokens ({share:.0%} of the window) pass the context check but "
                "do not fit the KV pool; lower the context length or grow the pool"
            )
            if worst is None or share > worst[0]:
                worst = (share, line)
    if worst is None:
        return Check("unsafe_band", "ok", "every reporting engine's pool holds its context")
    return Check("unsafe_band", "warning", worst[1])


def _coverage(state: State, h: Health) -> Check:
    with state.lock:
        spool_ok = state.collectors.get("spool", (True, 0.0))[0]
        totals = state.hook_counter_totals()
    if not spool_ok:
        return Check(
            "coverage",
            "warning",
            "the spool folder is missing or unreadable: nothing is verified "
            "(see the daemon's log; the engines create it when they start)",
        )
    if h.live_producers == 0:
        return Check(
            "coverage",
            "warning",
            "no live producer: no engine hook is writing to the spool, nothing is verified",
        )
    verified: dict[str, float] = {}
    skipped: dict[str, float] = {}
    for (family, labels), value in totals.items():
        if family == "kvwatch_verifications":
            verified[labels[0]] = verified.get(labels[0], 0.0) + value
        elif family == "kvwatch_verifications_skipped" and labels[-1] != "mode_off":
            # labels: (detector, role, reason), as state.HOOK_COUNTERS names them
            skipped[labels[0]] = skipped.get(labels[0], 0.0) + value
    idle = sorted(d for d, n in skipped.items() if n and not verified.get(d))
    if idle:
        return Check(
            "coverage",
            "warning",
            f"detector {', '.join(idle)} verifies nothing: every request is skipped "
            "(kvwatch_verifications_skipped_total says why)",
        )
    return Check("coverage", "ok", f"{h.live_producers} live producer(s), every detector verifies")


def _freshness(h: Health, now: float) -> Check:
    if not h.last_record_ts:
        return Check("freshness", "ok" if not h.live_producers else "warning", "no record yet")
    age = max(0.0, now - h.last_record_ts)
    if h.live_producers and age > STALE_SECONDS:
        return Check(
            "freshness",
            "warning",
            f"last record {age:,.0f}s ago although {h.live_producers} producer(s) are live: "
            "the hooks or the daemon have stalled",
        )
    return Check("freshness", "ok", f"last record {age:,.0f}s ago")


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
        for h in (
            "time (UTC)", "node", "role", "engine", "request", "detector", "kind", "sources",
            "pages",
        )
    )  # fmt: skip
    rows = []
    for inc in incidents:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(inc["time"]))
        pages = ",".join(str(p) for p in inc["pages"][:16])
        if inc["pages_total"] > 16:
            pages += f" (+{inc['pages_total'] - 16})"
        cells = (when, inc["node"], inc["role"], inc["engine"], inc["request_id"],
                 inc["detector"], inc["kind"], exposed_count(inc), pages)  # fmt: skip
        rows.append("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>")
    return f'<table id="incident-table"><tr>{head}</tr>{"".join(rows)}</table>'


def _latest_sources(incidents: list[dict[str, Any]]) -> str:
    """Whose KV the latest incident's reader received: what the disclosure team asks first."""
    if not incidents:
        return '<p class="empty">No incidents in the journal.</p>'
    latest = incidents[0]
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(latest["time"]))
    said = (
        f"<p>Request <b>{_e(latest['request_id'])}</b> on {_e(latest['node']) or '-'} "
        f"({_e(latest['role'])}, {_e(latest['detector'])} {_e(latest['kind'])}, {_e(when)})"
    )
    if not latest["sources"] and not latest["other_sources"]:
        return said + " named no sources: the detector cannot tell whose data the pages held.</p>"
    items = "".join(
        f'<li data-source="{_e(s["request_id"])}">{_e(s["request_id"])}'
        f"{' (' + _e(s['instance']) + ')' if s['instance'] else ''}: {s['pages']:,} page(s)</li>"
        for s in latest["sources"]
    )
    if latest["other_sources"]:
        items += (
            f"<li>and {latest['other_sources']:,} more request(s):"
            f" {latest['other_source_pages']:,} page(s)</li>"
        )
    return (
        f"{said} received the KV of {exposed_count(latest):,} other request(s):</p>"
        f'<ul id="source-list">{items}</ul>'
        "<p>All of them, for a time range: <code>kvwatch incidents --exposed --since 24h</code></p>"
    )


STYLE = """
body{font:14px system-ui,sans-serif;margin:24px;color:#1d2330;background:#f6f7f9}
header{color:#5a6270;margin-bottom:16px}
section{background:#fff;border-radius:8px;padding:16px 20px;margin-bottom:16px;
 box-shadow:0 1px 2px rgba(0,0,0,.08)}
#state.ok{border-left:8px solid #2e9e5b} #state.alarm{border-left:8px solid #d33a2c}
#state.warning{border-left:8px solid #d99a00} li.warning{color:#8a5d00} li.alarm{color:#c0281b}
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
    summary = summarize(state)
    checks = "".join(
        f'<li class="{c.level}" data-check="{c.name}">{_e(c.line)}</li>' for c in summary.checks
    )
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
<section id="state" class="{summary.level}">
<h1>{_e(summary.headline)}</h1>
<ul id="checks">{checks}</ul>
<div>mismatches by detector: <span id="by-detector">{_e(by_detector)}</span> ·
 live producers: {h.live_producers} · last record: {_e(last)} ·
 rejected records: {h.rejected_records:,.0f}</div>
</section>
<section id="pools"><h2>KV pool against context length</h2>
<p>Grey: the advertised context. Blue: the KV pool. Red: the unsafe band, prompts long enough to
pass the context check that the pool cannot hold.</p>
{_pool_chart(rows)}
</section>
<section id="exposed"><h2>Exposed by the latest incident</h2>
{_latest_sources(incidents) if not error else ""}
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
            if ready():
                return _reply(start_response, "200 OK", text, b"kvwatch is ready.\n")
            return _reply(
                start_response,
                "503 Service Unavailable",
                text,
                b"kvwatch is not ready: the first poll has not committed yet.\n",
            )
        if path != "/":
            return _reply(
                start_response,
                "404 Not Found",
                text,
                b"404: kvwatch serves /metrics, / (status), /-/healthy and /-/ready.\n",
            )
        if "application/json" in environ.get("HTTP_ACCEPT", ""):
            body = json.dumps(summarize(state).as_dict(), sort_keys=True).encode()
            return _reply(start_response, "200 OK", "application/json", body)
        incidents, error = latest_incidents(journal_path)
        body = render(state, incidents, error).encode()
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
