"""Prefill and decode vLLM engines, in process, stepped by vLLM's own code.

Per engine: vLLM's real ``Scheduler`` (its ``KVCacheManager``, ``BlockPool``, prefix caching on,
and the request block hasher ``EngineCore`` installs whenever a connector is configured) and the
worker side stepped by vLLM's own model-runner connector functions: the V1 runner's
``KVConnectorModelRunnerMixin.maybe_get_kv_connector_output`` / ``kv_connector_no_forward``, or
the V2 runner's ``ActiveKVConnector`` (``pre_forward``, ``finish_forward``, ``post_forward``,
``no_forward``). They decide whether ``start_load_kv`` runs before or after the forward, from
the ``has_sync_kv_loads`` the scheduler set. The connector is vLLM's ``MultiConnector`` over the
kvwatch connector and a transport: :class:`transport.AsyncTransport` (loads asynchronously, as
NIXL) or vLLM's ``ExampleConnector`` (shared storage, loads synchronously).

The one stand-in is the model: :meth:`Node.forward` writes, for every scheduled token, a KV
vector that is a function of the token prefix (what attention layers write), layer by layer
through vLLM's ``maybe_transfer_kv_layer`` (so connectors' ``wait_for_layer_load`` and
``save_kv_layer`` run as inside the model), and samples a token from the prefix. Decode's forward
can differ from prefill's in the last bit (``recompute_differs``), as a GPU's can when it
recomputes a token in a different batch shape.
"""

from __future__ import annotations

import copy
import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig
from vllm.config import DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from vllm.v1.worker.utils import allocate_kv_cache

from engine_hooks.heads import head_range
from engine_hooks.vllm import KVWatchConnector
from engine_hooks.vllm.worker import WorkerSide

BLOCK_SIZE = 4
NUM_BLOCKS = 64
LAYERS = 3
VOCAB = 128
MODULE = "engine_hooks.vllm"
MAX_MODEL_LEN = 2048
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
RUNNERS = ("v1", "v2")
TRANSPORTS = ("async", "sync")


def tiny_model(directory: Path) -> str:
    """A model directory with only a HF config (no weights): enough for vLLM's ModelConfig."""
    LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
    ).save_pretrained(directory)
    return str(directory)


KV_HEADS = 2  # tiny_model's num_key_value_heads


def kv_cache_config(
    layout: KVCacheLayout = KVCacheLayout.LBHNC,
    num_blocks: int = NUM_BLOCKS,
    tp: int = 1,
    dtype: torch.dtype = torch.bfloat16,
) -> KVCacheConfig:
    """One TP rank's cache: its share of the KV heads (vLLM's sharding, heads.head_range)."""
    _, heads = head_range(0, tp, KV_HEADS)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=8, dtype=dtype)
    # vLLM's own placement of L layers x B blocks in one backing buffer for this layout.
    strides = compute_layout_strides(spec, num_blocks, LAYERS, layout)
    tensor = KVCacheTensor(
        size=spec.page_size_bytes * num_blocks * LAYERS,
        layers=NAMES,
        layer_stride=strides[0],
        block_stride=strides[1],
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)],
    )


def kvwatch_child(role: str, spool: str, mode: str, scrub: str = "off") -> dict[str, Any]:
    if spool:  # what the daemon's install does: the hooks never create it
        Path(spool).mkdir(parents=True, exist_ok=True)
    return {
        "kv_connector": "KVWatchConnector",
        "kv_connector_module_path": MODULE,
        "kv_role": role,
        "kv_connector_extra_config": {"spool": spool, "mode": mode, "scrub": scrub},
    }


def transport_child(transport: str, role: str, link: str, engine: str) -> dict[str, Any]:
    if transport == "async":
        return {
            "kv_connector": "AsyncTransport",
            "kv_connector_module_path": "transport",
            "kv_role": role,
            "kv_connector_extra_config": {"link": link, "engine": engine},
        }
    if transport == "nixl":
        return {"kv_connector": "NixlConnector", "kv_role": role}
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": link},
    }


