"""/metrics: one custom Collector that renders the daemon's state at scrape time.

Every family in docs/architecture.md, bounded labels only, every series with a known label set
initialised to 0. Gauges that describe an engine (pool, context, page size, unsafe band, engine
info) exist for the producers that are alive and the engine logs being watched, with ``source``
saying which. The hook-fed families and their labels come from kvspool's catalogue.
"""

from __future__ import annotations

import itertools
import platform
import time
from collections.abc import Iterable, Iterator
from typing import Final, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvspool import catalogue
from kvspool.catalogue import DaemonCounter
from kvwatch import __version__
from kvwatch.store.state import (
    MAX_MODELS,
    MAX_RANKS,
    MAX_VERSIONS,
    FirstN,
    LabelKey,
    Producer,
    State,
    producer_counter_series,
)

_ROLE, _ENGINE = catalogue.ROLE.bound, catalogue.ENGINE.bound
#: ``kvwatch_engine_info``: (engine, version, role, model, mode, scrub).
EngineInfo = tuple[str, str, str, str, str, str]


def _hooks_label(label: catalogue.Label, value: str) -> str:
    """A MODE or SCRUB label value; ``none`` where no hooks said (an engine's logs only)."""
    return label.bound(value) if value else "none"


_ENGINE_LABELS: Final = catalogue.ENGINE_LABELS


def _family(name: str, value: float | None = None) -> CounterMetricFamily | GaugeMetricFamily:
    """An empty family (or, without labels, one with ``value``) as the catalogue defines it."""
    family = catalogue.FAMILY_BY_NAME[name]
    kind = CounterMetricFamily if family.type == "counter" else GaugeMetricFamily
    if value is not None:
        return kind(family.name, family.help, value=value)
    return kind(family.name, family.help, labels=list(family.labels))


class GpuSource(Protocol):
    """Where GPU memory comes from: NVML in production."""

    @property
    def up(self) -> bool: ...

    def memory(self) -> list[tuple[str, int, int, int]]:
        """(gpu index, total, used, free) in bytes per GPU."""
        ...


def _grid(sets: tuple[tuple[str, ...], ...]) -> Iterator[LabelKey]:
    return itertools.product(*sets)


#: The labels of the families that count findings (``mismatches``, ``findings``).
_FINDING_LABELS: Final = (catalogue.DETECTOR, catalogue.ROLE, catalogue.KIND)
_POSSIBLE_FINDINGS: Final = frozenset(
    (detector, role, kind)
    for detector, kinds in catalogue.DETECTOR_KINDS.items()
    for role in catalogue.ROLE.values
    for kind in kinds
)


def _finding_keys(observed: Iterable[LabelKey]) -> list[LabelKey]:
    """The (detector, role, kind) series of a findings family: every pair a detector can
    report, for every role, initialised; and whatever else was counted (``other`` included)."""
    return sorted(_POSSIBLE_FINDINGS | set(observed))


