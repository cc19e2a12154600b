"""An engine's kvwatch settings, checked where the engine starts.

Each value is read through :class:`Options`, which never raises: a bad value is one error line
in the engine's log naming where it was set, the value and the valid ones, the setting runs
with its documented fallback, and its catalogue name goes on every hello the process writes
(``config_errors``), so the daemon shows the engine as misconfigured (``kvwatch status``
ALARM, ``kvwatch_engine_config_errors``). A typo must neither stop the engine nor pass
unnoticed.

Fallbacks: a bad ``mode`` runs as ``log`` (findings are recorded and page, requests are served:
a typo never fails users' requests, nor turns detection off); a bad per-detector mode runs as
the engine's mode; a bad number runs as its default; a bad scrub as ``off``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

from engine_hooks.detectors import Mode
from engine_hooks.scrub import Scrub
from kvspool import catalogue

_MODES = "|".join(m.value for m in Mode)
_SCRUBS = "|".join(s.value for s in Scrub)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _shown(value: object) -> str:
    return repr(str(value)[:64])


class Options:
    """The checker of one engine's settings; ``errors`` holds the catalogue SETTING of each
    invalid one, in the order read."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.errors: list[str] = []

    def invalid(self, setting: str, where: str, value: object, valid: str, fallback: str) -> None:
        """Say that ``where`` (as the operator wrote it) holds a bad ``value``."""
        self.logger.error(
            "kvwatch: %s=%s is not valid (valid: %s); %s. Fix the setting and restart the engine",
            where,
            _shown(value),
            valid,
            fallback,
        )
        self._count(setting)

    def _count(self, setting: str) -> None:
        name = catalogue.SETTING.bound(setting)
        if name not in self.errors:
            self.errors.append(name)

    def mode(self, setting: str, where: str, value: object, default: Mode) -> Mode:
        text = str(value).strip().lower()
        try:
            return Mode(text)
        except ValueError:
            self.invalid(setting, where, value, _MODES, f"running as {default.value}")
            return default

    def scrub(self, setting: str, where: str, value: object) -> Scrub:
        text = str(value).strip().lower() or Scrub.OFF.value
        try:
            return Scrub(text)
        except ValueError:
            self.invalid(setting, where, value, _SCRUBS, "scrub stays off")
            return Scrub.OFF

    def seconds(
        self, setting: str, where: str, value: object, default: float, minimum: float
    ) -> float:
        """A number of seconds of at least ``minimum`` (a plain number: ``1.5``, not ``1.5s``)."""
        try:
            number = float(str(value).strip())
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number < minimum:
            self.invalid(
                setting,
                where,
                value,
                f"a number of seconds >= {minimum:g}, such as {default:g}",
                f"using {default:g}",
            )
            return default
        return number

    def flag(self, setting: str, where: str, value: object, default: bool) -> bool:
        text = str(value).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        self.invalid(setting, where, value, "|".join(_TRUE + _FALSE), f"using {int(default)}")
        return default

    def unknown(self, names: Iterable[str], known: Iterable[str], where: str) -> None:
        """Settings given that kvwatch does not know (a misspelt name would else be ignored)."""
        valid = ", ".join(sorted(known))
        for name in sorted(names):
            self.logger.error(
                "kvwatch: %s%s is not a kvwatch setting (known: %s); ignored. Fix the name and "
                "restart the engine",
                where,
                _shown(name),
                valid,
            )
            self._count("option")


def mode_label(modes: Iterable[Mode]) -> str:
    """The catalogue MODE of a process whose detectors run in ``modes``."""
    distinct = set(modes)
    return distinct.pop().value if len(distinct) == 1 else "mixed"
