"""The SGLang releases of the incident's table, as the engine behaviours they switch on."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Release:
    version: str
    #: #38935: both admission queues check ``to_finish``, not just ``finished()``.
    admission_checks_to_finish: bool
    #: #36988: prefill retires an aborted result before it reaches decode.
    retire_aborted_prefill: bool
    #: #41023: an aborted request's decode pages are held until prefill's writes drained.
    deferred_release: bool
    #: #41612: the router drops the decode half when prefill fails.
    router_drops_decode_half: bool


RELEASES = {
    r.version: r
    for r in (
        Release("0.5.19", False, False, False, False),
        Release("0.5.20", False, True, False, False),
        Release("0.5.21", True, True, True, False),
        Release("0.5.22", True, True, True, True),
    )
}
LATEST = "0.5.22"


def release(version: str) -> Release:
    try:
        return RELEASES[version]
    except KeyError:
        raise ValueError(f"unknown release {version!r}; known: {', '.join(RELEASES)}") from None