class KvwatchCollector(Collector):
    """The daemon's /metrics; ``gpus`` is read at scrape time (as node_exporter does)."""

    def __init__(self, state: State, gpus: GpuSource | None = None) -> None:
        self.state = state
        self.gpus = gpus

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        started = time.perf_counter()
        gpu_rows: list[tuple[str, int, int, int]] = []
        gpu_ok = False
        if self.gpus is not None and self.gpus.up:
            try:
                gpu_rows = self.gpus.memory()
                gpu_ok = True
            except Exception:
                gpu_ok = False
        gpu_seconds = time.perf_counter() - started
        families = self.state_families()
        with self.state.lock:
            collectors = dict(self.state.collectors)
        if self.gpus is not None:
            # No NVIDIA GPU is not a failure (kvwatch_nvml_up says it); a failed query is.
            collectors["nvml"] = (gpu_ok or not self.gpus.up, gpu_seconds)
        yield from families
        yield from self._gpu_families(gpu_rows)
        success = _family("kvwatch_collector_success")
        duration = _family("kvwatch_collector_duration_seconds")
        for name in catalogue.COLLECTOR.values:
            # Not configured, or not run yet: nothing failed.
            ok, seconds = collectors.get(name, (True, 0.0))
            success.add_metric([name], 1.0 if ok else 0.0)
            duration.add_metric([name], seconds)
        yield success
        yield duration

    def state_families(self) -> list[Metric]:
        """The families rendered from the daemon's state (all but NVML's and the collectors'
        success): what /metrics serves, and what the fast path's alerts are evaluated on."""
        with self.state.lock:
            return list(self._families())

    # -- families -----------------------------------------------------------------------------

    def _transfer_mismatches(self) -> Metric:
        """By peer: every peer counted so far (at most MAX_PEERS), and other, from 0."""
        family = _family("kvwatch_transfer_mismatches")
        daemon = self.state.daemon
        peers = {labels[0] for name, labels in daemon if name == DaemonCounter.TRANSFER_MISMATCHES}
        for peer in sorted(peers | {catalogue.OTHER}):
            family.add_metric([peer], daemon.get((DaemonCounter.TRANSFER_MISMATCHES, (peer,)), 0.0))
        return family

    def _families(self) -> Iterator[Metric]:
        state = self.state
        build = _family("kvwatch_build_info")
        build.add_metric([__version__, platform.python_version()], 1.0)
        yield build
        yield from self._engine_families()
        totals = state.hook_counter_totals()
        for series in catalogue.COUNTER_SERIES:
            metric = CounterMetricFamily(
                series.family, series.help, labels=list(series.label_names)
            )
            if series.labels == _FINDING_LABELS:  # only the pairs a detector can report
                keys: Iterable[LabelKey] = _finding_keys(
                    {k: v for (f, k), v in totals.items() if f == series.family}
                )
            else:
                keys = _grid(tuple(label.sorted_values for label in series.labels))
            for key in keys:
                metric.add_metric(list(key), totals.get((series.family, key), 0.0))
            yield metric
        findings = _family("kvwatch_findings")
        counted = {k: v for (name, k), v in state.daemon.items() if name == DaemonCounter.FINDINGS}
        for key in _finding_keys(counted):
            findings.add_metric(list(key), counted.get(key, 0.0))
        yield findings
        yield self._transfer_mismatches()
        for counter in (
            DaemonCounter.AFFECTED_REQUESTS,
            DaemonCounter.EXPOSED_REQUESTS,
        ):
            family = _family(f"kvwatch_{counter}")
            for role in catalogue.ROLE.sorted_values:
                family.add_metric([role], state.daemon.get((counter, (role,)), 0.0))
            yield family
        yield _family(
            "kvwatch_spool_records",
            value=state.daemon.get((DaemonCounter.SPOOL_RECORDS, ()), 0.0),
        )
        rejected = _family("kvwatch_spool_rejected")
        for reason in catalogue.REJECT_REASON.values:
            rejected.add_metric(
                [reason], state.daemon.get((DaemonCounter.SPOOL_REJECTED, (reason,)), 0.0)
            )
        yield rejected
        yield _family(
            "kvwatch_spool_clamped_records",
            value=state.daemon.get((DaemonCounter.SPOOL_CLAMPED_RECORDS, ()), 0.0),
        )
        yield _family(
            "kvwatch_spool_lost_records",
            value=state.daemon.get((DaemonCounter.SPOOL_LOST_RECORDS, ()), 0.0),
        )
        yield _family(
            "kvwatch_spool_lag_bytes",
            value=float(state.lag_bytes),
        )
        ignored = _family("kvwatch_spool_ignored_segments")
        for reason in catalogue.IGNORED_REASON.values:
            count = sum(1 for i in state.ignored.values() if i.reason == reason)
            ignored.add_metric([reason], float(count))
        yield ignored
        yield _family(
            "kvwatch_spool_ignored_findings",
            value=float(sum(i.findings for i in state.ignored.values())),
        )
        yield _family(
            "kvwatch_producers",
            value=float(state.live_producers),
        )
        yield _family("kvwatch_last_record_timestamp_seconds", value=state.last_record_ts)
        yield _family("kvwatch_config_last_reload_successful", value=float(state.config_reload_ok))
        yield _family(
            "kvwatch_config_last_reload_success_timestamp_seconds", value=state.config_reload_ts
        )
        yield _family(
            "kvwatch_log_lines",
            value=state.log_counts.get(("lines", ()), 0.0),
        )
        errors = _family("kvwatch_log_errors")
        for reason in catalogue.LOG_ERROR_REASON.values:
            errors.add_metric([reason], state.log_counts.get(("errors", (reason,)), 0.0))
        yield errors
        posts = _family("kvwatch_alertmanager_posts")
        for result in catalogue.POST_RESULT.sorted_values:
            posts.add_metric(
                [result],
                state.daemon.get((DaemonCounter.ALERTMANAGER_POSTS, (result,)), 0.0),
            )
        yield posts

    def _engine_families(self) -> Iterator[Metric]:
        latest, info, coverage = engine_ranks(self.state)
        for series in catalogue.GAUGE_SERIES:
            metric = GaugeMetricFamily(series.family, series.help, labels=list(_ENGINE_LABELS))
            for labels, gauges in sorted(latest.items()):
                if series.name in gauges:
                    metric.add_metric(list(labels), gauges[series.name])
            yield metric
        band = _family("kvwatch_unsafe_band_tokens")
        for key, gauges in sorted(latest.items()):
            pool = gauges.get("kv_pool_tokens")
            context = gauges.get("context_length_tokens")
            if pool is not None and context is not None:
                band.add_metric(list(key), catalogue.unsafe_band(context, pool))
        yield band
        engine_info = _family("kvwatch_engine_info")
        for row in sorted(info):
            engine_info.add_metric(list(row), 1.0)
        yield engine_info
        config = _family("kvwatch_engine_config_errors")
        for (role, setting), count in sorted(config_errors(self.state).items()):
            config.add_metric([role, setting], float(count))
        yield config
        verified = _family("kvwatch_rank_verifications")
        skipped = _family("kvwatch_rank_verifications_skipped")
        for key, rows in sorted(coverage.items()):
            for detector, (done, passed) in sorted(rows.items()):
                verified.add_metric([*key, detector], done)
                skipped.add_metric([*key, detector], passed)
        yield verified
        yield skipped

    def _gpu_families(self, rows: list[tuple[str, int, int, int]]) -> Iterator[Metric]:
        up = self.gpus is not None and self.gpus.up
        yield _family("kvwatch_nvml_up", value=1.0 if up else 0.0)
        memory = _family("kvwatch_gpu_memory_bytes")
        for gpu, total, used, free in rows:
            for state, value in zip(catalogue.GPU_STATE.values, (total, used, free), strict=True):
                memory.add_metric([gpu, state], float(value))
        yield memory


