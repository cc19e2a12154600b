"""The worker half of the kvwatch connector: the detectors on vLLM's own KV tensors.

vLLM's model runners (``KVConnectorModelRunnerMixin`` and, in the V2 runner,
``v1/worker/gpu/kv_connector.py``) call, per step: ``bind_connector_metadata``, then the forward,
with ``start_load_kv`` *before* it only when the step has a synchronous load
(``has_sync_kv_loads``) and *after* it otherwise, then ``wait_for_save``,
``get_block_ids_with_load_errors`` and ``build_connector_worker_meta``. ``start_load_kv`` is
therefore no place for anything that must precede the forward. So:

- :meth:`WorkerSide.bind` (``bind_connector_metadata``, always before the forward and before
  every connector's ``start_load_kv``): mirror the block pool's allocations and frees (check and
  stamp free canaries; scrub ``on_free``), stamp and tag the blocks reserved for another
  engine's KV (scrub ``on_reserve``), verify the asynchronous loads that finished in earlier
  steps, before this step's forward recomputes the last prompt token into the last block, and
  record which request's KV the blocks this step's forward writes will hold;
- :meth:`WorkerSide.save` (``wait_for_save``, after the forward): verify the synchronous loads
  of this step (their whole loaded blocks, which the forward does not write), and seal the
  prompts that completed this step.

Mismatches in enforce mode become ``get_block_ids_with_load_errors`` of the same step, which
vLLM's ``kv_load_failure_policy`` turns into an error for the request (``fail``, the default) or
a local recompute (``recompute``); vLLM discards the step's output for that request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from engine_hooks import KVWatch, PagedKVPool, Seal, Ticket, Verdict, page_digests_digest
from engine_hooks.heads import HeadedPool, pack, unpack
from engine_hooks.labels import Detector, Skip
from engine_hooks.takers import DEFAULT_FREED_WATCH_S
from engine_hooks.tickets import new_instance
from engine_hooks.vllm.layout import SIGNATURE_FIELDS
from engine_hooks.vllm.lease import LeaseWatch
from engine_hooks.vllm.metadata import KVWatchMetadata, KVWatchWorkerMetadata, ReserveJob, VerifyJob


@dataclass(slots=True)
class _Pending:
    ticket: Ticket
    job: ReserveJob


#: Transports that copy a block's bytes as they lie in memory (NIXL reads remote blocks, or head
#: slices of them): a reader whose memory layout differs reads those bytes wrongly. A transport
#: that saves and loads logical tensors (shared storage) converts between layouts.
RAW_TRANSPORTS = frozenset({"nixl"})


class WorkerSide:
    def __init__(
        self,
        watch: KVWatch,
        pool: PagedKVPool,
        rank: int,
        resolve_interval: float = 1.0,
        signature: dict[str, int | str] | None = None,
    ) -> None:
        self.watch = watch
        self.pool = pool
        self.rank = str(rank)
        #: What this rank's pages mean (layout.signature), sealed with them and checked against
        #: the writer's before a load is read; None where the pool does not see its heads.
        self.signature = signature if isinstance(pool, HeadedPool) else None
        # On an accelerator the free-canary and tag checks stay on the device until read; reading
        # them waits for the stream, so that happens at most once per interval, never per step.
        self.resolve_interval = 0.0 if pool.is_cpu else resolve_interval
        self._resolved_at = time.monotonic()
        self.tickets: dict[str, _Pending] = {}
        #: One request instance per live request: its reservation and its own writes are the
        #: same holder (a finding names it once).
        self.instances: dict[str, str] = {}
        self.to_seal: list[tuple[str, list[int]]] = []
        self.after_forward: list[VerifyJob] = []
        self.seals: dict[str, dict[str, dict[str, object]]] = {}
        self.load_errors: set[int] = set()
        self.verdicts: list[Verdict] = []  # every mismatch seen, for logs and tests
        #: Prefill: the sent requests, and the ones whose lease expired (see lease.py).
        self.lease = LeaseWatch(watch)
        # Block 0 is vLLM's null block: never allocated, freed or read. Everything else starts
        # on the free list.
        watch.on_free(range(1, pool.num_pages))

    def bind(self, meta: KVWatchMetadata) -> None:
        """Before the forward and every load: block events, reservations, finished loads."""
        self.instances.update(meta.instances)
        self._resolve()
        for event in meta.events:
            if event.kind == "alloc":
                self._record(self.watch.on_alloc(event.block_ids))
            else:
                self._record(self.watch.on_free(event.block_ids))
        stamped = False
        for job in meta.reserve:
            ticket = self.watch.on_reserve(
                job.request_id, job.block_ids, self.instance_of(job.request_id)
            )
            if ticket is not None:
                self.tickets[job.request_id] = _Pending(ticket, job)
                stamped = True
        if stamped and self.pool.device.type == "cuda":
            # The transport writes with RDMA, outside CUDA stream order: the reserved stamps
            # must be in memory before this step's load starts. Once per step with new loads.
            torch.cuda.current_stream(self.pool.device).synchronize()
        for verify in meta.verify:
            if verify.after_forward:
                self.after_forward.append(verify)
            else:
                self.verify(verify)
        # After the checks of what is in the blocks now: this step's forward writes them next.
        writes = [(w.request_id, self.instance_of(w.request_id), w.block_ids) for w in meta.writes]
        for rid, instance, block_ids in writes:
            self.watch.wrote(rid, block_ids, instance)
        for rid in meta.release:
            self.tickets.pop(rid, None)
            self.instances.pop(rid, None)
        self.to_seal.extend((job.request_id, job.block_ids) for job in meta.seal)
        # After this step's writes (the holders it names include them); before meta.sent: an
        # expiry is in both.
        self._record(self.lease.step(writes=writes))
        self.lease.done(meta.sent)

    def verify(self, job: VerifyJob) -> list[Verdict]:
        pending = self.tickets.pop(job.request_id, None)
        if pending is None:
            return []
        ticket, reserve = pending.ticket, pending.job
        count = ticket.page_count if job.blocks is None else min(job.blocks, ticket.page_count)
        # The delivered run of the reservation; the rest of the ticket (its request) as it is.
        ticket = replace(ticket, pages=ticket.pages[:count], tags=ticket.tags[:count])
        seal, layout = self._seal_for(reserve, count)
        # NIXL does not carry page tags, so the write is recorded when its completion is seen,
        # for the blocks it really wrote: the tag check then catches a block reallocated
        # between reservation and this read, and a block it did not write keeps its last
        # writer, whom a finding names.
        self.watch.landed(ticket)
        verdicts = self.watch.verify_admit(ticket, seal, context=self._peer(reserve), layout=layout)
        self._record(verdicts)
        held = [int(b) for b in ticket.pages]
        for verdict in verdicts:
            if verdict.blocks:  # enforce: vLLM fails (or recomputes) the request
                self.load_errors.update(verdict.pages or held)
        return verdicts

    def _peer(self, job: ReserveJob) -> dict[str, int | str]:
        """Who sent the KV: the finding's detail (prefill's instance from this rank's seal)."""
        peer: dict[str, int | str] = dict(job.peer)
        seals = job.seals or {}
        # Every writer rank names the scheduler's one instance; this rank's seal first (a
        # writer of another width may have no rank of this number).
        for wire in (seals.get(self.rank), *seals.values()):
            instance = wire.get("instance") if isinstance(wire, dict) else None
            if isinstance(instance, str) and instance:
                peer["peer_instance"] = instance[:128]
                break
        return peer

    def watch_lease_expiry(self, window_s: float = DEFAULT_FREED_WATCH_S) -> None:
        """Prefill: report blocks freed before their remote read (NIXL's lease expiry)."""
        self.lease.window_s = window_s
        self.lease.attach()

    def close(self) -> None:
        self._record(self.lease.close())

    def instance_of(self, request_id: str) -> str:
        instance = self.instances.get(request_id)
        if instance is None:
            instance = self.instances[request_id] = new_instance()
        return instance

    def _seal_for(self, job: ReserveJob, count: int) -> tuple[Seal | None, dict[str, int | str]]:
        """The seal of the blocks the transport delivered (the sealed blocks from decode's own
        prefix hits on, as many as were loaded), and what of the writer's layout differs from
        this rank's (a ``layout_mismatch`` when not empty)."""
        if job.reason:
            if job.reason != Skip.NO_SEAL:  # verify_admit counts no_seal itself
                self.watch.skip(Detector.CHECKSUM, Skip(job.reason))
            return None, {}
        if self.signature is not None:
            try:
                seal, layout = self._head_seal(job)
            except (TypeError, ValueError, KeyError):  # a malformed peer seal: not ours to fail
                self.watch.skip(Detector.CHECKSUM, Skip.OTHER)
                return None, {}
        else:
            seal, layout = self._rank_seal(job), {}
        if seal is None:
            return None, layout
        if job.block_ids and count == len(job.block_ids):
            # Everything reserved was loaded: the seal must end where the reservation ends, so
            # a block count that differs is a finding, not a shorter check.
            return seal.run(job.local_hits, seal.page_count), {}
        return seal.run(job.local_hits, count), {}

    def _rank_seal(self, job: ReserveJob) -> Seal | None:
        """A pool that does not see its heads: the writer rank of this number's whole pages."""
        wire = (job.seals or {}).get(self.rank)
        if wire is None or "pages" not in wire:
            self.watch.skip(Detector.CHECKSUM, Skip.OTHER)  # no page seal from this rank's peer
            return None
        if wire.get("page_bytes") != self.pool.page_bytes:
            # Prefill's pages are laid out or typed differently: its digest cannot match.
            self.watch.skip(Detector.CHECKSUM, Skip.UNSUPPORTED_LAYOUT)
            return None
        return Seal.from_wire(wire)

    def _head_seal(self, job: ReserveJob) -> tuple[Seal | None, dict[str, int | str]]:
        """This rank's page seal recombined from the writer ranks' per-head seals: for each
        block, the digest of the heads this rank holds, in head order (heads.py)."""
        assert self.signature is not None and isinstance(self.pool, HeadedPool)
        mine, fields = self.signature, SIGNATURE_FIELDS
        if job.peer.get("transport") in RAW_TRANSPORTS:
            fields = (*fields, "layout")
        held: dict[int, tuple[list[list[int]], int]] = {}  # global head -> (rows, column)
        residue: set[tuple[str, str]] = set()
        for rank, wire in sorted((job.seals or {}).items()):
            layout = wire.get("layout")
            if not isinstance(layout, dict) or not isinstance(wire.get("heads"), str):
                # A writer rank whose pool does not see its heads: nothing to recombine.
                self.watch.skip(Detector.CHECKSUM, Skip.UNSUPPORTED_LAYOUT)
                return None, {}
            # With one head on either side HND and NHD are the same bytes: no layout to compare.
            ambiguous = 1 in (layout.get("head_count"), mine["head_count"])
            differ = [
                f for f in fields if layout.get(f) != mine[f] and not (f == "layout" and ambiguous)
            ]
            if differ:
                first = differ[0]
                return None, {
                    "field": first,
                    "sealed": str(layout.get(first))[:64],
                    "read": str(mine[first])[:64],
                    "fields": ",".join(differ),
                    "writer_rank": str(rank)[:16],
                }
            start, heads = int(layout.get("head_start", 0)), int(layout.get("head_count", 0))
            rows = unpack(wire["heads"], int(wire.get("page_count", -1)), heads)
            if rows is None:
                self.watch.skip(Detector.CHECKSUM, Skip.OTHER)  # a malformed seal
                return None, {}
            for column in range(heads):
                held.setdefault(start + column, (rows, column))
            residue.update(Seal.from_wire(wire).residue)
        first_head = self.pool.head_start
        need = range(first_head, first_head + self.pool.head_count)
        if any(h not in held for h in need):
            # No writer rank sealed a head this rank holds (a writer without kvwatch on some
            # rank, or its seal lost): this rank cannot check the load.
            self.watch.skip(Detector.CHECKSUM, Skip.NO_SEAL)
            return None, {}
        count = min(len(held[h][0]) for h in need)
        pages = tuple(
            page_digests_digest([held[h][0][i][held[h][1]] for h in need]) for i in range(count)
        )
        return Seal(count, page_digests_digest(pages), pages, tuple(sorted(residue))), {}

    def save(self) -> None:
        """After the forward: verify this step's synchronous loads, seal completed prompts."""
        jobs, self.after_forward = self.after_forward, []
        for job in jobs:
            self.verify(job)
        seals, self.to_seal = self.to_seal, []
        for rid, block_ids in seals:
            seal = self._seal(block_ids)
            if seal is not None:
                # The instance: decode's findings name it as their peer's (see lease.py).
                instance = self.instance_of(rid)
                self.seals.setdefault(rid, {})[self.rank] = self._wire(seal) | {
                    "instance": instance
                }
                self.lease.sealed(rid, instance, block_ids)
        self._resolve()

    def _seal(self, block_ids: list[int]) -> Seal | None:
        return self.watch.seal_pages(block_ids)

    def _wire(self, seal: Seal) -> dict[str, object]:
        """Per block and KV head with the layout signature where the pool sees its heads (any
        reader width recombines it), else per block with the page size (the same width only)."""
        wire = seal.to_wire()
        if seal.heads and self.signature is not None:
            del wire["pages"]
            return wire | {"heads": pack(seal.heads), "layout": dict(self.signature)}
        return wire | {"page_bytes": self.pool.page_bytes}

    def _resolve(self) -> None:
        now = time.monotonic()
        if now - self._resolved_at >= self.resolve_interval:
            self._resolved_at = now
            self._record(self.watch.resolve())

    def worker_meta(self) -> KVWatchWorkerMetadata | None:
        if not self.seals:
            return None
        seals, self.seals = self.seals, {}
        return KVWatchWorkerMetadata(seals)

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def _record(self, verdicts: list[Verdict]) -> None:
        self.verdicts.extend(verdicts)
