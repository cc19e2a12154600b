"""The scheduler half of the kvwatch connector: block ledger, seal channel, verify triggers.

The seal channel (prefill -> decode), given that vLLM calls ``request_finished`` in
``Scheduler.update_from_output`` *before* it hands the same step's worker output to the connector
(``update_connector_output``):

1. ``build_connector_meta`` of the step that computes the last prompt token of a request with
   ``do_remote_decode`` sends the worker a :class:`SealJob` (the request's blocks).
2. The prefill worker seals those blocks in ``wait_for_save`` (after the forward wrote them) and
   returns the seal in ``build_connector_worker_meta``: it rides in that step's
   ``KVConnectorOutput.kv_connector_worker_meta``.
3. ``request_finished`` (same ``update_from_output`` call, earlier) returns
   ``{"kvwatch": slot}`` in ``kv_transfer_params``: the seal if it already arrived (prompt done in
   an earlier step), else an empty ``slot`` dict that this connector keeps.
4. ``update_connector_output`` (same call, later) fills the kept ``slot`` in place. The engine
   serialises ``kv_transfer_params`` only after ``update_from_output`` returns, and
   ``MultiConnector`` merges children's params by reference to the inner dict, so the client (the
   PD proxy) receives the filled seal with the rest of the params and hands it to decode with
   NIXL's ``remote_block_ids``. A slot still empty at that point (the worker failed to seal)
   reaches decode as ``{"v": 2}`` and decode counts ``skipped{checksum, no_seal}``.

On decode, the request's ``kv_transfer_params["kvwatch"]`` (read in ``on_new_request``, before any
connector flips ``do_remote_prefill``) gives the seals (one digest per block); the request's
blocks (``update_state_after_alloc``) past its own prefix-cache hits (the computed tokens that
``MultiConnector`` passes to every child's ``get_num_new_matched_tokens``) are stamped and tagged
by the worker before any transport can write them (:class:`ReserveJob`). Which of them the
transport filled, and when, depends on how it loads:

- asynchronously (NIXL): the request waits in ``WAITING_FOR_REMOTE_KVS``; when the aggregated
  ``KVConnectorOutput`` reports it in ``finished_recving``, the next step's metadata asks the
  worker to verify all the reserved blocks before that step's forward (the one that recomputes
  the last prompt token into the last block);
- synchronously (``ExampleConnector``): the request is scheduled in the same step with
  ``num_computed_tokens`` past its local hits; the whole blocks below that were loaded by this
  step's ``start_load_kv``, before the forward, and are verified in ``wait_for_save``. Such loads
  never appear in ``finished_recving``.

Failures go out through ``get_block_ids_with_load_errors`` in the step that checked them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine_hooks.labels import Skip
from engine_hooks.tickets import new_instance
from engine_hooks.vllm.blocks import BlockLedger
from engine_hooks.vllm.metadata import (
    PARAMS_KEY,
    WIRE_VERSION,
    KVWatchMetadata,
    KVWatchWorkerMetadata,
    ReserveJob,
    SealJob,
    SealWire,
    VerifyJob,
    WriteJob,
)

_FINISHED_OK = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


@dataclass(slots=True)
class _Producer:
    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    sealed: list[int] | None = None  # the blocks the seal job covered


@dataclass(slots=True)
class _Consumer:
    seals: dict[str, SealWire] | None
    sealed_blocks: int
    reason: str = ""  # why the seals cannot be checked here, when they cannot
    reserved: bool = False
    local_hits: int = 0  # blocks from decode's own prefix cache, before the reserved ones
    loading: bool = False  # reserved blocks that a transport fills (async, or sync and seen)
    peer: dict[str, str] = field(default_factory=dict)  # who sent the KV (see _peer_of)


def _blocks(group_block_ids: Any) -> list[int] | None:
    """The one KV cache group's block ids, or None for hybrid (several groups)."""
    groups = tuple(group_block_ids)
    if len(groups) != 1:
        return None
    return [int(b) for b in groups[0]]