def vllm_config(
    children: list[dict[str, Any]],
    role: str,
    model: str | None = None,
    num_blocks: int = NUM_BLOCKS,
    multi: bool | None = None,
    policy: str = "fail",
) -> VllmConfig:
    if not (len(children) > 1 if multi is None else multi):
        ktc = KVTransferConfig(**children[0])
    else:
        ktc = KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role=role,
            kv_connector_extra_config={"connectors": children},
            kv_load_failure_policy=policy,
        )
    extra: dict[str, Any] = {}
    if model is not None:
        extra["model_config"] = ModelConfig(
            model=model, skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN
        )
    config = VllmConfig(kv_transfer_config=ktc, device_config=DeviceConfig(device="cpu"), **extra)
    config.cache_config.block_size = BLOCK_SIZE
    config.cache_config.num_gpu_blocks = num_blocks
    config.cache_config.enable_prefix_caching = True
    return config


class _Layer:
    """What ``get_attention_context`` reads from an attention layer: its KV cache view."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache


@maybe_transfer_kv_layer
def _attention(layer_name: str, rank: Rank, writes: list[tuple[int, int, int, bool]]) -> None:
    """One attention layer's KV writes on one TP rank: ``(block, offset, key, recomputed)`` per
    token. A value is a function of the token prefix and its global head, so every TP width
    writes the same KV for the same head."""
    view = rank.kv[layer_name]
    salt = NAMES.index(layer_name) + 1
    for block, offset, key, recomputed in writes:
        slot = view[block, :, offset]
        cells = torch.arange(slot.numel()) + rank.head_start * slot.shape[-1]
        values = (cells * salt + key % 9973) % 251
        slot.copy_((values.to(torch.float32) / 16.0).reshape(slot.shape))
        if recomputed and rank.node.recompute_differs:
            # The last bit of a value differs, as a GPU's recompute in another batch can.
            first = slot.reshape(-1)[:1]  # a view: the first element is contiguous on its own
            first.view(torch.int16).bitwise_xor_(1)


@dataclass
class Rank:
    """One TP rank's worker: its connector, its KV views (its heads) and its V2 runner."""

    node: Node
    index: int
    config: VllmConfig
    kcc: KVCacheConfig
    worker: Any = None
    kv: dict[str, torch.Tensor] = field(default_factory=dict)
    head_start: int = 0
    v2: Any = None

    def __post_init__(self) -> None:
        self.head_start, _ = head_range(self.index, self.node.tp, KV_HEADS)
        self.worker = KVConnectorFactory.create_connector(
            self.config, KVConnectorRole.WORKER, self.kcc
        )
        self.kv = allocate_kv_cache(self.kcc, torch.device("cpu"), self.node.layout)
        layers = self.config.compilation_config.static_forward_context
        for name in NAMES:
            layers[name] = _Layer(self.kv[name])
        with self.active_connector():
            if self.node.runner == "v2":
                self.v2 = ActiveKVConnector(self.config, self.kv)
            else:  # the V1 runner registers the caches itself
                self.worker.register_kv_caches(self.kv)

    def child(self) -> KVWatchConnector:
        return next(c for c in self.worker.sub_connectors if isinstance(c, KVWatchConnector))

    @contextmanager
    def active_connector(self) -> Iterator[None]:
        """This rank's worker connector as the process's KV transfer group (one per worker
        process in vLLM; every engine's ranks share this process)."""
        saved = kv_transfer_state._KV_CONNECTOR_AGENT
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
        try:
            yield
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = saved


