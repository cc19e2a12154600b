"""The one source of kvwatch's alerts and recording rules.

Both ``alerts/kvwatch.rules.yml`` (Prometheus) and ``alerts/grafana/kvwatch-alert-rules.json``
(Grafana-managed alerting) are generated from this module by ``python -m alerts.generate``; a test
regenerates both and fails on any difference, and another proves the two sets hold the same alerts.
It lives in the daemon's package because the daemon's fast path to Alertmanager
(:mod:`kvwatch.alerting.evaluate`) posts the alerts marked :attr:`Alert.increase` itself, with the
labels and
annotations their rule produces; ``alerts.definitions`` re-exports it for the generators.

Conventions (kubernetes-mixin): CamelCase alert names; ``severity`` is critical, warning or info;
``summary`` is fixed text; ``description`` names the node, the role and the value; ``runbook_url``
points at the alert's section of ``alerts/runbook.md`` under ``RUNBOOK_BASE``.

Description templates use Prometheus's ``$value``; the Grafana generator rewrites it to
``$values.B.Value`` (the reduced query result). ``$labels.x`` is the same in both.

Metric names come from kvspool's catalogue through ``exposed()``: a family it does not hold fails
here, at generation time.

Label contract with Prometheus: every kvwatch target carries a ``node`` target label (set per target
in the scrape config or by the ServiceMonitor's relabelling) and ``job="kvwatch"``.

Longer than 450 lines: it is data, one definition per rule with its annotations.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

from kvspool.catalogue import KIND, exposed
from kvwatch.config import parse_duration

RUNBOOK_BASE = "https://github.com/kvwatch/kvwatch/blob/main/alerts/runbook.md"
#: A finding of a misread, not a leak: its own alert, left out of KVIntegrityMismatch.
LAYOUT_MISMATCH = KIND.check("layout_mismatch")
"""Where ``runbook_url`` points: the runbook in the repository, one anchor per alert."""

JOB_SELECTOR = 'job="kvwatch"'
"""How the alerts find the daemon's scrape targets (the ``job`` of the scrape config)."""

PD_ROLES = "prefill|decode"
"""Roles that mean the engine runs disaggregated (PD); ``unified`` is a single-node engine."""

PD_RELEASE_ENGINES = "sglang|minipd"
"""Engines whose release string follows SGLang's (minipd emulates SGLang releases). vLLM has no
integrity check at all, so none of its releases is marked vulnerable here."""

VULNERABLE_RELEASE_RE = r"v?0\.([0-4]|5\.([0-9]|1[0-9]))([^0-9].*)?"
"""SGLang releases that expose the unwritten-page leak in PD mode: everything before 0.5.20
(0.5.20 ships #36988, which retires an aborted prefill before it reaches decode). RE2, anchored by
Prometheus. Matches 0.4.x, 0.5.0 .. 0.5.19 and their rc/post builds; not 0.5.20+, 0.10+, 1.x."""

BELOW_FLOOR_RELEASE_RE = r"v?0\.5\.2[01]([^0-9].*)?"
"""Fixed for the incident but below the recommended floor 0.5.22 (router drops the decode half when
prefill fails, generation tags on abort messages): 0.5.20 and 0.5.21."""


def _q(text: str) -> str:
    """A PromQL expression written as an indented block, dedented, outer blank lines dropped."""
    return textwrap.dedent(text).strip()


@dataclass(frozen=True)
class RecordingRule:
    record: str
    expr: str


def _seconds(window: str) -> float:
    """A PromQL range (``5m``) in seconds."""
    return parse_duration(window, setting="window")


@dataclass(frozen=True)
class Increase:
    """The condition ``sum by (<by>) (increase(<counter>[<window>])) > 0``: a catalogued counter
    rose within the window. The daemon reads the same counter from its own /metrics, so it can
    evaluate the condition itself (``node`` is the scrape target's label, the daemon's ``node``
    setting)."""

    #: The catalogued family without ``kvwatch_`` (:func:`kvspool.catalogue.exposed`).
    counter: str
    by: tuple[str, ...]
    window: str
    #: Label matchers on the counter, ``(label, "=" | "!=", value)``: the series it sums.
    where: tuple[tuple[str, str, str], ...] = ()

    @property
    def window_seconds(self) -> float:
        return _seconds(self.window)

    @property
    def expr(self) -> str:
        matchers = ",".join(f'{label}{op}"{value}"' for label, op, value in self.where)
        selector = f"{exposed(self.counter)}{{{matchers}}}" if matchers else exposed(self.counter)
        return f"sum by ({', '.join(self.by)}) (increase({selector}[{self.window}])) > 0"

    def matches(self, labels: dict[str, str]) -> bool:
        """Whether a sample with ``labels`` is one of the series the condition sums."""
        return all(
            (labels.get(label, "") == value) == (op == "=") for label, op, value in self.where
        )


