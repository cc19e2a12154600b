"""The fast path's evaluation: the counter alerts' conditions on the samples /metrics serves.

Prometheus pages after scrape + evaluation + ``group_wait`` (about 41 s at worst with production
intervals, ``alerts/runbook.md``). The daemon knows of a mismatch the moment it reads the spool,
so for every alert of :mod:`kvwatch.alerting.rules` whose condition is a counter's increase
(:attr:`kvwatch.alerting.rules.Alert.increase`) it evaluates that condition on the families
its one collector renders for ``/metrics``
(:meth:`kvwatch.expose.metrics.KvwatchCollector.state_families`: no second collector, no text
round trip) and hands the alerts due to :mod:`kvwatch.alerting.notify`, with exactly the labels
the rule gives them: ``alertname``, the rule's labels, the ``by`` labels of
its expression (``node`` from the ``node`` setting, as Prometheus's target label) and the external
labels the operator configures, and the rule's annotations (:mod:`kvwatch.alerting.templates`).
Same labels, same fingerprint: Alertmanager merges the daemon's
alert and Prometheus's into one.

Timing mirrors Prometheus, so the two never flap against each other:

- firing: sent at once, re-sent every ``alertmanager_resend`` with ``endsAt = now + 4 x resend``,
  and at once when its context numbers (the node's affected and exposed requests) move: the
  alerts of one notification then state the same counts (Prometheus's side: re-sent every
  evaluation, ``deploy/prometheus.default``);
- quiet: from ``scrape interval + 2 ticks + MAX_BATCH_AGE`` before the rule can first resolve
  (``window`` after the last increase, less one scrape interval) nothing is sent: a firing post
  landing after Prometheus resolved would re-open the alert (the last ``endsAt`` outlasts it);
- resolved: ``window + scrape interval + 2 ticks`` after the last increase (after the rule's last
  firing send) it is sent with ``endsAt = now``, and re-sent with each resend for 15 minutes.

The evaluation runs on its own thread, woken by each spool poll; delivery never blocks it. The
Prometheus rule stays the path that survives a daemon that cannot reach Alertmanager.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import structlog
from prometheus_client.core import Metric

from kvspool import catalogue
from kvspool.catalogue import DaemonCounter
from kvwatch.alerting.notify import MAX_BATCH_AGE
from kvwatch.alerting.rules import ALERTS, Alert, Context, Increase
from kvwatch.alerting.templates import alert_annotations
from kvwatch.config import Config
from kvwatch.store.state import State

#: How often the conditions are evaluated when no spool poll wakes the evaluation.
TICK: Final = 1.0
#: The least time between two evaluations (the spool poll may wake it many times a second;
#: one evaluation renders the daemon's families, unless no record arrived; docs/performance.md).
MIN_SPACING: Final = 0.5
#: How long a resolved alert is re-sent (Prometheus's resolvedRetention).
RESOLVED_RETENTION: Final = 15 * 60.0
#: Prometheus's endsAt for a firing alert: 4 resend delays ahead.
ENDS_AT_RESENDS: Final = 4

#: One alert as Alertmanager's ``POST /api/v2/alerts`` takes it.
Posted = dict[str, Any]
#: (alertname or context name, the kept label values).
_Key = tuple[str, tuple[str, ...]]

# -- which alerts, with which labels --------------------------------------------------------------


def fast_alerts() -> tuple[Alert, ...]:
    """The alerts the daemon posts itself: those whose condition is a counter's increase."""
    return tuple(a for a in ALERTS if a.increase is not None)


def counter_labels(counter: str) -> tuple[str, ...]:
    """The labels the daemon's /metrics gives the catalogued counter ``kvwatch_<counter>``."""
    family = catalogue.PREFIX + counter
    for series in catalogue.COUNTER_SERIES:
        if series.family == family:
            return series.label_names
    found = catalogue.FAMILY_BY_NAME.get(family)
    if found is None or found.type != "counter":
        raise ValueError(f"{family} is not a catalogued counter")
    return found.labels


