"""When the hooks overwrite pages with zeros, and reading that choice from a setting."""

from __future__ import annotations

import logging
from enum import StrEnum


class Scrub(StrEnum):
    """When the hooks overwrite pages with zeros (independent of the detectors' modes)."""

    OFF = "off"
    ON_FREE = "on_free"  # when pages return to the free list
    ON_RESERVE = "on_reserve"  # when decode reserves pages for a remote write


def parse_scrub(value: object, setting: str, logger: logging.Logger) -> Scrub:
    """A scrub setting's value; any other than off, on_free or on_reserve is one error line (on
    ``logger``, naming ``setting``) and scrub off: a typo must neither stop the engine nor pass
    unnoticed."""
    text = str(value).strip().lower()
    try:
        return Scrub(text)
    except ValueError:
        choices = "|".join(s.value for s in Scrub)
        logger.error(
            "kvwatch: %s=%r is not one of %s; scrub stays off", setting, text[:32], choices
        )
        return Scrub.OFF