__all__ = ["GpuSource", "KvwatchCollector"]


#: Per live engine rank (role, engine, model, rank, "hooks"): per hooked detector, the
#: requests its processes verified and skipped (every reason but mode_off).
RankCoverage = dict[LabelKey, dict[str, tuple[float, float]]]

_VERIFIED: Final = catalogue.COUNTER_BY_NAME["verifications"].family
_SKIPPED: Final = catalogue.COUNTER_BY_NAME["verifications_skipped"].family
_MODE_OFF: Final = catalogue.SKIP_REASON.check("mode_off")


def engine_views(
    state: State,
) -> tuple[dict[LabelKey, dict[str, float]], set[EngineInfo]]:
    """The engines' pool/context gauges by (role, engine, model, rank, source), newest producer
    first, and the rows of ``kvwatch_engine_info`` (:data:`EngineInfo`)."""
    latest, info, _ = engine_ranks(state)
    return latest, info


def config_errors(state: State) -> dict[tuple[str, str], int]:
    """Per (role, catalogue SETTING), each pair 0 included, the live engine processes that
    started with that setting invalid."""
    out = {
        (role, setting): 0 for role in catalogue.ROLE.values for setting in catalogue.SETTING.values
    }
    with state.lock:
        for producer in state.producers.values():
            if not producer.retired:
                for setting in set(producer.config_errors):
                    out[(_ROLE(producer.role), catalogue.SETTING.bound(setting))] += 1
    return out


