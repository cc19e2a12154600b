"""When the hooks overwrite pages with zeros.

Scrub (``KVWatch(..., scrub=Scrub.ON_FREE | Scrub.ON_RESERVE)``, independent of the detector
modes): pages are zeroed in every buffer, and their tags reset to "never written", when they
return to the free list (``on_free``) or when decode reserves them for a remote write
(``on_reserve``); the canary stamps are written after the scrub, so detection works as without
it. A read of a page nobody wrote for the reader then reads zeros, not another request's KV.
On an accelerator it is one fill launch, no sync. See docs/scrub.md for what each choice
covers and costs.
"""

from __future__ import annotations

from enum import StrEnum


class Scrub(StrEnum):
    """When the hooks overwrite pages with zeros (independent of the detectors' modes)."""

    OFF = "off"
    ON_FREE = "on_free"  # when pages return to the free list
    ON_RESERVE = "on_reserve"  # when decode reserves pages for a remote write
