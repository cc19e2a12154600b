"""The seal's row record: per page a seal wrote, whose KV each of its token rows holds.

A writer that fills only the first rows of its last page (a prompt shorter than its pages)
leaves the rest to the page's previous holder, whom the seal names as *residue* (see
:class:`~engine_hooks.detectors.Seal`); with scrub on, that tail is zeroed instead. The record
is kept at the seal (a sync point) for the residue only, top down: (holder, or None for zeros;
rows up to).
"""

from __future__ import annotations

import torch

from engine_hooks.pagestate import NOBODY, UNKNOWN, Ints, PageState
from engine_hooks.pool import PagedKVPool
from engine_hooks.tickets import RequestKeys

#: A request instance: (request id, instance).
Ident = tuple[str, str]


class SealRows:
    """The row record of one pool's pages (see the module docstring)."""

    def __init__(self, pool: PagedKVPool, state: PageState, requests: RequestKeys) -> None:
        self.pool = pool
        self.state = state
        self.requests = requests
        self._rows: dict[int, list[tuple[Ident | None, int]]] = {}

    def sealed(
        self, index: Ints, request_id: str, tokens: int | None, scrub: bool
    ) -> tuple[Ident, ...]:
        """``request_id`` sealed the pages ``index``, ``tokens`` rows of them where known: the
        residue of its last page (after zeroing that page's tail where ``scrub``)."""
        residue: tuple[Ident, ...] = ()
        count, page_size = len(index), self.pool.page_size
        me = (request_id[:128], "")
        if count and tokens is not None and 0 <= tokens < count * page_size:
            last = index[count - 1 :]
            used = max(0, tokens - (count - 1) * page_size)
            if not scrub:
                residue = self._residue(int(last[0]), used, request_id)
            else:
                self.state.scrub_tail(int(last[0]), used)
                self._rows[int(last[0])] = [(me, used), (None, page_size)]
            full = [int(p) for p in index[: count - 1]]
        else:
            full = [int(p) for p in index]
        for page in full:
            self._rows[page] = [(me, page_size)]
        return residue

    def _residue(self, page: int, used: int, writer: str) -> tuple[Ident, ...]:
        """Whose KV stays in rows ``used`` and up of ``page`` once ``writer`` wrote the rows
        before them: from the rows the page's earlier seals wrote, where known; else the page's
        holder by its tag, if those rows are not zeros (never written, or scrubbed)."""
        size, me = self.pool.page_size, (writer[:128], "")
        layers = self._rows.get(page)
        if layers is None:
            holders = self._holders([page], writer) if self._tail_written(page, used) else ()
            layers = [*((h, size) for h in holders), (None, size)]
        out: list[Ident] = []
        below = 0
        for holder, upto in layers:
            if upto > max(below, used) and holder is not None and holder[0] != writer:
                out.append(holder)
            below = max(below, upto)
        self._rows[page] = [(me, used), *((h, u) for h, u in layers if u > used)]
        return tuple(sorted(set(out)))

    def _tail_written(self, page: int, used: int) -> bool:
        """Whether any row of ``page`` from ``used`` on is not zeros, in any buffer."""
        size = self.pool.page_size
        for view in self.pool.page_views:
            rows = view[page].view(size, -1)
            if bool(rows[used:].any()):
                return True
        return False

    def forget(self, pages: Ints, *, zeroed: bool = False) -> None:
        """The pages were written (or zeroed) other than by a seal: rows unknown (or zeros).

        Nothing to do while no seal has recorded rows (a decode engine, which never seals):
        a page without a record has its tail read at the seal, and a scrubbed tail reads as
        zeros there. So no hook on decode's per-step path (``extend``, ``wrote``) copies page
        ids to the host, which on an accelerator is a sync."""
        if not self._rows:
            return
        size = self.pool.page_size
        for page in pages.tolist() if isinstance(pages, torch.Tensor) else pages:
            if zeroed:
                self._rows[int(page)] = [(None, size)]
            else:
                self._rows.pop(int(page), None)

    def _holders(self, pages: Ints, reader: str) -> tuple[Ident, ...]:
        """The requests (id, instance) whose data these pages hold now, other than ``reader``."""
        keys, _ = self.state.sources(pages)
        idents = {self.requests.get(k) for k in keys if k not in (NOBODY, UNKNOWN)}
        return tuple(sorted(i for i in idents if i is not None and i[0] != reader))