@dataclass(frozen=True)
class Context:
    """A second number an alert's description states, beside ``$value``: how much ``counter``
    grew over ``window`` where its ``by`` labels are the alert's, written ``{{ <name> }}`` in the
    description. Prometheus runs it with the ``query`` template function; Grafana runs it as one
    more query of the rule (``$values.<ref>``), summed by ``by``; the daemon's fast path
    (:mod:`kvwatch.alerting.evaluate`) from its own samples."""

    name: str
    #: The catalogued family without ``kvwatch_`` (:func:`kvspool.catalogue.exposed`).
    counter: str
    by: tuple[str, ...]
    window: str = "5m"

    @property
    def window_seconds(self) -> float:
        return _seconds(self.window)

    def expr(self, selector: str = "") -> str:
        """Summed over ``selector`` (Prometheus), or by ``by`` without one (Grafana). The exact
        difference, not ``increase()``: a count of requests must not be extrapolated (12
        became 18 in the demo); a series younger than the window counts from its zero."""
        by = f" by ({', '.join(self.by)})" if not selector else ""
        family = exposed(self.counter)
        total = f"sum{by} ({family}{selector})"
        before = f"sum{by} ({family}{selector} offset {self.window})"
        return f"clamp_min({total} - ({before} or {total} * 0), 0)"


@dataclass(frozen=True)
class Alert:
    name: str
    severity: str
    expr: str
    summary: str
    description: str
    for_: str = ""
    """Prometheus ``for``; empty means the alert fires on the first evaluation that matches."""
    labels: dict[str, str] = field(default_factory=dict)
    #: Set when the expression is a counter's increase: the daemon posts this alert itself.
    increase: Increase | None = None
    context: tuple[Context, ...] = ()

    @property
    def anchor(self) -> str:
        """The runbook section's anchor: GitHub lowercases the ``## AlertName`` heading."""
        return self.name.lower()

    @property
    def runbook_url(self) -> str:
        return f"{RUNBOOK_BASE}#{self.anchor}"

    @property
    def all_labels(self) -> dict[str, str]:
        return {"severity": self.severity, **self.labels}

    @property
    def annotations(self) -> dict[str, str]:
        return {
            "summary": self.summary,
            "description": self.description,
            "runbook_url": self.runbook_url,
        }


VULNERABLE_PD = "kvwatch:engine_info:vulnerable_pd"
"""The recording rule: engine processes on a vulnerable release in PD mode (dashboards too)."""
BELOW_FLOOR_PD = "kvwatch:engine_info:below_floor_pd"
"""The recording rule: engine processes on a release below the recommended floor in PD mode."""

RULES_GROUP = "kvwatch.rules"
ALERTS_GROUP = "kvwatch.alerts"

