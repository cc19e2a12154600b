"""The status page, for a node with no Grafana: the health model's headline and checks
(:mod:`kvwatch.expose.status`); pool against context for each engine role with the unsafe band
drawn; whose KV the latest incident's reader received (its sources); the latest incidents
(affected requests) from the journal, acknowledged ones marked. Server-rendered HTML with inline
SVG: no script, no external asset, refreshed by the browser every few seconds.
"""

from __future__ import annotations

import html
import socket
import time
from pathlib import Path

from kvspool.catalogue import unsafe_band
from kvspool.records import stopped_before_read
from kvwatch import __version__
from kvwatch.expose.metrics import engine_views
from kvwatch.expose.status import (
    LATEST_INCIDENTS,
    REFRESH_SECONDS,
    Alarm,
    acknowledgement,
    health,
    stale_views,
    summarize,
)
from kvwatch.store import incident as incident_model
from kvwatch.store.incident import Incident, finding_summary
from kvwatch.store.journal import AckRow, Journal, JournalError
from kvwatch.store.state import State


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _pool_chart(rows: list[tuple[tuple[str, ...], dict[str, float]]], stale: bool = False) -> str:
    if not rows:
        return '<p class="empty">No engine has reported its KV pool yet.</p>'
    if stale:
        return (
            '<p class="empty">No engine reports its KV pool now. Last known (stale: these '
            "engines are gone):</p>" + _pool_chart(rows)
        )
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


def _incidents_table(incidents: list[Incident], error: str | None, acks: list[AckRow]) -> str:
    if error:
        return f'<p class="bad">The journal could not be read: {_e(error)}</p>'
    if not incidents:
        return '<p class="empty">No incidents in the journal.</p>'
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "id", "first seen (UTC)", "node", "role", "engine", "request", "findings",
            "exposed", "pages", "acknowledged",
        )
    )  # fmt: skip
    rows = []
    for inc in incidents:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(inc["time"]))
        findings = ", ".join(finding_summary(f) for f in inc["findings"])
        ack = acknowledgement(acks, inc)
        acked = f"by {ack.by} at {time.strftime('%H:%M:%S', time.gmtime(ack.ts))}" if ack else "no"
        cells = (inc["id"], when, inc["node"], inc["role"], inc["engine"], inc["request_id"],
                 findings, inc["exposed"], inc["pages_total"], acked)  # fmt: skip
        cls = ' class="acked"' if ack else ""
        rows.append(f"<tr{cls}>" + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>")
    return f'<table id="incident-table"><tr>{head}</tr>{"".join(rows)}</table>'


def _latest_sources(incidents: list[Incident]) -> str:
    """Whose KV the latest incident's reader received: what the disclosure team asks first."""
    if not incidents:
        return '<p class="empty">No incidents in the journal.</p>'
    latest = incidents[0]
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(latest["time"]))
    detectors = ", ".join(latest["detectors"])
    said = (
        f"<p>Request <b>{_e(latest['request_id'])}</b> on {_e(latest['node']) or '-'} "
        f"(incident {_e(latest['id'])}, {_e(latest['role'])}, {_e(detectors)}, {_e(when)})"
    )
    if not latest["sources"] and not latest["other_sources"]:
        if any(stopped_before_read(f["detail"]) for f in latest["findings"]):
            return said + " was failed (enforce) before it read: nobody's KV reached it.</p>"
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
        f"{said} received the KV of {latest['exposed']:,} other request(s):</p>"
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
.empty{color:#777} tr.acked{color:#777}
"""


def render(
    state: State,
    alarm: Alarm,
    incidents: list[Incident],
    error: str | None = None,
    *,
    acks: list[AckRow] | None = None,
    node: str | None = None,
) -> str:
    """The page. ``incidents``: the latest first (:func:`latest_incidents`)."""
    h = health(state)
    summary = summarize(state, alarm)
    node = node or socket.gethostname()
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
    stale = "" if rows else _pool_chart(stale_views(state)[:4], stale=True)
    counts = alarm.counts
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{REFRESH_SECONDS}">
<title>kvwatch · {_e(node)}</title><style>{STYLE}</style></head>
<body>
<header>kvwatch {_e(__version__)} on node <b id="node">{_e(node)}</b> ·
 page made {time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())} ·
 <a href="/metrics">/metrics</a></header>
<section id="state" class="{summary.level}">
<h1>{_e(summary.headline)}</h1>
<ul id="checks">{checks}</ul>
<div>alarm ({_e(alarm.settings.describe())}): <span id="affected">{counts["affected"]:,}</span>
 affected request(s), <span id="exposed-count">{counts["exposed"]:,}</span> exposed
 request(s), <span id="acknowledged">{alarm.acknowledged:,}</span> acknowledged ·
 mismatches by detector (counters): <span id="by-detector">{_e(by_detector)}</span> ·
 live producers: {h.live_producers} · last record: {_e(last)} ·
 rejected records: {h.rejected_records:,.0f}</div>
</section>
<section id="pools"><h2>KV pool against context length</h2>
<p>Grey: the advertised context. Blue: the KV pool. Red: the unsafe band, prompts long enough to
pass the context check that the pool cannot hold.</p>
{_pool_chart(rows) if rows or not stale else ""}
{stale}
</section>
<section id="exposed"><h2>Exposed by the latest incident</h2>
{_latest_sources(incidents) if not error else ""}
</section>
<section id="incidents"><h2>Latest incidents (affected requests)</h2>
{_incidents_table(incidents, error, acks or [])}
</section>
</body></html>
"""


def latest_incidents(
    journal_path: str | Path,
) -> tuple[list[Incident], list[AckRow], str | None]:
    """The newest incidents (latest first) and the acknowledgements, read through a read-only
    connection of this request's own."""
    try:
        journal = Journal(journal_path, readonly=True)
    except (JournalError, OSError) as exc:
        return [], [], str(exc)
    try:
        grouped = incident_model.group(journal.incidents())
        return grouped[-LATEST_INCIDENTS:][::-1], journal.acks(), None
    except Exception as exc:  # the page must render even when the journal cannot be read
        return [], [], str(exc)
    finally:
        journal.close()
