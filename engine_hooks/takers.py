"""Who took a set of freed pages: the requests that wrote into them while they were watched.

A request's pages freed before a remote transfer was done with them (vLLM's lease that expired
unread on prefill, SGLang's aborted transfer released on a timeout on decode) are watched for a
window; every request that writes into them meanwhile is a taker, with the pages it took and
when it first did. Every taker, not only a page's last holder: a page taken by one request,
freed and taken by another within the window held both requests' KV in turn (the page holder
slots keep a page's recent holders only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from kvspool.records import Source

#: How long freed pages are watched for takers, by default (seconds).
DEFAULT_FREED_WATCH_S: Final = 10.0


@dataclass(slots=True)
class Taker:
    pages: set[int]
    first_at: float


@dataclass(slots=True)
class Takers:
    """The takers of ``watched`` (one request instance's freed pages) since ``since``."""

    request_id: str
    instance: str
    pages: list[int]
    since: float
    #: Every request (id, instance) that wrote into the pages since ``since``.
    takers: dict[tuple[str, str], Taker] = field(default_factory=dict)
    #: The pages as a set, built once: :meth:`took` runs for every write of every step.
    watched: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        self.watched = frozenset(self.pages)

    def took(self, request_id: str, instance: str, pages: Sequence[int], at: float) -> None:
        """``request_id`` (``instance``) wrote ``pages`` at ``at``; those watched are taken."""
        if request_id == self.request_id and instance in ("", self.instance):
            return  # the freed request itself (a request id is not an identity: its instance)
        hit = self.watched.intersection(pages)
        if hit:
            taker = self.takers.setdefault((request_id, instance), Taker(set(), at))
            taker.pages |= hit

    def sources(self) -> list[Source]:
        """The takers as the sources of the freed request's finding (pages, first write)."""
        return [
            Source(
                request_id=rid, pages=len(t.pages), instance=instance or None,
                written_at=t.first_at,
            )
            for (rid, instance), t in self.takers.items()
        ]  # fmt: skip
