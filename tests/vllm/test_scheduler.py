"""kvwatch beside the real NixlConnector under vLLM's real ``Scheduler`` (prefill and decode).

vLLM's own scheduler drives the connector hooks in their real order (``add_request`` ->
``on_new_request``, ``schedule`` -> ``update_state_after_alloc`` / ``build_connector_meta``,
``update_from_output`` -> ``request_finished`` then ``update_connector_output``) with its own
``KVCacheManager`` and ``BlockPool``. The worker halves run kvwatch's worker connector on the KV
views ``allocate_kv_cache`` lays out; NIXL's worker (a GPU + NIXL library) is replaced by copying
the blocks and reporting ``finished_recving``, which is what it reports. This checks the seal
channel end to end (the seal reaches ``EngineCoreOutput.kv_transfer_params``) and that a bad
load makes vLLM fail the request (``kv_load_failure_policy="fail"``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import BLOCK_SIZE, NUM_BLOCKS, kv_cache_config, tiny_model, vllm_config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiKVConnectorMetadata,
    MultiKVConnectorWorkerMetadata,
)
from vllm.forward_context import ForwardContext
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

PROMPT = 10


class Node:
    """One vLLM engine: the real Scheduler + kvwatch's worker connector on real KV views."""

    def __init__(self, role: str, spool: str, model: str) -> None:
        config = vllm_config(role, spool, "enforce", "NixlConnector", model)
        config.cache_config.block_size = BLOCK_SIZE
        config.cache_config.num_gpu_blocks = NUM_BLOCKS
        kcc = kv_cache_config()
        self.scheduler = Scheduler(config, kcc, StructuredOutputManager(config), BLOCK_SIZE)
        alone = vllm_config(role, spool, "enforce", None, model)
        self.worker = KVConnectorFactory.create_connector(alone, KVConnectorRole.WORKER, kcc)
        self.kv = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC)
        self.worker.register_kv_caches(self.kv)

    def add(self, rid: str, max_tokens: int, params: dict[str, Any]) -> None:
        sampling = SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": params})
        self.scheduler.add_request(Request(rid, list(range(PROMPT)), sampling, None))

    def blocks(self, rid: str) -> list[int]:
        (ids,) = self.scheduler.kv_cache_manager.get_block_ids(rid)
        return list(ids)

    def step(self, recv: set[str] | None = None, seed: int = 0) -> tuple[SchedulerOutput, Any]:
        """schedule -> worker hooks around a forward that writes the scheduled requests' KV
        (what the model would compute) -> update_from_output."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, MultiKVConnectorMetadata)
        self.worker.bind_connector_metadata(meta.metadata[0])
        self.worker.start_load_kv(ForwardContext({}, {}, {}))
        gen = torch.Generator().manual_seed(seed)
        for rid, tokens in out.num_scheduled_tokens.items():
            if tokens > 1:  # a prefill chunk: the forward writes the prompt's KV
                for view in self.kv.values():
                    for block in self.blocks(rid):
                        page = view[block]
                        page.copy_(torch.randn(page.shape, generator=gen).to(page.dtype))
        self.worker.wait_for_save()
        worker_meta = self.worker.build_connector_worker_meta()
        rids = list(out.num_scheduled_tokens)
        result = ModelRunnerOutput(
            req_ids=rids,
            req_id_to_index={rid: i for i, rid in enumerate(rids)},
            sampled_token_ids=[[7] for _ in rids],
            kv_connector_output=KVConnectorOutput(
                finished_recving=recv,
                invalid_block_ids=self.worker.get_block_ids_with_load_errors(),
                kv_connector_worker_meta=(
                    MultiKVConnectorWorkerMetadata((worker_meta, None)) if worker_meta else None
                ),
            ),
        )
        self.worker.clear_connector_metadata()
        return out, self.scheduler.update_from_output(out, result)


def _outputs(engine_outputs: Any) -> dict[str, Any]:
    return {o.request_id: o for eco in engine_outputs.values() for o in eco.outputs}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def _pd(tmp_path: Path, model: str, corrupt: bool) -> dict[str, Any]:
    prefill = Node("kv_producer", str(tmp_path), model)
    decode = Node("kv_consumer", str(tmp_path), model)
    prefill.add("r", 1, {"do_remote_decode": True})
    _, engine_out = prefill.step(seed=3)
    finished = _outputs(engine_out)["r"]
    assert finished.finish_reason == FinishReason.LENGTH
    # The engine serialises the outputs after update_from_output: the seal is there by then.
    params = json.loads(json.dumps(finished.kv_transfer_params))
    assert params["kvwatch"]["seals"]["0"]["page_count"] == len(params["remote_block_ids"][0])
    source = prefill.blocks("r")

    decode.add("r", 4, params)
    decode.step()  # NIXL takes the load (async); kvwatch stamps the reserved blocks
    target = decode.blocks("r")
    for name, view in prefill.kv.items():  # NIXL's RDMA reads
        for s, d in zip(source, target, strict=True):
            decode.kv[name][d].copy_(view[s])
    if corrupt:
        next(iter(decode.kv.values()))[target[1]].view(torch.uint8).view(-1)[5] ^= 0x01
    decode.step(recv={"r"})  # NIXL's worker reports the load done
    _, engine_out = decode.step()  # first decode step: kvwatch verifies before the forward
    return {"out": _outputs(engine_out).get("r"), "decode": decode}


def test_clean_load_is_served(tmp_path: Path, model: str) -> None:
    result = _pd(tmp_path, model, corrupt=False)
    out = result["out"]
    assert out is not None and out.finish_reason is None and out.new_token_ids == [7]
    assert result["decode"].worker.watch.stats.get("verifications", "checksum") == 1


def test_corrupt_load_fails_the_request(tmp_path: Path, model: str) -> None:
    result = _pd(tmp_path, model, corrupt=True)
    out = result["out"]
    assert out is not None and out.finish_reason == FinishReason.ERROR
    assert out.new_token_ids == []  # nothing computed from the bad KV reaches the user
