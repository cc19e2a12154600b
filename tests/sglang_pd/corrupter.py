"""Test-only: change one KV value on prefill after kvwatch sealed it, before the transfer reads it.

The ``sglang.srt.plugins`` entry point ``corrupt_after_seal`` (written into the bed's venv by
setup_env.sh, loaded only by the bed's prefill server through ``SGLANG_PLUGINS``). A BEFORE hook
on ``_send_kv_chunk``, which SGLang 0.5.23's ``send_kv_chunk`` calls after kvwatch's seal hook
on ``send_kv_chunk`` ran: for a request whose id holds :data:`MARK`, the first value of
layer 0's keys in the request's first sent page is flipped in prefill's pool, so decode receives
KV that differs from what prefill sealed. The request is marked by its id (the client's ``rid``,
the same on prefill and decode); ``<MARK>-rank<r>`` changes only attention-TP rank ``r``'s shard
of the heads (every rank runs this plugin). Never part of kvwatch.
"""

from __future__ import annotations

import importlib
import re
import sys
from typing import Any

MARK = "corrupt-after-seal"
TARGET = "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin._send_kv_chunk"


def before_send(scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    last = kwargs.get("last_chunk", args[0] if args else False)
    if not last or MARK not in str(req.rid):
        return
    target = re.search(rf"{MARK}-rank(\d+)", str(req.rid))
    if target is not None and int(target.group(1)) != _tp_rank():
        return
    page_size = int(scheduler.token_to_kv_pool_allocator.page_size)
    start = int(getattr(req, "disagg_decode_prefix_len", 0) or 0)
    index = getattr(getattr(req, "kv", None), "req_pool_idx", None)
    index = req.req_pool_idx if index is None else index
    row = scheduler.req_to_token_pool.req_to_token[index]
    slot = int(row[start]) // page_size * page_size  # the first token slot of the first page
    keys = scheduler.token_to_kv_pool_allocator.get_kvcache().k_buffer[0]
    raw = keys[slot].view(-1)
    raw[0] = -raw[0] if float(raw[0]) != 0 else 1.0
    # SGLang's logging is not set up for plugins: the bed reads this line in the server's log.
    print(f"corrupt_after_seal: changed one KV value of {req.rid}", file=sys.stderr, flush=True)


def _tp_rank() -> int:
    try:
        parallel = importlib.import_module("sglang.srt.runtime_context").get_parallel()
        return int(parallel.attn_tp_rank)
    except Exception:
        return 0


def register() -> None:
    registry = importlib.import_module("sglang.srt.plugins.hook_registry")
    registry.HookRegistry.register(TARGET, before_send, registry.HookType.BEFORE)
