"""The node's health model: the verdict the status page, ``kvwatch status`` and the readiness
answer share.

A headline that is the worst of five checks (integrity: the journal's unacknowledged incidents
in the alarm's window, as affected and exposed requests, and lost records; spool access:
segments left unread, by owner; the unsafe band, an alarm as its rule is critical, stale once no
engine reports; coverage: a live producer, a detector that verifies, the spool present;
freshness of the last record), each with the line an on-call needs. The page is
:mod:`kvwatch.expose.page`, the HTTP surface :mod:`kvwatch.expose.http`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvspool.catalogue import COUNTER_BY_NAME, SKIP_REASON, DaemonCounter
from kvwatch.expose.metrics import RankCoverage, engine_views, rank_coverage
from kvwatch.store import incident as incident_model
from kvwatch.store.incident import Incident
from kvwatch.store.journal import AckRow, Journal, JournalError
from kvwatch.store.state import State

LATEST_INCIDENTS = 50
REFRESH_SECONDS = 5
#: With a live producer, no record for this long means the hooks or the daemon have stalled.
STALE_SECONDS = 120.0
#: Check levels, best to worst; the headline takes the worst.
LEVELS = ("ok", "warning", "alarm")
#: What coverage reads of the hooks' counters; a detector that is off is no coverage gap.
_VERIFIED = COUNTER_BY_NAME["verifications"]
_SKIPPED = COUNTER_BY_NAME["verifications_skipped"]
_SKIP_REASON_AT = _SKIPPED.labels.index(SKIP_REASON)
_MODE_OFF = SKIP_REASON.check("mode_off")

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
    open: tuple[Incident, ...] = ()
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


def covers(ack: AckRow, incident: Incident) -> bool:
    """Whether ``ack`` acknowledges ``incident`` (:class:`kvwatch.store.journal.AckRow`)."""
    ids = [f["id"] for f in incident["findings"]]
    return _covers(ack, incident["first_time"], incident["last_time"], ids)


def _covers(ack: AckRow, first_time: float, last_time: float, ids: list[int | None]) -> bool:
    """:func:`covers` for findings first and last seen at those times, with those journal ids
    (None for one not from this journal; none at all for a gap in the records)."""
    stored = [i for i in ids if i is not None]
    if len(stored) < len(ids) or not ids:  # not from this journal (a gap, a log line): by time
        if last_time > ack.ts:
            return False
    elif max(stored) > ack.upto:
        return False  # a finding stored after the acknowledgement: raised again
    if ack.incident is not None:
        return ack.incident in ids
    return (ack.since is None or first_time >= ack.since) and (
        ack.until is None or first_time < ack.until
    )


def acknowledgement(acks: list[AckRow], incident: Incident) -> AckRow | None:
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
    open_: list[Incident] = []
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
        if not any(a.incident is None and _covers(a, ts, ts, []) for a in acks):
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
            if name == DaemonCounter.FINDINGS and value:
                incidents[labels[0]] = incidents.get(labels[0], 0.0) + value
        for detector, value in incidents.items():
            mismatches[detector] = max(mismatches.get(detector, 0.0), value)
        lost = state.daemon.get((DaemonCounter.SPOOL_LOST_RECORDS, ()), 0.0)
        rejected = sum(v for (n, _), v in state.daemon.items() if n == DaemonCounter.SPOOL_REJECTED)
        return Health(
            mismatches, aborted, lost, rejected, state.live_producers, state.last_record_ts
        )


@dataclass(frozen=True)
class Check:
    name: str  # integrity, spool_access, unsafe_band, coverage, engine_config, freshness
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
    """The six checks, from the daemon's state and the integrity alarm (:func:`alarm`)."""
    now = time.time() if now is None else now
    h = health(state)
    checks = [
        _integrity(alarm),
        spool_access(state),
        _band(state),
        _coverage(state, h),
        engine_config(state),
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
        problem = state.poll_problem
        totals = state.hook_counter_totals()
    if not spool_ok:
        return Check(
            "coverage",
            "warning",
            (problem or "the spool folder is missing or unreadable")
            + ": nothing new is verified (see the daemon's log)",
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
        # Both series' labels start with the detector (the catalogue's COUNTER_SERIES).
        if family == _VERIFIED.family:
            verified[labels[0]] = verified.get(labels[0], 0.0) + value
        elif family == _SKIPPED.family and labels[_SKIP_REASON_AT] != _MODE_OFF:
            skipped[labels[0]] = skipped.get(labels[0], 0.0) + value
    idle = sorted(d for d, n in skipped.items() if n and not verified.get(d))
    if idle:
        return Check(
            "coverage",
            "warning",
            f"detector {', '.join(idle)} verifies nothing: every request is skipped "
            "(kvwatch_verifications_skipped_total says why)",
        )
    blind = idle_ranks(rank_coverage(state))
    if blind:
        return Check(
            "coverage",
            "warning",
            "; ".join(blind[:3])
            + (f"; +{len(blind) - 3} more" if len(blind) > 3 else "")
            + " (kvwatch_rank_verifications_skipped_total says where)",
        )
    return Check("coverage", "ok", f"{h.live_producers} live producer(s), every detector verifies")


def engine_config(state: State) -> Check:
    """An alarm while a live engine process started with an invalid kvwatch setting: it runs with
    the setting's fallback (a bad mode as log), which may not be what its operator meant (an
    ``enforce`` misspelt serves every request it should fail)."""
    with state.lock:
        bad = sorted(
            (p for p in state.producers.values() if p.config_errors and not p.retired),
            key=lambda p: p.id,
        )
    if not bad:
        return Check("engine_config", "ok", "every live engine's kvwatch settings are valid")
    lines = [
        f"{p.engine or '-'} {p.role or '-'} rank {p.rank} on {p.node or '-'} (pid {p.pid}): "
        + ", ".join(p.config_errors)
        for p in bad[:3]
    ]
    more = f"; +{len(bad) - 3} more" if len(bad) > 3 else ""
    return Check(
        "engine_config",
        "alarm",
        "invalid kvwatch settings, run with their fallbacks (a bad mode as log): "
        + "; ".join(lines)
        + more
        + " (the engine's log names each value; fix them and restart the engine)",
    )


def idle_ranks(coverage: RankCoverage) -> list[str]:
    """The engine ranks whose detector skips every request while another rank of the same
    engine (role, engine, model) verifies with it: a tensor-parallel deployment whose summed
    counters look covered, one of whose ranks reads its KV unchecked."""
    #: (role, engine, model, detector) -> (ranks that verify, ranks that only skip)
    engines: dict[tuple[str, str, str, str], tuple[set[str], set[str]]] = {}
    for (role, engine, model, rank, _source), rows in coverage.items():
        for detector, (verified, skipped) in rows.items():
            doing, idle_only = engines.setdefault((role, engine, model, detector), (set(), set()))
            if verified:
                doing.add(rank)
            elif skipped:
                idle_only.add(rank)
    out = []
    for (role, engine, model, detector), (doing, idle_only) in sorted(engines.items()):
        if doing and idle_only:
            idle = ", ".join(sorted(idle_only, key=lambda r: (len(r), r)))
            out.append(
                f"{detector} verifies nothing on {role} rank {idle} of {engine} {model or '-'}"
                " while its other ranks do"
            )
    return out


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