RECORDING_RULES: tuple[RecordingRule, ...] = (
    RecordingRule(
        "node_role_detector:kvwatch_verifications:rate5m",
        _q(
            f"""
            sum by (node, role, detector) (rate({exposed("verifications")}[5m]))
            """
        ),
    ),
    RecordingRule(
        "node_role_detector:kvwatch_verifications_skipped:rate5m",
        _q(
            f"""
            sum by (node, role, detector) (rate({exposed("verifications_skipped")}[5m]))
            """
        ),
    ),
    # Requests that reached a detector, verified or skipped. A detector that exports no skip
    # counter (or no verification counter) still counts through the other side of the `or`.
    RecordingRule(
        "node_role_detector:kvwatch_detector_requests:rate5m",
        _q(
            """
            node_role_detector:kvwatch_verifications:rate5m
              + node_role_detector:kvwatch_verifications_skipped:rate5m
            or node_role_detector:kvwatch_verifications:rate5m
            or node_role_detector:kvwatch_verifications_skipped:rate5m
            """
        ),
    ),
    # For each detector that verified nothing: the requests per second that flowed through its
    # node and role (the busiest detector there), i.e. the traffic it should have verified.
    RecordingRule(
        "node_role_detector:kvwatch_unverified_requests:rate5m",
        _q(
            """
            (node_role_detector:kvwatch_verifications:rate5m == bool 0)
              * on (node, role) group_left ()
            max by (node, role) (node_role_detector:kvwatch_detector_requests:rate5m)
            > 0
            """
        ),
    ),
    RecordingRule(
        VULNERABLE_PD,
        _q(
            f"""
            {exposed("engine_info")}{{engine=~"{PD_RELEASE_ENGINES}", role=~"{PD_ROLES}", version=~`{VULNERABLE_RELEASE_RE}`}}
            """  # noqa: E501
        ),
    ),
    RecordingRule(
        BELOW_FLOOR_PD,
        _q(
            f"""
            {exposed("engine_info")}{{engine=~"{PD_RELEASE_ENGINES}", role=~"{PD_ROLES}", version=~`{BELOW_FLOOR_RELEASE_RE}`}}
            """  # noqa: E501
        ),
    ),
)

_WHERE = "{{ $labels.role }} on node {{ $labels.node }}"

#: Requests whose KV the affected requests on the alert's node received in the last 5 minutes
#: (each source counted once per incident, whichever role's finding named it): the prefill and
#: the decode alert of one leak state the same number.
EXPOSED_REQUESTS = Context("exposed_requests", "exposed_requests", ("node",))
#: The affected requests (incidents) on the alert's node in the last 5 minutes: what
#: ``kvwatch status`` and ``kvwatch incidents`` count, whichever role's alert says it.
AFFECTED_REQUESTS = Context("affected_requests", "affected_requests", ("node",))


def _on_increase(
    *,
    name: str,
    severity: str,
    increase: Increase,
    summary: str,
    description: str,
    context: tuple[Context, ...] = (),
) -> Alert:
    """An alert on a counter's increase, its expression written from ``increase``."""
    return Alert(
        name=name,
        severity=severity,
        expr=increase.expr,
        summary=summary,
        description=description,
        increase=increase,
        context=context,
    )


