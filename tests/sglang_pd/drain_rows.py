"""Ground truth for test_pd_drain.py and the radix dedup test: decode's reserves and its
deferred releases (a test-only plugin, independent of kvwatch).

Plugin ``drain_rows`` (an entry point of this bed's venv, setup_env.sh), loaded by SGLang in
decode's scheduler like any other. Each line goes to ``$KVWATCH_BED_OWNERS``, the file
``page_owners`` writes each decode batch's rows to, so the order of the lines is the order in
which decode's scheduler did these things:

- ``DecodePreallocQueue._pre_alloc`` (its result: the slots SGLang reserved for the request):
  ``{"rid", "pages", "reserved": true, "at"}``;
- ``DecodeTransferQueue._do_release`` (a held request's pages go back):
  ``{"rid", "pages": [], "released": <bootstrap room>, "at"}``;
- ``DecodeTransferQueue._observe_deferred_kv_release`` (SGLang's own outcome of that release):
  ``{"rid", "pages": [], "outcome": "drained" | "timeout" | "error", "at"}``.

``at`` is ``time.time()``. Page ids and SGLang's own values only: no token, no KV, nothing of
kvwatch's.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import time
from typing import Any

#: The request ``_do_release`` released last: the one its outcome is said for.
_released: list[str] = []


def _write(line: dict[str, Any]) -> None:
    path = os.environ.get("KVWATCH_BED_OWNERS")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(line | {"at": time.time()}) + "\n")


def register() -> None:
    decode = importlib.import_module("sglang.srt.disaggregation.decode")
    prealloc, transfer = decode.DecodePreallocQueue, decode.DecodeTransferQueue
    pre_alloc = prealloc._pre_alloc
    do_release = transfer._do_release
    observe = transfer._observe_deferred_kv_release

    @functools.wraps(pre_alloc)
    def _pre_alloc(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        kv_loc = pre_alloc(self, req, *args, **kwargs)
        if kv_loc is not None:
            size = int(self.token_to_kv_pool_allocator.page_size)
            pages = sorted({int(slot) // size for slot in kv_loc.tolist()})
            _write({"rid": str(req.rid), "pages": pages, "reserved": True})
        return kv_loc

    @functools.wraps(do_release)
    def _do_release(self: Any, decode_req: Any, *args: Any, **kwargs: Any) -> Any:
        rid = str(decode_req.req.rid)
        _released[:] = [rid]
        _write({"rid": rid, "pages": [], "released": int(decode_req.req.bootstrap_room)})
        return do_release(self, decode_req, *args, **kwargs)

    @functools.wraps(observe)
    def _observe(self: Any, duration_seconds: float, outcome: str) -> Any:
        rid = _released[0] if _released else ""
        _write({"rid": rid, "pages": [], "outcome": str(outcome)})
        return observe(self, duration_seconds=duration_seconds, outcome=outcome)

    prealloc._pre_alloc = _pre_alloc
    transfer._do_release = _do_release
    transfer._observe_deferred_kv_release = _observe