def _peer_of(params: dict[str, Any], wire: Any, transport: str) -> dict[str, str]:
    """Who sent a decode request's KV, for its findings' ``detail``: prefill's request id, node
    and engine id from the seal's ``peer`` (the instance is in each rank's seal), and the
    transport (configured, else NIXL's when its params are there)."""
    peer = wire.get("peer") if isinstance(wire, dict) else None
    out: dict[str, str] = {}
    if isinstance(peer, dict):
        for key in ("request_id", "node", "engine_id"):
            value = peer.get(key)
            if isinstance(value, str) and value:
                out[f"peer_{key}"] = value[:128]
    # A prefill without kvwatch (no seal): NIXL's own params still say who sent it.
    for key, nixl in (
        ("peer_engine_id", "remote_engine_id"),
        ("peer_request_id", "remote_request_id"),
    ):
        if key not in out and isinstance(params.get(nixl), str):
            out[key] = params[nixl][:128]
    if not transport:
        transport = "nixl" if "remote_block_ids" in params else "other"
    out["transport"] = transport[:64]
    return out


class SchedulerSide:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        tp_size: int = 1,
        identity: dict[str, str] | None = None,
        transport: str = "",
    ) -> None:
        self.block_size = block_size
        self.tp_size = tp_size
        #: This engine as a peer names it: node and engine id (prefill's ``peer`` in the seal).
        self.identity = dict(identity or {})
        self.transport = transport
        self.sent: list[str] = []
        self.ledger = BlockLedger(num_blocks)
        self.producers: dict[str, _Producer] = {}
        self.consumers: dict[str, _Consumer] = {}
        self.slots: dict[str, dict[str, Any]] = {}  # request_finished handed these out, unfilled
        self.arrived: dict[str, dict[str, SealWire]] = {}  # seals before request_finished
        self.seal_jobs: list[SealJob] = []
        self.reserve_jobs: list[ReserveJob] = []
        self.verify: list[VerifyJob] = []
        self.release: list[str] = []
        self.skips: list[Skip] = []  # reasons, drained into counters by the connector
        # Every scheduled request's blocks, and how many of them its forward already wrote
        # (the blocks past that are the ones a step's WriteJob names).
        self.blocks_of: dict[str, list[int]] = {}
        self.written_upto: dict[str, int] = {}
        self.writes: list[WriteJob] = []
        #: The instances minted since the last step (see KVWatchMetadata.instances).
        self.new_instances: dict[str, str] = {}

    # -- requests -------------------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        params = request.kv_transfer_params or {}
        rid = request.request_id
        self.new_instances[rid] = new_instance()
        wire = params.get(PARAMS_KEY)
        if params.get("do_remote_decode"):
            self.producers[rid] = _Producer(int(request.num_prompt_tokens))
        elif params.get("do_remote_prefill") or isinstance(wire, dict):
            # A transport that loads synchronously (shared storage) sets no do_remote_prefill:
            # prefill's kvwatch key alone says the KV comes from another engine.
            consumer = _Consumer(None, 0, peer=_peer_of(params, wire, self.transport))
            if isinstance(wire, dict) and isinstance(wire.get("seals"), dict):
                consumer.seals = {str(k): dict(v) for k, v in wire["seals"].items()}
                consumer.sealed_blocks = int(wire.get("blocks", 0))
                # Any TP width on either side: each reader rank recombines the heads it holds
                # from the writer ranks' per-head seals (worker.py).
                if wire.get("v") != WIRE_VERSION:
                    consumer.reason = Skip.OTHER  # a prefill kvwatch of another wire version
                elif wire.get("block_size") != self.block_size:
                    consumer.reason = Skip.UNSUPPORTED_LAYOUT
            self.consumers[rid] = consumer

    def local_hit(self, request: Any, num_computed_tokens: int) -> None:
        consumer = self.consumers.get(request.request_id)
        if consumer is not None and not consumer.reserved:
            consumer.local_hits = int(num_computed_tokens) // self.block_size

    def update_state_after_alloc(self, request: Any, blocks: Any) -> None:
        consumer = self.consumers.get(request.request_id)
        if consumer is None or consumer.reserved:
            return
        consumer.reserved = True
        groups = blocks.blocks
        if len(groups) != 1:
            self.skips.append(Skip.UNSUPPORTED_LAYOUT)
            return
        # Past decode's own prefix hits, every block is for KV from elsewhere or this engine's
        # forward; a synchronous load has already hashed the blocks it will fill.
        own = [b.block_id for b in groups[0] if not b.is_null]
        loaded = own[consumer.local_hits :]
        if not loaded:
            return
        reason = consumer.reason
        if consumer.seals is None:
            reason = Skip.NO_SEAL
        self.reserve_jobs.append(
            ReserveJob(
                request.request_id,
                loaded,
                consumer.seals,
                consumer.local_hits,
                consumer.sealed_blocks,
                reason,
                consumer.peer,
            )
        )

    def track(self, scheduler_output: Any) -> None:
        """Follow producer requests' blocks; queue a seal when a step completes the prompt."""
        scheduled = scheduler_output.num_scheduled_tokens
        reserved_now = {job.request_id for job in self.reserve_jobs}
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in reserved_now:
                self._loaded_in_step(new.req_id, int(new.num_computed_tokens))
            self.blocks_of[new.req_id] = _blocks(new.block_ids) or []
            self.written_upto[new.req_id] = 0
            self._forward_writes(new.req_id, int(new.num_computed_tokens), scheduled)
            producer = self.producers.get(new.req_id)
            if producer is not None:
                producer.block_ids = self.blocks_of[new.req_id]
                self._maybe_seal(new.req_id, producer, new.num_computed_tokens, scheduled)
        cached = scheduler_output.scheduled_cached_reqs
        for index, rid in enumerate(cached.req_ids):
            added = cached.new_block_ids[index]
            if added is not None:
                ids = _blocks(added) or []
                if rid in cached.resumed_req_ids:  # preempted: all its blocks are new
                    self.blocks_of[rid] = ids
                    self.written_upto[rid] = 0
                else:
                    self.blocks_of.setdefault(rid, []).extend(ids)
            self._forward_writes(rid, int(cached.num_computed_tokens[index]), scheduled)
            producer = self.producers.get(rid)
            if producer is None:
                continue
            producer.block_ids = self.blocks_of.get(rid, producer.block_ids)
            self._maybe_seal(rid, producer, cached.num_computed_tokens[index], scheduled)

    def _forward_writes(self, rid: str, computed: int, scheduled: dict[str, int]) -> None:
        """The blocks this step's forward writes for ``rid`` (its tokens from ``computed`` on)
        that it has not written before: from now on they hold its KV. Blocks a transport
        loads are not among them (the forward starts past them); their write is recorded when
        the load is checked."""
        count = scheduled.get(rid, 0)
        blocks = self.blocks_of.get(rid)
        if not count or not blocks:
            return
        first = max(computed // self.block_size, self.written_upto.get(rid, 0))
        end = min(-(-(computed + count) // self.block_size), len(blocks))
        if first < end:
            self.writes.append(WriteJob(rid, blocks[first:end]))
            self.written_upto[rid] = end

    def _loaded_in_step(self, rid: str, computed: int) -> None:
        """A reserved request scheduled in the step that reserved it: its transport (if any)
        loads synchronously, in this step's ``start_load_kv``, the whole blocks it counted as
        computed past decode's own hits. The forward writes only past them."""
        consumer = self.consumers.get(rid)
        if consumer is None or consumer.loading:
            return
        loaded = computed // self.block_size - consumer.local_hits
        if loaded <= 0:  # nothing came from another engine: nothing to check
            self.release.append(rid)
            return
        consumer.loading = True
        self.verify.append(VerifyJob(rid, loaded, after_forward=True))

    def _maybe_seal(
        self, rid: str, producer: _Producer, computed: int, scheduled: dict[str, int]
    ) -> None:
        done = computed + scheduled.get(rid, 0)
        if done < producer.num_prompt_tokens:
            return
        count = -(-producer.num_prompt_tokens // self.block_size)
        blocks = producer.block_ids[:count]
        if producer.sealed == blocks:
            return
        producer.sealed = blocks
        self.seal_jobs.append(SealJob(rid, blocks))

    def request_finished(self, request: Any, block_ids: Any) -> dict[str, Any] | None:
        rid = request.request_id
        self.blocks_of.pop(rid, None)
        self.written_upto.pop(rid, None)
        self.consumers.pop(rid, None)
        self.release.append(rid)  # the worker forgets its ticket and instance
        producer = self.producers.pop(rid, None)
        if producer is None:
            return None
        if getattr(request.status, "name", "") not in _FINISHED_OK:
            self.arrived.pop(rid, None)
            return None
        slot: dict[str, Any] = {
            "v": WIRE_VERSION,
            "tp": self.tp_size,
            "block_size": self.block_size,
            # Who sent it, for decode's findings (the instance is in each rank's seal).
            "peer": {"request_id": str(rid)[:128], **self.identity},
        }
        sent = _blocks(block_ids) if isinstance(block_ids, tuple) else list(block_ids)
        if producer.sealed is None or sent is None or sent != producer.sealed:
            # The blocks NIXL hands over are not the ones sealed (hybrid groups, or a prompt
            # that never completed here): send no seal rather than a wrong one.
            self.arrived.pop(rid, None)
            self.skips.append(Skip.NO_SEAL)
            return wire_slot(slot)
        slot["blocks"] = len(producer.sealed)
        seals = self.arrived.pop(rid, None)
        if seals is not None:
            slot["seals"] = seals
        else:
            self.slots[rid] = slot
        return wire_slot(slot)

    # -- worker output -------------------------------------------------------------------------

    def update_connector_output(self, output: Any) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVWatchWorkerMetadata):
            for rid, seals in meta.seals.items():
                slot = self.slots.pop(rid, None)
                if slot is not None:
                    slot["seals"] = dict(seals)
                elif rid in self.producers:
                    self.arrived.setdefault(rid, {}).update(seals)
        for rid in output.finished_recving or ():
            consumer = self.consumers.get(rid)
            if consumer is not None and consumer.reserved and not consumer.loading:
                consumer.loading = True
                self.verify.append(VerifyJob(rid))
        # Read or lease expired (NIXL says which only in its log): the worker stops watching.
        self.sent.extend(getattr(output, "finished_sending", None) or ())
        # A slot that was handed out this step and is still empty will not be filled later.
        self.slots.clear()

    def build(self, scheduler_output: Any) -> KVWatchMetadata:
        self.track(scheduler_output)
        # A request that finished (was aborted) after its load completed and before this step
        # has given its blocks back: there is nothing of its own left to check.
        gone = set(self.release)
        self.verify = [job for job in self.verify if job.request_id not in gone]
        meta = KVWatchMetadata(
            events=self.ledger.drain(),
            seal=self.seal_jobs,
            reserve=self.reserve_jobs,
            verify=self.verify,
            release=self.release,
            writes=self.writes,
            sent=self.sent,
            instances=self.new_instances,
        )
        self.new_instances = {}
        self.sent = []
        self.seal_jobs, self.reserve_jobs, self.verify, self.release = [], [], [], []
        self.writes = []
        return meta


def wire_slot(slot: dict[str, Any]) -> dict[str, Any]:
    return {PARAMS_KEY: slot}