ALERTS: tuple[Alert, ...] = (
    _on_increase(
        name="KVIntegrityMismatch",
        severity="critical",
        increase=Increase(
            "mismatches",
            ("node", "role", "detector", "kind"),
            "5m",
            (("kind", "!=", LAYOUT_MISMATCH),),
        ),
        summary="A request read KV-cache pages that it did not write: another user's data may "
        "have leaked.",
        description=(
            "The {{ $labels.detector }} detector on "
            + _WHERE
            + ' found {{ $value | printf "%.0f" }} KV integrity mismatch(es) of kind '
            "{{ $labels.kind }} in the last 5 minutes. On node {{ $labels.node }}, "
            "{{ affected_requests }} affected request(s) (incidents) in that time received the "
            "KV of {{ exposed_requests }} other request(s); kvwatch incidents lists each "
            "affected request once, kvwatch incidents --exposed names whose KV they received."
        ),
        context=(AFFECTED_REQUESTS, EXPOSED_REQUESTS),
    ),
    _on_increase(
        name="KVLayoutMismatch",
        severity="critical",
        increase=Increase(
            "mismatches",
            ("node", "role", "detector", "kind"),
            "5m",
            (("kind", "=", LAYOUT_MISMATCH),),
        ),
        summary="Decode reads transferred KV with another layout than prefill wrote it: every "
        "reply between these peers is wrong, no other user's data involved.",
        description=(
            "The {{ $labels.detector }} detector on "
            + _WHERE
            + ' found {{ $value | printf "%.0f" }} transfer(s) in the last 5 minutes whose '
            "writer's layout signature (dtype, block size, layers, KV heads, cell bytes, memory "
            "layout) differs from this reader's: the bytes arrive intact and are read wrongly. "
            "kvwatch incidents names the field that differs and the writer's node; fix the "
            "pair's configuration (enforce mode fails these requests before they read)."
        ),
    ),
    Alert(
        name="KVTransferPeerMismatches",
        severity="critical",
        expr=_q(
            f"""
            label_replace(
              sum by (peer) (increase({exposed("transfer_mismatches")}{{peer!="other"}}[10m])) >= 3
                and
              sum by (peer) (increase({exposed("transfer_mismatches")}{{peer!="other"}}[10m]))
                > scalar(0.5 * sum(increase({exposed("transfer_mismatches")}[10m]))),
              "node", "$1", "peer", "(.*)"
            )
            """
        ),
        summary="One peer's KV transfers fail kvwatch's checks: a bad link or NIC on the node "
        "that sends them. Drain that node.",
        description=(
            "KV that node {{ $labels.node }} sent (its prefill role's transfers) failed "
            'kvwatch\'s checks on the readers {{ $value | printf "%.0f" }} time(s) in the last 10 '
            "minutes, more than half of all transfer mismatches: drain {{ $labels.node }} and "
            "check its link."
        ),
    ),
    Alert(
        name="KVPoolSmallerThanContext",
        severity="critical",
        expr=_q(
            f"""
            max by (node, role, engine, model) ({exposed("unsafe_band_tokens")}) > 0
            """
        ),
        summary="The KV pool is smaller than the advertised context length: an unsafe band of "
        "prompt lengths exists.",
        description=(
            "{{ $labels.engine }} serving {{ $labels.model }} as "
            + _WHERE
            + ': the KV pool is {{ $value | printf "%.0f" }} tokens smaller than the context '
            "length. Prompts in that band pass the context check and fail the pool check."
        ),
    ),
    _on_increase(
        name="KVAbortedRequestAdmitted",
        severity="critical",
        increase=Increase("aborted_admissions", ("node", "role", "queue"), "5m"),
        summary="An aborted (rejected) request was admitted into the prefill/decode handoff.",
        description=(
            "The {{ $labels.queue }} queue of "
            + _WHERE
            + ' admitted {{ $value | printf "%.0f" }} request(s) already marked for abort in '
            "the last 5 minutes."
        ),
    ),
    _on_increase(
        name="KVSpoolRecordsLost",
        severity="critical",
        increase=Increase("spool_lost_records", ("node",), "5m"),
        summary="kvwatch lost records between the engine hooks and the daemon: detections may be "
        "missing.",
        description=(
            "The kvwatch daemon on node {{ $labels.node }} (all roles on the node) saw "
            '{{ $value | printf "%.0f" }} spool record(s) lost in the last 5 minutes.'
        ),
    ),
    Alert(
        name="KVEngineReleaseVulnerable",
        severity="critical",
        expr=_q(
            f"""
            count by (node, role, engine, model, version) ({VULNERABLE_PD}) > 0
            """
        ),
        summary="An engine release that leaks unwritten KV pages in PD mode is serving "
        "disaggregated traffic.",
        description=(
            "{{ $labels.engine }} {{ $labels.version }} runs as "
            + _WHERE
            + " ({{ $value }} process(es), model {{ $labels.model }}); releases before 0.5.20 "
            "admit rejected requests into the handoff. Upgrade both roles to 0.5.22 or later."
        ),
    ),
    Alert(
        name="KVEngineReleaseBelowFloor",
        severity="info",
        expr=_q(
            f"""
            count by (node, role, engine, model, version) ({BELOW_FLOOR_PD}) > 0
            """
        ),
        summary="An engine release below the recommended floor 0.5.22 is serving disaggregated "
        "traffic.",
        description=(
            "{{ $labels.engine }} {{ $labels.version }} runs as "
            + _WHERE
            + " ({{ $value }} process(es), model {{ $labels.model }}); 0.5.22 is the recommended "
            "floor for PD mode."
        ),
    ),
    Alert(
        name="KVEngineReleaseSkew",
        severity="warning",
        for_="15m",
        expr=_q(
            f"""
            group by (node, role, engine, model, version) ({exposed("engine_info")}{{role=~"{PD_ROLES}"}})
              * on (engine, model) group_left ()
            count by (engine, model) (
              group by (engine, model, version) ({exposed("engine_info")}{{role=~"{PD_ROLES}"}})
            )
            > 1
            """  # noqa: E501
        ),
        summary="Prefill and decode run different engine releases.",
        description=(
            "{{ $labels.engine }} {{ $labels.version }} runs as "
            + _WHERE
            + " while {{ $value }} different releases serve {{ $labels.model }} across prefill "
            "and decode."
        ),
    ),
    Alert(
        name="KVDetectorVerifyingNothing",
        severity="warning",
        for_="10m",
        expr=_q(
            f"""
            node_role_detector:kvwatch_unverified_requests:rate5m
              and on (node, role, detector)
            sum by (node, role, detector) (
              rate({exposed("verifications_skipped")}{{reason!="mode_off"}}[5m])
            ) > 0
            or
            node_role_detector:kvwatch_unverified_requests:rate5m
              and on (role, detector)
            max by (role, detector) (node_role_detector:kvwatch_verifications:rate5m) > 0
            """
        ),
        summary="A kvwatch detector verifies no request while requests flow.",
        description=(
            "The {{ $labels.detector }} detector on "
            + _WHERE
            + " verified no request in the last 5 minutes while "
            '{{ $value | printf "%.2f" }} requests/s flowed (it skips them, or is off where '
            "other nodes run it)."
        ),
    ),
    Alert(
        name="KVWatchDaemonDown",
        severity="warning",
        for_="5m",
        expr=_q(
            f"""
            up{{{JOB_SELECTOR}}} == 0
            """
        ),
        summary="Prometheus cannot scrape the kvwatch daemon: leaks on this node go unseen.",
        description=(
            "The kvwatch daemon on node {{ $labels.node }} (all roles on the node, target "
            "{{ $labels.instance }}) has been down for 5 minutes (up = {{ $value }})."
        ),
    ),
    Alert(
        name="KVHooksSilent",
        severity="warning",
        for_="5m",
        expr=_q(
            f"""
            time() - max by (node) ({exposed("last_record_timestamp_seconds")}) > 300
            """
        ),
        summary="The engine hooks on a node have written nothing to the spool: its detectors "
        "may be off.",
        description=(
            "No engine hook on node {{ $labels.node }} (any role) has written a spool record for "
            "{{ $value | humanizeDuration }}."
        ),
    ),
    Alert(
        name="KVEngineMisconfigured",
        severity="critical",
        expr=_q(
            f"""
            max by (node, role, setting) ({exposed("engine_config_errors")}) > 0
            """
        ),
        summary="An engine started with an invalid kvwatch setting: its hooks run with the "
        "setting's fallback (a bad mode as log), which may not be what was meant.",
        description=(
            '{{ $value | printf "%.0f" }} engine process(es), '
            + _WHERE
            + ", started with an invalid kvwatch setting {{ $labels.setting }}; each runs with "
            "its fallback "
            "(a misspelt enforce runs as log: leaks are recorded, not failed). The engine's log "
            "names the value; kvwatch status names the process."
        ),
    ),
    Alert(
        name="KVSpoolSegmentsIgnored",
        severity="critical",
        expr=_q(
            f"""
            max by (node) ({exposed("spool_ignored_findings")}) > 0
            or
            max by (node) ({exposed("spool_ignored_findings")})
              and on (node)
            sum by (node) ({exposed("spool_ignored_segments")}) > 0
              and on (node)
            max by (node) ({exposed("producers")}) == 0
            """
        ),
        summary="The kvwatch daemon leaves spool segments unread while findings sit in them or "
        "no producer's records are read: leaks on this node go unseen.",
        description=(
            "The kvwatch daemon on node {{ $labels.node }} (all roles on the node) leaves spool "
            "segments unread (their owner may not write the spool, or it cannot open them): {{ "
            '$value | printf "%.0f" }} finding(s) sit in them, or no producer\'s segment is read '
            "at all. kvwatch status names each owner and uid."
        ),
    ),
    Alert(
        name="KVSpoolRecordsRejected",
        severity="warning",
        expr=_q(
            f"""
            sum by (node, reason) (increase({exposed("spool_rejected")}[10m])) > 0
            """
        ),
        summary="The kvwatch daemon rejected spool records (torn, corrupt or foreign).",
        description=(
            "The kvwatch daemon on node {{ $labels.node }} (all roles on the node) rejected "
            '{{ $value | printf "%.0f" }} spool record(s) in the last 10 minutes, reason '
            "{{ $labels.reason }}."
        ),
    ),
)

SEVERITIES = ("critical", "warning", "info")
