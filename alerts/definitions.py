"""The alert and recording rules, for the generators: defined once in :mod:`kvwatch.alerting.rules`.

They live in the daemon's package because the daemon posts some of the alerts to Alertmanager
itself (:mod:`kvwatch.alerting.evaluate`), and the wheel ships ``kvwatch`` but not this folder.
"""

from kvwatch.alerting.rules import (
    ALERTS,
    ALERTS_GROUP,
    BELOW_FLOOR_PD,
    BELOW_FLOOR_RELEASE_RE,
    JOB_SELECTOR,
    PD_RELEASE_ENGINES,
    PD_ROLES,
    RECORDING_RULES,
    RULES_GROUP,
    RUNBOOK_BASE,
    SEVERITIES,
    VULNERABLE_PD,
    VULNERABLE_RELEASE_RE,
    Alert,
    Context,
    Increase,
    RecordingRule,
)

__all__ = [
    "ALERTS",
    "ALERTS_GROUP",
    "BELOW_FLOOR_PD",
    "BELOW_FLOOR_RELEASE_RE",
    "JOB_SELECTOR",
    "PD_RELEASE_ENGINES",
    "PD_ROLES",
    "RECORDING_RULES",
    "RULES_GROUP",
    "RUNBOOK_BASE",
    "SEVERITIES",
    "VULNERABLE_PD",
    "VULNERABLE_RELEASE_RE",
    "Alert",
    "Context",
    "Increase",
    "RecordingRule",
]
