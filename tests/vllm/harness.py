"""Two vLLM engine halves (prefill and decode) around the kvwatch connector, on CPU.

Everything here is vLLM's own: ``VllmConfig``/``KVTransferConfig``, ``KVConnectorFactory``,
``KVCacheConfig`` and ``allocate_kv_cache`` (the per-layer views exactly as the GPU model runner
lays them out), ``BlockPool`` and ``KVCacheBlocks``, ``Request``, ``SchedulerOutput``,
``KVConnectorOutput``. The one stand-in is the transport: :func:`transfer` copies block pages from
the prefill tensors into the decode tensors, which is what NIXL's RDMA reads do on GPUs.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig
from vllm.config import DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiKVConnectorMetadata,
    MultiKVConnectorWorkerMetadata,
)
from vllm.forward_context import ForwardContext
from vllm.sampling_params import SamplingParams
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.worker.utils import allocate_kv_cache

BLOCK_SIZE = 4
NUM_BLOCKS = 32
LAYERS = 3
MODULE = "engine_hooks.vllm"
MAX_MODEL_LEN = 2048


def tiny_model(directory: Path) -> str:
    """A model directory with only a HF config (no weights): enough for vLLM's ModelConfig."""
    LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=4096,
    ).save_pretrained(directory)
    return str(directory)


def kv_cache_config(layout: KVCacheLayout = KVCacheLayout.LBHNC) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=torch.bfloat16
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    # vLLM's own placement of L layers x B blocks in one backing buffer for this layout.
    strides = compute_layout_strides(spec, NUM_BLOCKS, LAYERS, layout)
    tensor = KVCacheTensor(
        size=spec.page_size_bytes * NUM_BLOCKS * LAYERS,
        layers=names,
        layer_stride=strides[0],
        block_stride=strides[1],
    )
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )


def kvwatch_child(role: str, spool: str, mode: str) -> dict[str, Any]:
    return {
        "kv_connector": "KVWatchConnector",
        "kv_connector_module_path": MODULE,
        "kv_role": role,
        "kv_connector_extra_config": {"spool": spool, "mode": mode},
    }


def vllm_config(
    role: str, spool: str, mode: str, sibling: str | None = None, model: str | None = None
) -> VllmConfig:
    if sibling is None:
        ktc = KVTransferConfig(**kvwatch_child(role, spool, mode))
    else:
        children = [kvwatch_child(role, spool, mode), {"kv_connector": sibling, "kv_role": role}]
        if sibling == "ExampleConnector":
            children[1]["kv_connector_extra_config"] = {"shared_storage_path": spool + "/example"}
        ktc = KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role=role,
            kv_connector_extra_config={"connectors": children},
        )
    extra: dict[str, Any] = {}
    if model is not None:
        extra["model_config"] = ModelConfig(
            model=model, skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN
        )
    return VllmConfig(kv_transfer_config=ktc, device_config=DeviceConfig(device="cpu"), **extra)