@dataclass
class Node:
    """One engine: the real Scheduler, and its worker side stepped by vLLM's runner code, on
    ``tp`` ranks whose outputs vLLM's ``KVOutputAggregator`` merges as its executor does."""

    role: str  # kv_producer | kv_consumer
    spool: str
    model: str
    transport: str = "async"  # async | sync
    link: str = ""
    mode: str = "enforce"
    runner: str = "v1"  # v1: KVConnectorModelRunnerMixin; v2: gpu/kv_connector.ActiveKVConnector
    num_blocks: int = NUM_BLOCKS
    kvwatch_first: bool = True
    recompute_differs: bool = False
    policy: str = "fail"  # vLLM's kv_load_failure_policy
    name: str = ""
    layout: KVCacheLayout = KVCacheLayout.LBHNC
    scrub: str = "off"  # the kvwatch connector's "scrub" extra config
    kvwatch_extra: dict[str, Any] = field(default_factory=dict)  # more of its extra config
    finished: dict[str, Any] = field(default_factory=dict)  # rid -> final EngineCoreOutput
    preempted: int = 0  # requests vLLM's scheduler preempted
    tp: int = 1  # tensor-parallel ranks
    dtype: torch.dtype = torch.bfloat16  # the KV cache's dtype

    def __post_init__(self) -> None:
        self.name = self.name or self.role
        mine = kvwatch_child(self.role, self.spool, self.mode, self.scrub)
        mine["kv_connector_extra_config"].update(self.kvwatch_extra)
        children = [
            mine,
            transport_child(self.transport, self.role, self.link, self.name),
        ]
        if not self.kvwatch_first:
            children.reverse()
        self.config = self._config(children, rank=0)
        self.kcc = kv_cache_config(self.layout, self.num_blocks, self.tp, self.dtype)
        self.scheduler = Scheduler(
            self.config, self.kcc, StructuredOutputManager(self.config), BLOCK_SIZE
        )
        # EngineCore installs a block hasher on every request when a connector is configured.
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        self.ranks = [
            Rank(self, r, self.config if r == 0 else self._config(children, r), self.kcc)
            for r in range(self.tp)
        ]
        self.worker = self.ranks[0].worker
        self.kv = self.ranks[0].kv
        self.v2 = self.ranks[0].v2
        # The executor's aggregator: a transfer is finished when every rank has reported it.
        self.aggregator = KVOutputAggregator(self.tp)

    def _config(self, children: list[dict[str, Any]], rank: int) -> VllmConfig:
        config = vllm_config(
            copy.deepcopy(children), self.role, self.model, self.num_blocks, policy=self.policy
        )
        # A worker's TP rank (the connector falls back to it outside torch.distributed).
        config.parallel_config.tensor_parallel_size = self.tp
        config.parallel_config.rank = rank
        return config

    # -- access ---------------------------------------------------------------------------------
    def child(self, side: str) -> Any:
        connector = self.scheduler.connector if side == "scheduler" else self.worker
        return next(c for c in connector.sub_connectors if isinstance(c, KVWatchConnector))

    @property
    def kvwatch(self) -> WorkerSide:
        return self.rank_side(0)

    def rank_side(self, rank: int) -> WorkerSide:
        worker = self.ranks[rank].child().worker
        assert isinstance(worker, WorkerSide)
        return worker

    def stat(self, *key: str) -> float:
        """A worker counter summed over the ranks (as the daemon sums producers)."""
        return float(sum(r.child().watch.counter(*key) for r in self.ranks))

    def blocks(self, rid: str) -> list[int]:
        (ids,) = self.scheduler.kv_cache_manager.get_block_ids(rid)
        return list(ids)

    def active_connector(self) -> Any:
        return self.ranks[0].active_connector()

    # -- requests -------------------------------------------------------------------------------
    def add(self, rid: str, prompt: list[int], max_tokens: int, params: dict[str, Any]) -> None:
        sampling = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, extra_args={"kv_transfer_params": params}
        )
        request = Request(rid, prompt, sampling, None, block_hasher=self.hasher)
        self.scheduler.add_request(request)

    def abort(self, rid: str) -> None:
        self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    # -- one engine step ------------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        """schedule -> the runner's connector calls around the forward -> update_from_output.
        Returns this step's outputs by request id."""
        with self.active_connector():
            out = self.scheduler.schedule()
        self.preempted += len(getattr(out, "preempted_req_ids", None) or ())
        plan, sampled = self._plan(out)
        results = []
        for rank in self.ranks:  # each worker runs the same SchedulerOutput
            with rank.active_connector():
                if self.runner == "v2":
                    results.append(self._step_v2(rank, out, plan, sampled))
                else:
                    results.append(self._step_v1(rank, out, plan, sampled))
        result = self.aggregator.aggregate(results) if self.tp > 1 else results[0]
        with self.active_connector():
            engine_outputs = self.scheduler.update_from_output(out, result)
        outputs = {o.request_id: o for eco in engine_outputs.values() for o in eco.outputs}
        for rid, output in outputs.items():
            if output.finish_reason is not None:
                self.finished[rid] = output
        return outputs

    def _step_v1(
        self,
        rank: Rank,
        out: SchedulerOutput,
        plan: dict[str, list[Any]],
        sampled: dict[str, list[int]],
    ) -> ModelRunnerOutput:
        if not out.total_num_scheduled_tokens:
            return KVConnectorModelRunnerMixin.kv_connector_no_forward(out, rank.config)
        with (
            set_forward_context(self._attn_metadata(), rank.config, slot_mapping={}),
            KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(out) as kv_output,
        ):
            self.forward(rank, plan)
        return self._output(out, sampled, kv_output)

    def _step_v2(
        self,
        rank: Rank,
        out: SchedulerOutput,
        plan: dict[str, list[Any]],
        sampled: dict[str, list[int]],
    ) -> ModelRunnerOutput:
        if not out.total_num_scheduled_tokens:
            return rank.v2.no_forward(out)
        with set_forward_context(self._attn_metadata(), rank.config, slot_mapping={}):
            rank.v2.pre_forward(out)
            self.forward(rank, plan)
            rank.v2.finish_forward()
            kv_output = rank.v2.post_forward(out.finished_req_ids)
        return self._output(out, sampled, kv_output)

    def _attn_metadata(self) -> dict[str, Any]:
        return {name: object() for name in NAMES}

    def _output(
        self, out: SchedulerOutput, sampled: dict[str, list[int]], kv_output: Any
    ) -> ModelRunnerOutput:
        rids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=rids,
            req_id_to_index={rid: i for i, rid in enumerate(rids)},
            sampled_token_ids=[sampled.get(rid, []) for rid in rids],
            kv_connector_output=kv_output,
        )

    def _plan(self, out: SchedulerOutput) -> tuple[dict[str, list[Any]], dict[str, list[int]]]:
        """The scheduled tokens' KV slots and keys, and the sampled tokens, per request."""
        starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        writes: list[tuple[int, int, int, bool]] = []
        sampled: dict[str, list[int]] = {}
        for rid, count in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[rid]
            tokens = request.all_token_ids
            blocks = self.blocks(rid)
            start = starts[rid]
            key = 0
            for pos in range(start + count):
                key = zlib.crc32(tokens[pos].to_bytes(4, "little"), key)
                if pos >= start:
                    recomputed = pos < request.num_prompt_tokens
                    writes.append((blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE, key, recomputed))
            if start + count >= len(tokens):
                sampled[rid] = [key % VOCAB]
        return {name: writes for name in NAMES}, sampled

    def forward(self, rank: Rank, plan: dict[str, list[Any]]) -> None:
        for name in NAMES:
            _attention(name, rank, plan[name])


