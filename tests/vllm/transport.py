# mypy: allow-subclassing-any, disable-error-code="import-not-found"
"""``AsyncTransport``: a KV connector that loads asynchronously, the way ``NixlConnector`` does.

NIXL's worker needs the NIXL library and RDMA-capable devices; this connector keeps NIXL's
contract with vLLM and moves the bytes in process. Prefill's ``request_finished`` holds the
blocks (``delay_free``) and returns ``do_remote_prefill`` + ``remote_block_ids``. Decode's
``get_num_new_matched_tokens`` claims the whole prompt as an async load, and
``update_state_after_alloc`` maps the request's unhashed blocks onto the last remote blocks.
The worker's ``start_load_kv`` (which vLLM calls after the forward when no load is synchronous)
only starts the read: the bytes land in a later step, whose ``get_finished`` reports the request
in ``finished_recving``; prefill's worker then reports it in ``finished_sending`` and prefill
frees its blocks.

A :class:`Link` joins the engines of one test (the "network"); its ``on_arrival`` hook lets a
test damage a transfer the way a faulty transport would.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from engine_hooks.heads import head_range

#: NIXL's worker's logger, where its lease expiry is logged (nixl/base_worker.py).
NIXL_LOGGER = logging.getLogger("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
Arrival = Callable[[str, dict[str, torch.Tensor], list[int]], None]


@dataclass
class Link:
    kv: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # engine -> KV views
    read: set[str] = field(default_factory=set)  # transfers decode has finished reading
    on_arrival: dict[str, Arrival] = field(default_factory=dict)  # rid -> after the bytes land
    delay: int = 1  # get_finished calls between start_load_kv and the bytes landing
    #: Prefill transfers whose lease a test lets expire unread: as NIXL, the worker logs its
    #: warning and reports them in finished_sending (the scheduler frees their blocks).
    expire: set[str] = field(default_factory=set)
    #: Per engine its TP width; per (engine, rank) that rank's first KV head; per read
    #: transfer the writer ranks that have reported it sent (each rank frees it once).
    tp: dict[str, int] = field(default_factory=dict)
    head_start: dict[tuple[str, int], int] = field(default_factory=dict)
    acked: dict[str, set[int]] = field(default_factory=dict)


LINKS: dict[str, Link] = {}
_ids = itertools.count()


def new_link() -> str:
    name = f"link{next(_ids)}"
    LINKS[name] = Link()
    return name


@dataclass
class _Load:
    engine: str
    remote: list[int]
    local: list[int]
    age: int = 0


@dataclass
class TransportMetadata(KVConnectorMetadata):
    loads: dict[str, _Load] = field(default_factory=dict)
    sends: list[str] = field(default_factory=list)


class AsyncTransport(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.link = LINKS[str(extra["link"])]
        self.engine = str(extra["engine"])
        self.loads: dict[str, _Load] = {}
        self.sends: list[str] = []
        self.inflight: dict[str, _Load] = {}
        self.holding: set[str] = set()
        self.kv: dict[str, torch.Tensor] = {}
        parallel = vllm_config.parallel_config
        self.rank, self.tp = int(parallel.rank), int(parallel.tensor_parallel_size)
        self.total_heads = int(vllm_config.model_config.get_total_num_kv_heads())

    # -- scheduler ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # as NIXL: claimed once
        local = blocks.get_unhashed_block_ids()
        remote = list(params["remote_block_ids"][0])
        if num_external_tokens > 0 and local:
            self.loads[request.request_id] = _Load(
                params["remote_engine_id"], remote[-len(local) :], local
            )
        else:  # all local hits: only tell prefill it may free its blocks
            self.link.read.add(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = TransportMetadata(self.loads, self.sends)
        self.loads, self.sends = {}, []
        return meta

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            # Decode finished (aborted) a request before it claimed the load: as NIXL, tell
            # prefill it may free the blocks it holds.
            self.link.read.add(request.request_id)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status.name != "FINISHED_LENGTH_CAPPED":
            return False, None
        self.sends.append(request.request_id)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(ids) for ids in block_ids],
            "remote_engine_id": self.engine,
        }

    # -- worker ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv = kv_caches
        self.link.kv[self._name(self.engine, self.rank)] = kv_caches
        self.link.tp[self.engine] = self.tp
        self.link.head_start[(self.engine, self.rank)] = head_range(
            self.rank, self.tp, self.total_heads
        )[0]

    @staticmethod
    def _name(engine: str, rank: int) -> str:
        return engine if rank == 0 else f"{engine}/{rank}"

    def _copy(self, load: _Load) -> None:
        """This rank's heads of each block, from the writer rank that holds each head (NIXL's
        head-slice reads when the two sides' TP widths differ)."""
        heads = int(next(iter(self.kv.values())).shape[1])
        mine = self.link.head_start[(self.engine, self.rank)]
        writer_tp = self.link.tp[load.engine]
        for column in range(heads):
            head = mine + column
            rank = next(
                r
                for r in range(writer_tp)
                if self.link.head_start[(load.engine, r)]
                <= head
                < self.link.head_start[(load.engine, r)]
                + int(next(iter(self.link.kv[self._name(load.engine, r)].values())).shape[1])
            )
            source = self.link.kv[self._name(load.engine, rank)]
            theirs = head - self.link.head_start[(load.engine, rank)]
            for name, view in self.kv.items():
                for s, d in zip(load.remote, load.local, strict=True):
                    view[d, column].copy_(source[name][s, theirs])

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TransportMetadata)
        self.inflight.update(meta.loads)
        self.holding.update(meta.sends)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recving: set[str] = set()
        for rid, load in list(self.inflight.items()):
            load.age += 1
            if load.age <= self.link.delay:
                continue
            del self.inflight[rid]
            self._copy(load)
            # A test's damage: to rank 0's shard (``rid``) or one rank's (``rid@rank``).
            hook = self.link.on_arrival.pop(f"{rid}@{self.rank}", None)
            if hook is None and self.rank == 0:
                hook = self.link.on_arrival.pop(rid, None)
            if hook is not None:
                hook(rid, self.kv, load.local)
            self.link.read.add(rid)
            recving.add(rid)
        for rid in sorted(self.holding & self.link.expire):
            self.link.expire.discard(rid)
            self.link.read.add(rid)
            NIXL_LOGGER.warning(
                "Releasing expired KV blocks for request %s which were "
                "retrieved by %d remote worker(s) before lease expired.",
                rid,
                0,
            )
        sending = {rid for rid in self.holding if rid in self.link.read}
        self.holding -= sending
        for rid in sending:  # read: gone from the link once every writer rank has seen it
            acked = self.link.acked.setdefault(rid, set())
            acked.add(self.rank)
            if len(acked) >= self.tp:
                self.link.read.discard(rid)
                del self.link.acked[rid]
        return sending or None, recving or None
