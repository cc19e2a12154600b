"""A MultiConnector child for the PD bed that flips one KV byte after kvwatch sealed it.

Listed on the prefill server after kvwatch and before the transport, it corrupts the first
block of each request sent with ``vllm_xargs: {"kvwatch_bed_corrupt": h}``: the first byte of
KV head ``h - 1``'s first token in the first layer (``1``: head 0; a higher head lands in another
decode rank's shard at TP > 1), in
``wait_for_save``: after the forward wrote the block and kvwatch sealed it, before NIXL reads it
for decode. That is a transfer corrupted after the seal, made by vLLM's own step order. It moves
no KV and claims no tokens; requests without the flag are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from engine_hooks.vllm.layout import head_views

FLAG = "kvwatch_bed_corrupt"


@dataclass
class CorruptMeta(KVConnectorMetadata):
    #: The first block of each flagged request scheduled in this step, and the head to hit.
    blocks: list[tuple[int, int]] = field(default_factory=list)


class CorruptAfterSeal(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.layer: torch.Tensor | None = None  # the first layer's [B, H, N, C] view

    # -- worker -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        views = head_views(kv_caches, self.num_blocks)
        if views is None:
            raise RuntimeError("corrupter: KV layout has no [B, H, N, C] views")
        self.layer = views[0]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, CorruptMeta)
        assert self.layer is not None
        heads = self.layer.shape[1]
        for block, head in meta.blocks:
            if head < heads:  # this rank holds the head (its local index at TP 1)
                self.layer[block, head, 0].view(torch.uint8)[0] ^= 0xFF

    # -- scheduler --------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = CorruptMeta()
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            extra = (params.extra_args or {}) if params is not None else {}
            if extra.get(FLAG) and new.block_ids and new.block_ids[0]:
                meta.blocks.append((new.block_ids[0][0], int(extra[FLAG]) - 1))
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        return False, None
