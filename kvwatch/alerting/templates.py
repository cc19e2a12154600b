"""The rules' annotations, rendered as Prometheus renders them, for the alerts the daemon posts
itself (:mod:`kvwatch.alerting.evaluate`): the subset of Go's template language the counter alerts
use, so that the daemon's alert and Prometheus's carry the same text."""

from __future__ import annotations

import re
from collections.abc import Mapping

from kvwatch.alerting.rules import Alert

_ACTION = re.compile(r"\{\{(.*?)\}\}")
_LABEL = re.compile(r"^\s*\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)\s*$")
_PRINTF = re.compile(r'^\s*\$value\s*\|\s*printf\s+"(%\.\d+f)"\s*$')
_VALUE = re.compile(r"^\s*\$value\s*$")


def _go_float(value: float) -> str:
    """Go's ``%v`` of a float64 for the values a counter's increase takes."""
    return str(int(value)) if value.is_integer() and abs(value) < 1e21 else repr(value)


def render(
    template: str,
    labels: dict[str, str],
    value: float,
    context: Mapping[str, float] | None = None,
) -> str:
    """The template language subset the counter alerts use: ``{{ $labels.x }}``,
    ``{{ $value }}``, ``{{ $value | printf "%.Nf" }}`` and an alert's context numbers
    (``{{ <name> }}``, :class:`kvwatch.alerting.rules.Context`, shown as Prometheus shows
    them: ``%.0f``);
    anything else is a ValueError (a test renders every counter alert's annotations, so a new
    construct fails there, not at 3 a.m.)."""

    def one(match: re.Match[str]) -> str:
        action = match.group(1)
        if context and action.strip() in context:
            return f"{context[action.strip()]:.0f}"
        if m := _LABEL.match(action):
            return labels.get(m.group(1), "")
        if m := _PRINTF.match(action):
            return m.group(1) % value
        if _VALUE.match(action):
            return _go_float(value)
        raise ValueError(f"template action not supported by the daemon's fast path: {action!r}")

    return _ACTION.sub(one, template)


def alert_annotations(
    alert: Alert,
    labels: dict[str, str],
    value: float,
    context: Mapping[str, float] | None = None,
) -> dict[str, str]:
    return {key: render(text, labels, value, context) for key, text in alert.annotations.items()}
