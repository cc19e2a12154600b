"""Ground truth for the bed: which request's KV each decode page held (a test-only plugin).

Entry point ``page_owners`` (this bed's venv only), independent of kvwatch: before each batch
result, every request in the batch whose row reaches a page it was not seen on is written as one
JSON line ``{"rid", "pages"}`` (the pages its row reads, in order) to ``$KVWATCH_BED_OWNERS``;
and each request whose transfer decode admits (``DecodeTransferQueue.pop_transferred``), with
the pages its prompt's KV landed on, as ``{"rid", "pages", "admitted": true}``: a request done
at its first token (one new token asked) is in no batch on decode, yet its KV stays in those
pages for the next owner. A page's owner when a later request got it is the last earlier line
that lists it (:func:`last_owners`). Page ids only: no token, no KV.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
from pathlib import Path
from typing import Any

_seen: dict[str, int] = {}


def _record(scheduler: Any, reqs: Any, *, admitted: bool = False) -> None:
    path = os.environ.get("KVWATCH_BED_OWNERS")
    if not path or not reqs:
        return
    page_size = int(scheduler.page_size)
    rows = scheduler.req_to_token_pool.req_to_token
    lines = []
    for req in reqs:
        index = getattr(getattr(req, "kv", None), "req_pool_idx", None)
        index = getattr(req, "req_pool_idx", None) if index is None else index
        if index is None:
            continue
        # Admitted: the prompt's slots only (the first new token's is not given out yet).
        length = len(req.origin_input_ids) + (0 if admitted else len(req.output_ids))
        if length <= _seen.get(req.rid, 0):
            continue
        _seen[req.rid] = length
        pages = (rows[index, :length:page_size] // page_size).tolist()
        line = {"rid": str(req.rid), "pages": pages} | ({"admitted": True} if admitted else {})
        lines.append(json.dumps(line))
    if lines:
        with open(path, "a") as out:
            out.write("\n".join(lines) + "\n")


def register() -> None:
    scheduler_cls = importlib.import_module("sglang.srt.managers.scheduler").Scheduler
    original = scheduler_cls.process_batch_result

    @functools.wraps(original)
    def process_batch_result(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        _record(self, getattr(batch, "reqs", None))
        return original(self, batch, *args, **kwargs)

    scheduler_cls.process_batch_result = process_batch_result

    transfer_cls = importlib.import_module("sglang.srt.disaggregation.decode").DecodeTransferQueue
    pop_transferred = transfer_cls.pop_transferred

    is_fake = importlib.import_module("sglang.srt.disaggregation.utils")._is_fake_transfer

    @functools.wraps(pop_transferred)
    def _pop_transferred(self: Any, *args: Any, **kwargs: Any) -> Any:
        admitted = pop_transferred(self, *args, **kwargs)
        # A fake transfer (SGLang's own health checks) writes nothing to the pages it holds.
        sent = [req for req in admitted if not is_fake(req)]
        _record(self.scheduler, sent, admitted=True)
        return admitted

    transfer_cls.pop_transferred = _pop_transferred


def first_row(path: Path, rid: str) -> list[int]:
    """The pages of ``rid``'s row when it first ran on this server."""
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["rid"] == rid and not row.get("admitted"):
            return list(row["pages"])
    raise AssertionError(f"{rid} never ran on this server ({path})")


def last_owners(path: Path, reader: str, pages: list[int]) -> dict[str, set[int]]:
    """Whose KV ``pages`` held when ``reader`` got them: for each, the last earlier request
    whose row listed it (pages no earlier request held are left out)."""
    owner: dict[int, str] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["rid"] == reader:
            break
        for page in row["pages"]:
            owner[page] = row["rid"]
    found: dict[str, set[int]] = {}
    for page in pages:
        if page in owner:
            found.setdefault(owner[page], set()).add(page)
    return found
