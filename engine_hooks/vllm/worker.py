"""The worker half of the kvwatch connector: the detectors on vLLM's own KV tensors.

Per step, in ``start_load_kv`` (before the forward reads or writes any KV): mirror the block
pool's allocations and frees (free canaries, page tags), stamp and tag blocks reserved for a
remote load, and verify loads the scheduler saw finish. In ``wait_for_save`` (after the forward
wrote the KV): seal the blocks of prompts that completed this step. Mismatches in enforce mode
become ``get_block_ids_with_load_errors``, which vLLM's ``kv_load_failure_policy`` turns into an
error for the request (``fail``, the default) or a local recompute (``recompute``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine_hooks import KVWatch, PagedKVPool, Seal, Ticket, Verdict
from engine_hooks.vllm.metadata import KVWatchMetadata, KVWatchWorkerMetadata, ReserveJob


@dataclass(slots=True)
class _Pending:
    ticket: Ticket
    job: ReserveJob


class WorkerSide:
    def __init__(
        self, watch: KVWatch, pool: PagedKVPool, rank: int, resolve_interval: float = 1.0
    ) -> None:
        self.watch = watch
        self.pool = pool
        self.rank = str(rank)
        # On an accelerator the free-canary and tag checks stay on the device until read; reading
        # them waits for the stream, so that happens at most once per interval, never per step.
        self.resolve_interval = 0.0 if pool.is_cpu else resolve_interval
        self._resolved_at = time.monotonic()
        self.tickets: dict[str, _Pending] = {}
        self.to_seal: list[tuple[str, list[int]]] = []
        self.seals: dict[str, dict[str, dict[str, int]]] = {}
        self.load_errors: set[int] = set()
        self.verdicts: list[Verdict] = []  # every mismatch seen, for logs and tests
        # Block 0 is vLLM's null block: never allocated, freed or read. Everything else starts
        # on the free list.
        watch.on_free(range(1, pool.num_pages))

    def start(self, meta: KVWatchMetadata) -> None:
        """Before the forward: block events, reservations, verifications."""
        self._resolve()
        for event in meta.events:
            if event.kind == "alloc":
                self._record(self.watch.on_alloc(event.block_ids))
            else:
                self._record(self.watch.on_free(event.block_ids))
        stamped = False
        for job in meta.reserve:
            ticket = self.watch.on_reserve(job.request_id, job.block_ids)
            if ticket is not None:
                self.tickets[job.request_id] = _Pending(ticket, job)
                stamped = True
        if stamped and self.pool.device.type == "cuda":
            # The transport writes with RDMA, outside CUDA stream order: the reserved stamps
            # must be in memory before this step's load starts. Once per step with new loads.
            torch.cuda.current_stream(self.pool.device).synchronize()
        for rid in meta.verify:
            self.verify(rid)
        for rid in meta.release:
            self.tickets.pop(rid, None)
        self.to_seal.extend((job.request_id, job.block_ids) for job in meta.seal)

    def verify(self, rid: str) -> list[Verdict]:
        pending = self.tickets.pop(rid, None)
        if pending is None:
            return []
        ticket, job = pending.ticket, pending.job
        seal = self._seal_for(job)
        # NIXL does not carry page tags, so the write is recorded when its completion is seen:
        # the tag check then catches a block reallocated between reservation and this read.
        self.pool.mark_written(ticket.pages, ticket.tags)
        verdicts = self.watch.verify_admit(ticket, seal)
        self._record(verdicts)
        held: list[int] = [int(b) for b in job.block_ids]
        for verdict in verdicts:
            if verdict.blocks:  # enforce: vLLM fails (or recomputes) the request
                self.load_errors.update(verdict.pages or held)
        return verdicts

    def _seal_for(self, job: ReserveJob) -> Seal | None:
        if job.reason:
            if job.reason != "no_seal":  # verify_admit counts no_seal itself
                self.watch.stats.skipped("checksum", job.reason)
            return None
        wire = (job.seals or {}).get(self.rank)
        if wire is None:
            self.watch.stats.skipped("checksum", "other")  # no seal from this rank's peer
            return None
        if wire.get("page_bytes") != self.pool.page_bytes:
            # Prefill's pages are laid out or typed differently: its digest cannot match.
            self.watch.stats.skipped("checksum", "unsupported_layout")
            return None
        return Seal.from_wire(wire)

    def save(self) -> None:
        """After the forward: seal the prompts that completed this step."""
        jobs, self.to_seal = self.to_seal, []
        for rid, block_ids in jobs:
            seal = self.watch.seal(rid, block_ids)
            if seal is not None:
                wire = seal.to_wire() | {"page_bytes": self.pool.page_bytes}
                self.seals.setdefault(rid, {})[self.rank] = wire
        self._resolve()

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
