# mypy: allow-subclassing-any, disable-error-code="import-not-found"
"""What the kvwatch connector's two halves tell each other, once per engine step.

Scheduler -> worker (:class:`KVWatchMetadata`, vLLM's ``KVConnectorMetadata``): the block pool's
allocations and frees in the order they happened, the blocks to seal (prefill), the blocks
reserved for a remote load and the seal they must match (decode), the loads to verify now, and
the blocks this step's forward writes, per request.

Worker -> scheduler (:class:`KVWatchWorkerMetadata`, vLLM's ``KVConnectorWorkerMetadata``): the
seals a prefill worker computed this step, per request and per tensor-parallel rank. vLLM merges
the workers' objects with :meth:`KVWatchWorkerMetadata.aggregate`.

Everything here is block ids, counts and digests: no token ids, no prompt text, no KV bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

#: ``kv_transfer_params`` key that carries the seals from prefill to decode.
PARAMS_KEY = "kvwatch"
#: Version of the ``kv_transfer_params["kvwatch"]`` object. 2: seals carry one digest per block;
#: 3: per block and KV head (``heads``), with the rank's layout signature (``layout``).
WIRE_VERSION = 3

#: One writer rank's seal: ``{"page_count": n, "digest": d, "heads": base64, "layout": {...},
#: "instance": ...}`` (``heads``: :func:`engine_hooks.heads.pack`), or ``"pages": [d0, ...]``
#: where the rank's pool does not see its heads.
SealWire = dict[str, Any]


@dataclass(slots=True)
class BlockEvent:
    """Blocks leaving (``alloc``) or returning to (``free``) the block pool's free list."""

    kind: str  # "alloc" | "free"
    block_ids: list[int]


@dataclass(slots=True)
class SealJob:
    request_id: str
    block_ids: list[int]


@dataclass(slots=True)
class WriteJob:
    """This step's forward writes ``block_ids`` for the request (its own KV): they hold its
    data from now on, which a finding on them later names."""

    request_id: str
    block_ids: list[int]


@dataclass(slots=True)
class ReserveJob:
    """Decode allocated ``block_ids`` (the request's blocks past its ``local_hits`` prefix-cache
    blocks) for KV another engine computed; ``seals`` is what prefill sent (per TP rank, as
    strings), None when it sent none."""

    request_id: str
    block_ids: list[int]
    seals: dict[str, SealWire] | None
    local_hits: int
    sealed_blocks: int
    reason: str = ""  # why the seal cannot be used, when it cannot
    #: Who sent the KV (prefill's ``peer`` in the seal, the transport): the finding's detail.
    peer: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class VerifyJob:
    """Check a load: ``blocks`` of the reserved blocks (all of them when None) hold what the
    transport delivered. ``after_forward``: the load ran synchronously in this step, before its
    forward (check in ``wait_for_save``); otherwise it finished in an earlier step and is checked
    before this step's forward, which recomputes the last prompt token into the last block."""

    request_id: str
    blocks: int | None = None
    after_forward: bool = False


@dataclass
class KVWatchMetadata(KVConnectorMetadata):
    events: list[BlockEvent] = field(default_factory=list)
    seal: list[SealJob] = field(default_factory=list)
    reserve: list[ReserveJob] = field(default_factory=list)
    verify: list[VerifyJob] = field(default_factory=list)
    release: list[str] = field(default_factory=list)  # forget their tickets (and instances)
    writes: list[WriteJob] = field(default_factory=list)
    #: Producer requests whose sending finished (``finished_sending``: read, or lease expired).
    sent: list[str] = field(default_factory=list)
    #: The instance of each request new this step, minted by the scheduler: every TP rank's
    #: findings on the request name the same one (one incident, exposure counted once).
    instances: dict[str, str] = field(default_factory=dict)


@dataclass
class KVWatchWorkerMetadata(KVConnectorWorkerMetadata):
    #: request id -> TP rank (as a string, JSON-safe) -> seal
    seals: dict[str, dict[str, SealWire]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVWatchWorkerMetadata):
            return self
        merged = {rid: dict(ranks) for rid, ranks in self.seals.items()}
        for rid, ranks in other.seals.items():
            merged.setdefault(rid, {}).update(ranks)
        return KVWatchWorkerMetadata(merged)


def wire_params(slot: dict[str, Any]) -> dict[str, Any]:
    """The ``kv_transfer_params`` entry prefill returns from ``request_finished``."""
    return {PARAMS_KEY: slot}