def proxy(params: dict[str, Any] | None) -> dict[str, Any]:
    """What a PD proxy does with prefill's kv_transfer_params: JSON to the client and back."""
    return dict(json.loads(json.dumps(params or {})))


@dataclass
class Pair:
    """A prefill and a decode engine joined by one transport, and the proxy between them."""

    prefill: Node
    decode: Node

    def send(self, rid: str, prompt: list[int], max_tokens: int = 4) -> None:
        self.prefill.add(rid, prompt, 1, {"do_remote_decode": True})

    def step(self) -> None:
        """One step of each engine; prefill's finished requests go on to decode."""
        for rid, output in self.prefill.step().items():
            if output.finish_reason is not None and output.kv_transfer_params is not None:
                self.decode.add(
                    rid,
                    self.prompts[rid],
                    self.max_tokens.get(rid, 4),
                    proxy(output.kv_transfer_params),
                )
        self.decode.step()

    prompts: dict[str, list[int]] = field(default_factory=dict)
    max_tokens: dict[str, int] = field(default_factory=dict)

    def serve(self, rid: str, prompt: list[int], max_tokens: int = 4) -> None:
        self.prompts[rid] = prompt
        self.max_tokens[rid] = max_tokens
        self.send(rid, prompt, max_tokens)

    def run(self, limit: int = 200) -> None:
        """Step until every request sent has finished on decode (or was never handed over)."""
        for _ in range(limit):
            self.step()
            if self.idle():
                return
        raise AssertionError("requests did not finish")

    def idle(self) -> bool:
        for node in (self.prefill, self.decode):
            if node.scheduler.has_unfinished_requests() or node.scheduler.has_finished_requests():
                return False
        return True


def pair(
    tmp_path: Path,
    model: str,
    transport: str = "async",
    mode: str = "enforce",
    runner: str = "v1",
    **decode_kw: Any,
) -> Pair:
    """Prefill and decode engines in ``mode``, joined by ``transport``."""
    from transport import new_link

    link = new_link() if transport == "async" else str(tmp_path / "storage")
    common = {
        "spool": str(tmp_path / "spool"),
        "model": model,
        "transport": transport,
        "link": link,
        "mode": mode,
        "runner": runner,
    }
    prefill = Node("kv_producer", name="prefill", **common)
    decode = Node("kv_consumer", name="decode", recompute_differs=True, **common | decode_kw)
    return Pair(prefill, decode)
