"""minipd's prefill and decode workers in one process, driven step by step without HTTP or
threads: the router's handoff (bootstrap, reserve, transfer, admit), aborts, late writes and
decode steps run the engine's own code in the order a history says, so thousands of engine
histories fit in a test. What each decode step really reads is taken from minipd's own
record (:class:`minipd.kvcache.PageOwners`), as the engine is about to read it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine_hooks import canary
from minipd import tokenizer
from minipd.config import Faults, ServeConfig
from minipd.decode import DecodeRequest, DecodeWorker
from minipd.kvcache import PoolShape, make_buffers, make_owners, pages_for
from minipd.prefill import PrefillWorker, Transfer

_QUIET = logging.getLogger("tests.minipd.inprocess")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False
_QUIET.setLevel(logging.CRITICAL)


class _NoWait(threading.Condition):
    """The decode scheduler's condition, in a process with no other thread: nothing can
    arrive while it waits, so a wait returns at once (the driver never lets a reserve wait:
    it reserves only what fits)."""

    def wait(self, timeout: float | None = None) -> bool:
        return False


#: Whose KV a reader read: source request id -> (pages, tokens), the most of any one read.
Reads = dict[str, tuple[int, int]]


@dataclass
class Engine:
    cfg: ServeConfig
    decode: DecodeWorker
    prefill: PrefillWorker
    #: Transfers whose writes prefill delayed (late writes), by request id.
    delayed: dict[str, Transfer] = field(default_factory=dict)
    #: minipd's record of what each decode request read: the ground truth.
    reads: dict[str, Reads] = field(default_factory=dict)
    count: int = 0

    @classmethod
    def start(
        cls,
        spool: Path,
        *,
        version: str = "0.5.19",
        scrub: str = "off",
        mode: str = "log",
        page_size: int = 4,
        decode_pages: int = 24,
        prefill_pages: int = 8,
        deferred_release: bool | None = None,
    ) -> Engine:
        cfg = ServeConfig(
            version=version,
            page_size=page_size,
            prefill_pool_tokens=prefill_pages * page_size,
            decode_pool_tokens=decode_pages * page_size,
            context_length=4 * decode_pages * page_size,
            layers=1,
            kvwatch=mode,
            kvwatch_spool=str(spool),
            kvwatch_scrub=scrub,
            deferred_release=deferred_release,
        )
        shape = PoolShape.for_tokens(cfg.decode_pool_tokens, page_size, cfg.layers, cfg.head_dim)
        buffers = make_buffers(shape, torch.device("cpu"), shared=False)
        tags = torch.zeros(shape.num_pages, dtype=torch.int64)
        owners = make_owners(shape.slots, shared=False)
        decode = DecodeWorker(cfg, buffers, tags, _QUIET, owners)
        decode.cond = _NoWait()
        prefill = PrefillWorker(cfg, buffers, tags, _QUIET, owners)
        engine = cls(cfg, decode, prefill)
        prefill.complete = lambda _url, message: decode.transfer_complete(message)
        prefill.send_later = lambda job, _delay: engine.delayed.__setitem__(job.rid, job)
        original = decode._decode_one

        def read_then_decode(req: DecodeRequest) -> None:
            engine._record_read(req)
            original(req)

        decode._decode_one = read_then_decode  # type: ignore[method-assign]
        return engine

    def _record_read(self, req: DecodeRequest) -> None:
        """What this decode step of ``req`` reads (its context, as ``_decode_one`` gives it to
        attention), slot by slot, from the engine's own ownership record."""
        assert req.slots is not None
        context = req.slots[: req.prompt_tokens + len(req.output)]
        context = context[self._holds_kv(context)]
        seen = self.reads.setdefault(req.rid, {})
        for source, (pages, tokens) in self.decode.owners.held(context, req.rid).items():
            before = seen.get(source, (0, 0))
            seen[source] = (max(before[0], pages), max(before[1], tokens))

    def _holds_kv(self, slots: torch.Tensor) -> torch.Tensor:
        """Per slot, whether it still holds the KV its writer wrote: the token's key, but for
        the bytes where the hooks' canary stamp may sit (the first bytes of a page's first
        slot: a stamp there leaves the slot's values, and the rest of its key, the writer's).
        A zeroed (scrubbed) or never-written slot holds nobody's."""
        model, pool = self.decode.model, self.decode.pool
        skip = -(-canary.STAMP_BYTES // 4)  # float32 elements under the stamp
        keys = pool.keys(0).index_select(0, slots)[:, 0, skip:]
        return (keys == model._key.reshape(-1)[skip:]).all(dim=1)

    # -- the router's handoff --------------------------------------------------------------

    def submit(self, prompt_tokens: int, max_new: int, *, late: bool = False) -> str | None:
        """One request through bootstrap, reserve and transfer (the router's ``_handoff``),
        prefill's write delayed when ``late``. None when it did not get that far (no room)."""
        self.count += 1
        rid = f"r{self.count}"
        rows = np.zeros((prompt_tokens, tokenizer.DIGITS), dtype=np.uint16)
        rows[:, 0] = 1 + np.arange(prompt_tokens) % 9
        body: dict[str, Any] = {"rid": rid, "tokens": tokenizer.to_wire(rows)}
        status, _ = self.prefill.bootstrap(body)
        if status != 200:
            return None
        decode, page_size = self.decode, self.cfg.page_size
        total = pages_for(prompt_tokens + max_new, page_size)
        if total > decode.pool.num_pages or len(decode.free) - decode.promised < total:
            self.prefill.abort({"rid": rid})  # would wait for room: the history moves on
            return None
        reserve = {"rid": rid, "prompt_tokens": prompt_tokens, "max_new_tokens": max_new}
        status, pages = decode.reserve(reserve)
        if status != 200:
            self.prefill.abort({"rid": rid})
            return None
        if late:
            faults = replace(self.cfg.faults, late_write=self.prefill.transfers + 1)
            self.prefill.cfg = replace(self.cfg, faults=faults)
        transfer = {
            "rid": rid,
            "dest_pages": pages["pages"],
            "dest_tags": pages["tags"],
            "decode_url": "in-process",
        }
        status, _ = self.prefill.transfer(transfer)
        self.prefill.cfg = replace(self.cfg, faults=Faults())
        if status != 200 and self.cfg.release.router_drops_decode_half:
            decode.abort({"rid": rid, "drained": True})
        return rid

    def abort(self, rid: str) -> None:
        """The router gives up on a request (its client left, the transfer timed out):
        decode's half is aborted with prefill's writes perhaps still in flight."""
        self.decode.abort({"rid": rid, "drained": rid not in self.delayed})

    def land(self, rid: str) -> None:
        """A delayed write of prefill's lands now (into whatever its pages have become)."""
        job = self.delayed.pop(rid, None)
        if job is not None:
            self.prefill._send(job, 0.0)

    def step(self) -> None:
        """One pass of decode's scheduler: admit what arrived, one step of the batch."""
        decode = self.decode
        with decode.cond:
            if decode.arrived or decode.running:
                decode._schedule()

    def drain(self, limit: int = 200) -> None:
        """Land every delayed write and run decode until nothing runs."""
        for rid in list(self.delayed):
            self.land(rid)
        for _ in range(limit):
            if not (self.decode.arrived or self.decode.running):
                return
            self.step()

    def close(self) -> None:
        self.decode.stopping.set()
        for watch in (self.decode.watch, self.prefill.watch):
            if watch is not None:
                watch.close()