def kept_labels(increase: Increase | Context) -> tuple[str, ...]:
    """The ``by`` labels the daemon fills from its own samples: all but ``node``, which is the
    scrape target's label. A ``by`` label the counter does not carry is an error: the rule would
    group on a label the daemon cannot know."""
    own = counter_labels(increase.counter)
    kept = tuple(name for name in increase.by if name != "node")
    missing = [name for name in kept if name not in own]
    if missing or "node" not in increase.by:
        raise ValueError(
            f"increase({increase.counter}) by {increase.by}: the daemon can fill node and "
            f"{own}, not {missing or 'a rule without node'}"
        )
    return kept


def alert_labels(
    alert: Alert, node: str, values: dict[str, str], external: dict[str, str]
) -> dict[str, str]:
    """The labels Prometheus gives ``alert`` for the series ``values`` on node ``node``: the
    expression's ``by`` labels, the rule's labels and ``alertname``, then each external label
    the alert does not already carry (Prometheus never overrides an alert's own label)."""
    assert alert.increase is not None
    labels = {name: values[name] for name in kept_labels(alert.increase)}
    labels["node"] = node
    labels.update(alert.all_labels)
    labels["alertname"] = alert.name
    for name, value in external.items():
        labels.setdefault(name, value)
    return labels


def growth(samples: deque[tuple[float, float]], now: float, window: float) -> float:
    """How much a counter grew over ``(now - window, now]``, from (time, value) samples: the
    newest value less the one it had when the window opened (its first sample when it is
    younger), never below 0 (a reset), as the rule's Context query computes it."""
    if not samples:
        return 0.0
    start = samples[0][1]
    for when, value in samples:
        if when > now - window:
            break
        start = value
    return max(0.0, samples[-1][1] - start)


# -- the condition, per alert and label set ------------------------------------------------------

FIRING, QUIET, RESOLVED = "firing", "quiet", "resolved"


@dataclass
class Tracker:
    """One alert instance (an alert and its label set) as the daemon sees it."""

    alert: Alert
    labels: dict[str, str]
    last_value: float
    #: (time, amount) of each rise still inside the window.
    rises: deque[tuple[float, float]] = field(default_factory=deque)
    last_rise: float = 0.0
    #: The ``$value`` of the last firing post.
    shown: float = 0.0
    #: The context numbers of the last post: a firing alert whose numbers moved is re-sent at
    #: once, so that every alert of a notification states the node's latest counts.
    context_shown: dict[str, float] = field(default_factory=dict)
    phase: str = ""
    starts_at: float = 0.0
    last_sent: float = 0.0
    resolved_at: float = 0.0

    @property
    def window(self) -> float:
        assert self.alert.increase is not None
        return self.alert.increase.window_seconds