def rank_coverage(state: State) -> RankCoverage:
    """What each live engine rank's live processes verified and skipped (:data:`RankCoverage`):
    an engine's ranks side by side, so a rank whose checks do not run now is seen (a restarted
    rank's earlier process does not cover for it)."""
    return engine_ranks(state, retired=False)[2]


def engine_ranks(
    state: State, *, retired: bool = True
) -> tuple[dict[LabelKey, dict[str, float]], set[EngineInfo], RankCoverage]:
    """:func:`engine_views` and the per-rank coverage in one pass (one bounding of labels).

    With ``retired`` the coverage of each live rank also holds its retired processes' counts,
    so the ``kvwatch_rank_verifications*`` counters never go down while the rank serves (a rank
    whose process restarts keeps its series; the old process's counts stay in it)."""
    latest: dict[LabelKey, tuple[float, dict[str, float]]] = {}
    info: set[EngineInfo] = set()
    coverage: RankCoverage = {}
    # The first N values of each unbounded label among what is live now, oldest producer first:
    # a slot taken by a producer that is gone (junk included) is free again.
    models, versions, ranks = FirstN(MAX_MODELS), FirstN(MAX_VERSIONS), FirstN(MAX_RANKS)
    with state.lock:
        for producer in sorted(state.producers.values(), key=lambda p: p.id):
            if producer.retired:
                continue
            role = _ROLE(producer.role)
            engine = _ENGINE(producer.engine)
            model = models(producer.model)
            mode = _hooks_label(catalogue.MODE, producer.mode)
            scrub = _hooks_label(catalogue.SCRUB, producer.scrub)
            info.add((engine, versions(producer.engine_version), role, model, mode, scrub))
            key: LabelKey = (role, engine, model, ranks(producer.rank), "hooks")
            newer = key not in latest or latest[key][0] <= producer.last_ts
            if producer.gauges and newer:
                latest[key] = (producer.last_ts, producer.gauges)
            _cover(coverage.setdefault(key, {}), producer)
        if retired:
            for producer in sorted(state.producers.values(), key=lambda p: p.id):
                # Bounded as the live ones were: a label no live producer holds is "other".
                key = (
                    _ROLE(producer.role),
                    _ENGINE(producer.engine),
                    models.known(producer.model),
                    ranks.known(producer.rank),
                    "hooks",
                )
                if producer.retired and key in coverage:
                    _cover(coverage[key], producer)
        for logged in state.logs.values():
            role = _ROLE(logged.role)
            engine = _ENGINE(logged.engine)
            model = models(logged.model)
            if logged.version:
                info.add((engine, versions(logged.version), role, model, "none", "none"))
            if logged.gauges:
                latest[(role, engine, model, ranks(logged.rank), "log")] = (0.0, logged.gauges)
    gauges = {key: values for key, (_, values) in latest.items()}
    return gauges, info, {key: rows for key, rows in coverage.items() if rows}


def _cover(rows: dict[str, tuple[float, float]], producer: Producer) -> None:
    """Add a producer's hooked detectors' verified and skipped requests to its rank's rows."""
    for family, labels, value in producer_counter_series(producer):
        detector = labels[0]  # both series' labels start with the detector (the catalogue's)
        if detector not in catalogue.HOOKED_DETECTORS:
            continue
        verified, skipped = rows.get(detector, (0.0, 0.0))
        if family == _VERIFIED:
            rows[detector] = (verified + value, skipped)
        elif family == _SKIPPED and _MODE_OFF not in labels:
            rows[detector] = (verified, skipped + value)