@dataclass
class Engine:
    """One engine's scheduler (block pool + scheduler-side connector) and worker (KV tensors +
    worker-side connector), stepped by hand the way ``Scheduler`` and the model runner do."""

    role: str
    spool: str
    mode: str = "enforce"
    layout: KVCacheLayout = KVCacheLayout.LBHNC
    sibling: str | None = None
    model: str | None = None
    requests: dict[str, Request] = field(default_factory=dict)
    blocks: dict[str, list[Any]] = field(default_factory=dict)
    matched: dict[str, tuple[int | None, bool]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kcc = kv_cache_config(self.layout)
        config = vllm_config(self.role, self.spool, self.mode, self.sibling, self.model)
        self.sched = KVConnectorFactory.create_connector(
            config, KVConnectorRole.SCHEDULER, self.kcc
        )
        # NIXL's worker needs the NIXL library and a GPU: beside it, the worker half is kvwatch's
        # alone, fed its own slot of MultiConnector's metadata, as MultiConnector's worker does.
        self.split = self.sibling == "NixlConnector"
        if self.split:
            config = vllm_config(self.role, self.spool, self.mode, None, self.model)
        self.work = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, self.kcc)
        self.pool = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=BLOCK_SIZE)
        self.sched.bind_gpu_block_pool(self.pool)
        self.kv = allocate_kv_cache(self.kcc, torch.device("cpu"), self.layout)
        self.work.register_kv_caches(self.kv)
        self.scheduled: dict[str, int] = {}
        self.new: list[NewRequestData] = []

    # scheduler ------------------------------------------------------------------------------
    def add(self, rid: str, prompt_tokens: int, params: dict[str, Any]) -> Request:
        sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
        request = Request(rid, list(range(prompt_tokens)), sampling, None)
        self.requests[rid] = request
        self.sched.on_new_request(request)
        # As Scheduler does before allocating: MultiConnector picks the connector that loads.
        self.matched[rid] = self.sched.get_num_new_matched_tokens(request, 0)
        return request

    def allocate(self, rid: str, schedule: bool = True) -> list[int]:
        request = self.requests[rid]
        count = -(-request.num_prompt_tokens // BLOCK_SIZE)
        blocks = self.pool.get_new_blocks(count)
        self.blocks[rid] = blocks
        self.sched.update_state_after_alloc(request, KVCacheBlocks((blocks,)), 0)
        ids = [b.block_id for b in blocks]
        if schedule:
            self.new.append(NewRequestData.from_request(request, (ids,)))
            self.scheduled[rid] = request.num_prompt_tokens
        return ids

    def step(self, forward: dict[str, int] | None = None) -> KVConnectorOutput:
        """One engine step: build the metadata, run the worker hooks around a 'forward' that
        writes ``forward[rid]`` (a seed) into that request's blocks, collect the output."""
        output = SchedulerOutput.make_empty()
        output.scheduled_new_reqs, self.new = self.new, []
        output.scheduled_cached_reqs = CachedRequestData.make_empty()
        output.num_scheduled_tokens, self.scheduled = self.scheduled, {}
        output.total_num_scheduled_tokens = sum(output.num_scheduled_tokens.values())
        meta = self.sched.build_connector_meta(output)
        if self.split:
            assert isinstance(meta, MultiKVConnectorMetadata)
            meta = meta.metadata[0]
        self.work.bind_connector_metadata(meta)
        self.work.start_load_kv(
            ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        )
        for rid, seed in (forward or {}).items():
            self.write(rid, seed)
        self.work.wait_for_save()
        worker_meta = self.work.build_connector_worker_meta()
        if self.split and worker_meta is not None:
            worker_meta = MultiKVConnectorWorkerMetadata((worker_meta, None))
        result = KVConnectorOutput(
            invalid_block_ids=self.work.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=worker_meta,
        )
        self.work.clear_connector_metadata()
        return result

    def write(self, rid: str, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for view in self.kv.values():
            for block in self.blocks[rid]:
                page = view[block.block_id]
                page.copy_(torch.randn(page.shape, generator=gen).to(page.dtype))

    def finish(self, rid: str, output: KVConnectorOutput) -> dict[str, Any]:
        """``update_from_output``: request_finished first, then update_connector_output; the
        params then cross the proxy as JSON."""
        request = self.requests[rid]
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        ids = [b.block_id for b in self.blocks[rid]]
        delay, params = self.sched.request_finished_all_groups(request, (ids,))
        assert delay is self.split  # NIXL holds prefill blocks until decode read them
        self.sched.update_connector_output(output)
        return dict(json.loads(json.dumps(params or {})))

    def received(self, rid: str) -> KVConnectorOutput:
        """The transport reports the load done (NIXL's finished_recving), then the next step
        runs; returns that step's output (load errors included)."""
        self.sched.update_connector_output(KVConnectorOutput(finished_recving={rid}))
        return self.step()


def transfer(src: Engine, rid: str, dst: Engine, skip: int | None = None) -> None:
    """NIXL's part: copy each block's page, layer by layer, into the reader's blocks."""
    for name, view in src.kv.items():
        for index, (s, d) in enumerate(zip(src.blocks[rid], dst.blocks[rid], strict=True)):
            if index != skip:
                dst.kv[name][d.block_id].copy_(view[s.block_id])


def prefill_then_reserve(
    prefill: Engine, decode: Engine, rid: str, tokens: int = 10
) -> dict[str, Any]:
    """Prefill computes and seals ``rid``; decode admits it and reserves blocks for the load."""
    prefill.add(rid, tokens, {"do_remote_decode": True})
    prefill.allocate(rid)
    out = prefill.step({rid: zlib.crc32(rid.encode())})
    params = prefill.finish(rid, out)
    decode.add(rid, tokens, {"do_remote_prefill": True, **params})
    decode.allocate(rid, schedule=False)
    decode.step()  # stamps and tags the reserved blocks before the load starts
    return params