def _rfc3339(ts: float) -> str:
    moment = datetime.datetime.fromtimestamp(ts, datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Evaluator:
    """Evaluates the counter alerts on the daemon's samples; hands the alerts due to ``deliver``.

    ``source`` returns the families the daemon's /metrics serves (its collector's
    ``state_families``).
    """

    def __init__(
        self,
        config: Config,
        state: State,
        source: Callable[[], Iterable[Metric]],
        deliver: Callable[[list[Posted]], None] | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.log = structlog.get_logger("kvwatch.pager")
        self.state = state
        self.source = source
        self.deliver = deliver
        self.clock = clock
        self.node = config.node_name
        self.external = dict(config.alertmanager_labels)
        self.resend = config.alertmanager_resend
        # The rule resolves at the first evaluation whose window holds no sample from before the
        # last rise: not before (last rise + window - scrape interval), and its last firing send
        # is before (last rise + window). TICK covers the evaluation seeing a rise late.
        self.resolve_after = config.prometheus_scrape_interval + 2 * TICK
        self.quiet_ahead = self.resolve_after + MAX_BATCH_AGE
        self.alerts = fast_alerts()
        self.families = {catalogue.exposed(a.increase.counter) for a in self.alerts if a.increase}
        #: The alerts' context numbers (:class:`kvwatch.alerting.rules.Context`): their samples, by
        #: (name, kept label values), trimmed to the window.
        self.contexts = {c.name: c for a in self.alerts for c in a.context}
        self.families |= {catalogue.exposed(c.counter) for c in self.contexts.values()}
        self._context_samples: dict[_Key, deque[tuple[float, float]]] = {}
        self.trackers: dict[_Key, Tracker] = {}
        self._baseline: dict[_Key, float] | None = None
        self._seen: tuple[float, float] = (-1.0, -1.0)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_eval = 0.0
        self._evaluating = threading.Lock()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Take the baseline (the journal's counters, before the first poll: a daemon restart is
        no increase) and start the thread."""
        self.evaluate(self.clock())
        self._thread = threading.Thread(target=self._run, name="kvwatch-pager", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """The spool was polled: evaluate soon (never blocks)."""
        self._wake.set()

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(TICK)
            self._wake.clear()
            if self._stop.is_set():
                return
            spacing = self._last_eval + MIN_SPACING - time.monotonic()
            if spacing > 0:
                self._stop.wait(spacing)
            self._last_eval = time.monotonic()
            try:
                batch = self.evaluate(self.clock())
            except Exception as exc:  # a bug here must not stop the daemon
                self.log.error(
                    "pager.evaluate_failed", error=str(exc), error_type=type(exc).__name__
                )
                continue
            if batch and self.deliver is not None:
                self.deliver(batch)

    # -- the samples --------------------------------------------------------------------------

    def totals(self) -> dict[_Key, float]:
        """Each counter alert's ``sum by`` over the daemon's samples: (alertname, by-values)."""
        return self._sums(self._samples())[0]

    def _samples(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in self.source():
            for sample in family.samples:
                if sample.name in self.families:
                    samples.setdefault(sample.name, []).append((sample.labels, sample.value))
        return samples

    def _sums(
        self, samples: dict[str, list[tuple[dict[str, str], float]]]
    ) -> tuple[dict[_Key, float], dict[_Key, float]]:
        """The alerts' sums (:meth:`totals`) and the contexts' sums, by (name, kept values)."""
        out: dict[_Key, float] = {}
        sources: list[tuple[str, Increase | Context, dict[_Key, float]]]
        sources = [(a.name, a.increase, out) for a in self.alerts if a.increase is not None]
        contexts: dict[_Key, float] = {}
        sources += [(name, c, contexts) for name, c in self.contexts.items()]
        for name, summed, into in sources:
            kept = kept_labels(summed)
            for labels, value in samples.get(catalogue.exposed(summed.counter), []):
                if isinstance(summed, Increase) and not summed.matches(labels):
                    continue
                key = (name, tuple(labels[label] for label in kept))
                into[key] = into.get(key, 0.0) + value
        return out, contexts

    def _note_contexts(self, now: float, sums: dict[_Key, float]) -> None:
        for key, value in sums.items():
            samples = self._context_samples.setdefault(key, deque())
            if not samples or samples[-1][1] != value:
                samples.append((now, value))
            window = self.contexts[key[0]].window_seconds
            # Keep the newest sample from before the window: the value the window opened with.
            while len(samples) > 1 and samples[1][0] <= now - window:
                samples.popleft()

    def context_values(self, alert: Alert, labels: dict[str, str], now: float) -> dict[str, float]:
        """The alert's context numbers for the instance ``labels`` at ``now``."""
        out = {}
        for context in alert.context:
            key = (context.name, tuple(labels[label] for label in kept_labels(context)))
            samples = self._context_samples.get(key, deque())
            out[context.name] = growth(samples, now, context.window_seconds)
        return out

    # -- the state machine --------------------------------------------------------------------

    def evaluate(self, now: float) -> list[Posted]:
        """Update every tracker from the samples at ``now``; the alerts due to be posted."""
        with self._evaluating:
            return self._evaluate(now)

    def _changes(self) -> tuple[float, float]:
        """Moves whenever the reader applies a record or counts a lost one: the counters the
        alerts watch change only then."""
        with self.state.lock:
            daemon = self.state.daemon
            return daemon.get((DaemonCounter.SPOOL_RECORDS, ()), 0.0), daemon.get(
                (DaemonCounter.SPOOL_LOST_RECORDS, ()), 0.0
            )

    def _evaluate(self, now: float) -> list[Posted]:
        changes = self._changes()
        if self._baseline is not None and not self.trackers and changes == self._seen:
            return []  # nothing read, nothing firing: skip rendering the families
        self._seen = changes
        totals, context_sums = self._sums(self._samples())
        self._note_contexts(now, context_sums)
        if self._baseline is None:
            self._baseline = totals
            return []
        self._note_rises(now, totals, self._baseline)
        due = []
        for key, tracker in list(self.trackers.items()):
            if tracker.phase == RESOLVED and now >= tracker.resolved_at + RESOLVED_RETENTION:
                del self.trackers[key]
                self._baseline[key] = tracker.last_value
                continue
            post = self._step(tracker, now)
            if post is not None:
                due.append(post)
        return due

    def _note_rises(
        self, now: float, totals: dict[_Key, float], baseline: dict[_Key, float]
    ) -> None:
        by_name = {a.name: a for a in self.alerts}
        for key, value in totals.items():
            tracker = self.trackers.get(key)
            before = tracker.last_value if tracker else baseline.get(key, 0.0)
            # A counter that went down was reset: Prometheus's increase counts the new value.
            rise = value - before if value >= before else value
            if tracker is None:
                if rise <= 0:
                    continue
                alert = by_name[key[0]]
                assert alert.increase is not None
                values = dict(zip(kept_labels(alert.increase), key[1], strict=True))
                tracker = Tracker(alert, alert_labels(alert, self.node, values, self.external), 0)
                self.trackers[key] = tracker
            tracker.last_value = value
            if rise > 0:
                tracker.rises.append((now, rise))
                tracker.last_rise = now

    def _step(self, tracker: Tracker, now: float) -> Posted | None:
        window = tracker.window
        while tracker.rises and tracker.rises[0][0] <= now - window:
            tracker.rises.popleft()
        if tracker.rises:
            if tracker.phase in ("", RESOLVED):
                tracker.phase, tracker.starts_at, tracker.last_sent = FIRING, now, now
                self.log.warning("pager.firing", alert=tracker.alert.name, labels=tracker.labels)
                return self._payload(tracker, now + ENDS_AT_RESENDS * self.resend, now)
            if now < tracker.last_rise + window - self.quiet_ahead:
                if tracker.phase == QUIET:  # a new rise moved the end of the window
                    tracker.phase, tracker.last_sent = FIRING, 0.0
                due = now >= tracker.last_sent + self.resend
                if due or (
                    tracker.alert.context
                    and self.context_values(tracker.alert, tracker.labels, now)
                    != tracker.context_shown
                ):
                    tracker.last_sent = now
                    return self._payload(tracker, now + ENDS_AT_RESENDS * self.resend, now)
            else:
                tracker.phase = QUIET
            return None
        if tracker.phase in (FIRING, QUIET):
            if now >= tracker.last_rise + window + self.resolve_after:
                tracker.phase, tracker.resolved_at, tracker.last_sent = RESOLVED, now, now
                self.log.info("pager.resolved", alert=tracker.alert.name, labels=tracker.labels)
                return self._payload(tracker, now, now)
            return None
        if tracker.phase == RESOLVED and now >= tracker.last_sent + self.resend:
            tracker.last_sent = now
            return self._payload(tracker, tracker.resolved_at, now)
        return None

    def _payload(self, tracker: Tracker, ends_at: float, now: float) -> Posted:
        if tracker.rises:  # a resolved alert keeps its last value, as Prometheus's does
            tracker.shown = sum(amount for _, amount in tracker.rises)
        tracker.context_shown = self.context_values(tracker.alert, tracker.labels, now)
        return {
            "labels": dict(tracker.labels),
            "annotations": alert_annotations(
                tracker.alert, tracker.labels, tracker.shown, tracker.context_shown
            ),
            "startsAt": _rfc3339(tracker.starts_at),
            "endsAt": _rfc3339(ends_at),
        }
