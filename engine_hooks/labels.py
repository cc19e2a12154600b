"""The catalogue's labels as enums, for the hooks and the adapters: no label is a bare string.

Each enum lists the values of one label of :mod:`kvspool.catalogue`; at import every member is
checked against the catalogue (a misspelt one is a ``ValueError`` here, never a counter under
``other``), and ``tests/engine_hooks/test_doors.py`` checks that each enum holds every value the
catalogue has, so neither can drift from the other.
"""

from __future__ import annotations

from enum import StrEnum

from kvspool.catalogue import DETECTOR, HOOK, KIND, OTHER, SKIP_REASON, Label


class Detector(StrEnum):
    CANARY = "canary"
    CHECKSUM = "checksum"
    PAGE_TAG = "page_tag"
    ADMISSION = "admission"
    ENGINE_CANARY = "engine_canary"
    ENGINE_CHECKSUM = "engine_checksum"


class Skip(StrEnum):
    """Why a detector did not verify a request (``verifications_skipped{reason}``)."""

    MODE_OFF = "mode_off"
    UNSUPPORTED_LAYOUT = "unsupported_layout"
    NO_SEAL = "no_seal"
    NO_POOL = "no_pool"
    HOOK_ERROR = "hook_error"
    OTHER = OTHER


class Hook(StrEnum):
    ALLOC = "alloc"
    FREE = "free"
    RESERVE = "reserve"
    SEAL = "seal"
    VERIFY = "verify"
    STEP = "step"
    LANDED = "landed"
    WROTE = "wrote"
    RESOLVE = "resolve"
    ADMISSION = "admission"
    STARTUP = "startup"
    FLUSH = "flush"


class Kind(StrEnum):
    """What a mismatch found (``mismatches{kind}``)."""

    UNWRITTEN_PAGE = "unwritten_page"
    WRITE_TO_FREE_PAGE = "write_to_free_page"
    DIGEST = "digest"
    PAGE_COUNT = "page_count"
    LAYOUT_MISMATCH = "layout_mismatch"
    STALE_TAG = "stale_tag"
    DOUBLE_FREE = "double_free"
    ABORTED_ADMITTED = "aborted_admitted"
    FREED_BEFORE_READ = "freed_before_read"
    FREED_BEFORE_DRAIN = "freed_before_drain"
    OTHER = OTHER


def catalogued(enum: type[StrEnum], label: Label) -> type[StrEnum]:
    """``enum``, each of whose values ``label`` catalogues; a ``ValueError`` naming the first
    that it does not."""
    for member in enum:
        if member.value not in label.values:
            raise ValueError(f"{member.value!r} is not a catalogued {label.name}")
    return enum


#: Each enum and the catalogue label it names (checked here, at import).
LABELS: dict[type[StrEnum], Label] = {
    catalogued(Detector, DETECTOR): DETECTOR,
    catalogued(Skip, SKIP_REASON): SKIP_REASON,
    catalogued(Hook, HOOK): HOOK,
    catalogued(Kind, KIND): KIND,
}
