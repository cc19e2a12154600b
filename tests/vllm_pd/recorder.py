# mypy: allow-subclassing-any, disable-error-code="import-not-found"
"""A MultiConnector child for the PD bed that records vLLM's own block allocations.

The lease test's ground truth: which requests vLLM's scheduler gave which blocks, and when,
written by the engine process itself (a JSON line per scheduled request with new blocks, from
``SchedulerOutput``: ``scheduled_new_reqs[].block_ids`` and ``scheduled_cached_reqs
.new_block_ids``), never from kvwatch's bookkeeping. Scheduler side only; it moves no KV and
claims no tokens.
"""

from __future__ import annotations

import json
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)


class BlockRecorder(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.path = str(extra["path"])

    def _write(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            with open(self.path, "a", encoding="utf-8") as out:
                out.writelines(json.dumps(row) + "\n" for row in rows)

    # -- scheduler --------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        now = time.time()
        rows = [
            {"request_id": new.req_id, "blocks": list(new.block_ids[0]), "t": now}
            for new in scheduler_output.scheduled_new_reqs
            if new.block_ids and new.block_ids[0]
        ]
        cached = scheduler_output.scheduled_cached_reqs
        for rid, added in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if added and added[0]:
                rows.append({"request_id": rid, "blocks": list(added[0]), "t": now})
        self._write(rows)
        return KVConnectorMetadata()

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        return False, None

    # -- worker -----------------------------------------------------------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
