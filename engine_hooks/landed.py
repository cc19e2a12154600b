"""Which reserved pages a remote write filled, for engines whose transfer carries no page tags.

SGLang's and NIXL's transfers write decode's reserved pages without the tags kvwatch gives
them. When the transfer completes, the adapter marks written the pages that it really wrote,
told by the reserved canary being gone (all of them where the canary cannot tell: off, or a
pool it cannot stamp). A page the transfer did not write keeps the tag of its last write, so a
finding on it names whose KV it still holds (the blast radius), never the reader.
"""

from __future__ import annotations

import torch

from engine_hooks.canary import Purpose
from engine_hooks.detectors import Mode
from engine_hooks.watch import KVWatch, Ticket


def mark_landed(watch: KVWatch, ticket: Ticket) -> None:
    """Record the remote write into ``ticket``'s pages (no host sync on an accelerator)."""
    state, pool, canary = watch.state, watch.pool, watch.canary
    if state is None or pool is None or not ticket.page_count:
        return
    if canary is None or not canary.usable or canary.mode is Mode.OFF:
        pool.mark_written(ticket.pages, ticket.tags)
        return
    intact = state.intact(ticket.pages, ticket.tags, Purpose.RESERVED)
    if isinstance(intact, torch.Tensor):  # on the device: a select, no sync
        index = pool.as_index(ticket.pages)
        tags = torch.as_tensor(ticket.tags).to(device=pool.device, dtype=torch.int64)
        store = pool.tag_store
        store[index] = torch.where(intact, store.index_select(0, index), tags)
        return
    pages, gens = list(ticket.pages), list(ticket.tags)
    landed = [(p, t) for p, t, unwritten in zip(pages, gens, intact, strict=True) if not unwritten]
    if landed:
        pool.mark_written([p for p, _ in landed], [t for _, t in landed])
