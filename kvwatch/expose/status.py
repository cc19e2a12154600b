"""The daemon's HTTP surface and its status page, for a node with no Grafana.

Paths: ``/metrics`` (Prometheus), ``/`` (this page; JSON with ``Accept: application/json``, which
``kvwatch status`` reads), ``/-/healthy`` (the process serves), ``/-/ready`` (the journal is
open and the first poll committed); anything else is 404.

The page: a headline that is the worst of five checks (integrity: the journal's unacknowledged
incidents in the alarm's window, as affected and exposed requests, and lost records; spool access:
segments left unread, by owner; the unsafe band, an alarm as its rule is critical, stale once no
engine reports; coverage: a live producer, a detector that verifies, the spool present; freshness
of the last record), each with the line an on-call needs; pool against context for each engine role
with the unsafe band drawn; whose KV the latest incident's reader received (its sources); the
latest incidents (affected requests) from the journal, acknowledged ones marked. Server-rendered
HTML with inline SVG: no script, no external asset, refreshed by the browser every few seconds.
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
from kvspool.records import stopped_before_read
from kvwatch import __version__
from kvwatch.expose.metrics import engine_views
from kvwatch.store import incident as incident_model
from kvwatch.store.journal import AckRow, Journal, JournalError
from kvwatch.store.state import State

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


@dataclass(frozen=True)
class AlarmSettings:
    """How long an incident raises the integrity alarm (config ``alarm_window``,
    ``alarm_until_ack``)."""

    window: float = 300.0
    until_ack: bool = False

    def describe(self) -> str:
        return "until acknowledged" if self.until_ack else f"last {_duration(self.window)}"


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


@dataclass(frozen=True)
class Alarm:
    """The integrity alarm, from the journal: the incidents (affected request instances) and
    lost records it covers, those an operator acknowledged set apart."""

    settings: AlarmSettings
    #: Unacknowledged incidents in the alarm's scope (:func:`kvwatch.store.incident.group`).
    open: tuple[dict[str, Any], ...] = ()
    acknowledged: int = 0
    lost_records: int = 0
    error: str | None = None

    @property
    def counts(self) -> dict[str, int]:
        return incident_model.counts(list(self.open))

    @property
    def raised(self) -> bool:
        return bool(self.open or self.lost_records or self.error)

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.counts,
            "acknowledged": self.acknowledged,
            "lost_records": self.lost_records,
            "window_seconds": None if self.settings.until_ack else self.settings.window,
            "until_ack": self.settings.until_ack,
            "incident_ids": [i["id"] for i in self.open],
            "error": self.error,
        }


def covers(ack: AckRow, incident: dict[str, Any]) -> bool:
    """Whether ``ack`` acknowledges ``incident`` (:class:`kvwatch.store.journal.AckRow`)."""
    ids = [f.get("id") for f in incident["findings"]]
    if None in ids or not ids:  # not from this journal (a gap, a log line): by time
        if incident["last_time"] > ack.ts:
            return False
    elif max(ids) > ack.upto:
        return False  # a finding stored after the acknowledgement: raised again
    if ack.incident is not None:
        return any(f.get("id") == ack.incident for f in incident["findings"])
    return (ack.since is None or incident["first_time"] >= ack.since) and (
        ack.until is None or incident["first_time"] < ack.until
    )


def acknowledgement(acks: list[AckRow], incident: dict[str, Any]) -> AckRow | None:
    """The latest acknowledgement that covers ``incident``, if any."""
    return next((a for a in reversed(acks) if covers(a, incident)), None)


def alarm(journal: Journal, settings: AlarmSettings, now: float | None = None) -> Alarm:
    """The integrity alarm now: the incidents whose last finding lies in the window (or all,
    ``until_ack``), and the records lost in it, less what an acknowledgement covers."""
    now = time.time() if now is None else now
    since = None if settings.until_ack else now - settings.window
    # An incident's earlier findings, up to the join rule's reach, so that it keeps its id.
    read_from = None if since is None else since - incident_model.JOIN_SECONDS
    grouped = incident_model.group(journal.incidents(since=read_from))
    acks = journal.acks()
    open_: list[dict[str, Any]] = []
    acknowledged = 0
    for incident in grouped:
        if since is not None and incident["last_time"] < since:
            continue
        if acknowledgement(acks, incident) is None:
            open_.append(incident)
        else:
            acknowledged += 1
    lost = 0
    for ts, count in journal.gaps(since):
        gap = {"first_time": ts, "last_time": ts, "findings": ()}
        if not any(a.incident is None and covers(a, gap) for a in acks):
            lost += count
    return Alarm(settings, tuple(open_), acknowledged, lost)


def read_alarm(journal_path: str | Path, settings: AlarmSettings) -> Alarm:
    """:func:`alarm` through a read-only connection of this request's own; a journal that
    cannot be read raises the alarm (it may hold incidents) and says why."""
    try:
        journal = Journal(journal_path, readonly=True)
    except (JournalError, OSError) as exc:
        if not Path(journal_path).exists():
            return Alarm(settings)  # nothing stored yet: the first poll creates it
        return Alarm(settings, error=str(exc))
    try:
        return alarm(journal, settings)
    except Exception as exc:  # the page must render even when the journal cannot be read
        return Alarm(settings, error=str(exc))
    finally:
        journal.close()


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


def summarize(state: State, alarm: Alarm, now: float | None = None) -> Summary:
    """The five checks, from the daemon's state and the integrity alarm (:func:`alarm`)."""
    now = time.time() if now is None else now
    h = health(state)
    checks = [
        _integrity(alarm),
        spool_access(state),
        _band(state),
        _coverage(state, h),
        _freshness(h, now),
    ]
    return Summary(tuple(checks))


def _integrity(alarm: Alarm) -> Check:
    scope = alarm.settings.describe()
    acked = f"; {alarm.acknowledged:,} acknowledged" if alarm.acknowledged else ""
    if alarm.error:
        return Check(
            "integrity",
            "alarm",
            f"INTEGRITY UNKNOWN: the journal cannot be read ({alarm.error}); it may hold incidents",
        )
    if not alarm.raised:
        return Check(
            "integrity",
            "ok",
            f"integrity: no unacknowledged incident, no lost record ({scope}){acked}",
        )
    parts = []
    if alarm.open:
        counts = alarm.counts
        parts.append(
            f"{counts['affected']:,} affected request(s), {counts['exposed']:,} exposed request(s)"
        )
    if alarm.lost_records:
        parts.append(f"{alarm.lost_records:,} spool record(s) lost")
    return Check(
        "integrity",
        "alarm",
        f"INTEGRITY ALERT: {', '.join(parts)} ({scope}){acked}; see kvwatch incidents "
        "--exposed, then kvwatch ack",
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


def _band_line(role: str, engine: str, pool: float, context: float) -> str:
    share = (context - pool) / context
    return (
        f"unsafe band on {role} ({engine}): prompts of {pool + 1:,.0f} to "
        f"{context:,.0f} tokens ({share:.0%} of the window) pass the context check but "
        "do not fit the KV pool; lower the context length or grow the pool"
    )


def _worst_band(rows: Iterable[tuple[tuple[str, ...], dict[str, float]]]) -> str | None:
    worst: tuple[float, str] | None = None
    for (role, engine, *_rest), gauges in rows:
        pool = gauges.get("kv_pool_tokens", 0.0)
        context = gauges.get("context_length_tokens", 0.0)
        if context > pool > 0:
            share = (context - pool) / context
            if worst is None or share > worst[0]:
                worst = (share, _band_line(role, engine, pool, context))
    return None if worst is None else worst[1]


def stale_views(state: State) -> list[tuple[tuple[str, ...], dict[str, float]]]:
    """The last pool and context gauges of engines that are gone (retired producers), newest
    first: what the band was when no engine reports any more."""
    with state.lock:
        gone = sorted(
            (p for p in state.producers.values() if p.retired and p.gauges),
            key=lambda p: -p.last_ts,
        )
        return [
            ((p.role or "-", p.engine or "-", p.model, str(p.rank), "hooks, stale"), dict(p.gauges))
            for p in gone
        ]


def _band(state: State) -> Check:
    """The unsafe band is a critical condition (the KVPoolSmallerThanContext rule pages
    critical): an alarm here too."""
    latest, _ = engine_views(state)
    reporting = [(k, g) for k, g in latest.items() if g.get("context_length_tokens")]
    line = _worst_band(reporting)
    if line is not None:
        return Check("unsafe_band", "alarm", line)
    if reporting:
        return Check("unsafe_band", "ok", "every reporting engine's pool holds its context")
    stale = _worst_band(stale_views(state))
    if stale is not None:
        return Check(
            "unsafe_band",
            "warning",
            "no reporting engine; the last one that reported had an "
            + stale
            + " (stale: the engine is gone)",
        )
    # Not a warning of its own: coverage says no producer is live.
    return Check("unsafe_band", "ok", "no reporting engine: no pool or context length to check")


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


def _incidents_table(incidents: list[dict[str, Any]], error: str | None, acks: list[AckRow]) -> str:
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
        findings = ", ".join(f"{f['role']} {f['detector']} {f['kind']}" for f in inc["findings"])
        ack = acknowledgement(acks, inc)
        acked = f"by {ack.by} at {time.strftime('%H:%M:%S', time.gmtime(ack.ts))}" if ack else "no"
        cells = (inc["id"], when, inc["node"], inc["role"], inc["engine"], inc["request_id"],
                 findings, inc["exposed"], inc["pages_total"], acked)  # fmt: skip
        cls = ' class="acked"' if ack else ""
        rows.append(f"<tr{cls}>" + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>")
    return f'<table id="incident-table"><tr>{head}</tr>{"".join(rows)}</table>'


def _latest_sources(incidents: list[dict[str, Any]]) -> str:
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
    incidents: list[dict[str, Any]],
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
) -> tuple[list[dict[str, Any]], list[AckRow], str | None]:
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
