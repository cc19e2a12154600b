"""The prefill worker: admits a request, computes its KV, writes it into decode's pool.

Step 2 of the incident's handoff. The write into decode's pool is one-sided: decode's pool is shared
memory that this process writes directly, and decode learns of it only from the "transfer
complete" message sent afterwards. The scheduler's pool check reduces a prompt that cannot fit
this pool to a one-token placeholder and stores the error in ``to_finish``; what happens next
depends on the release.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from typing import Any

import torch

from engine_hooks import KVWatch, PagedKVPool, Seal
from minipd import httpjson, process, tokenizer
from minipd.config import ServeConfig
from minipd.httpjson import Body, error
from minipd.kvcache import (
    FreeList,
    KVPool,
    PageOwners,
    PoolShape,
    copy_pages,
    make_buffers,
    make_owners,
    pages_for,
)
from minipd.logs import startup_line
from minipd.model import ReciteModel
from minipd.watching import blocked, describe, hook_seconds, make_watch, settle


@dataclass(slots=True)
class PrefillRequest:
    rid: str
    prompt_tokens: int
    rows: tokenizer.Rows
    created: float = field(default_factory=time.monotonic)
    #: The error to return once the request drains (SGLang's ``to_finish``).
    to_finish: str | None = None
    finished_reason: str | None = None

    def finished(self) -> bool:
        # As SGLang's Req.finished(): it reads finished_reason, not to_finish.
        return self.finished_reason is not None

    def set_finish_with_abort(self, message: str) -> None:
        self.to_finish = message
        self.rows = tokenizer.placeholder()


@dataclass(slots=True)
class Transfer:
    """One request's pages on their way into decode's pool."""

    rid: str
    number: int
    src: list[int]
    dest: list[int]
    tags: list[int]
    seal: Seal | None
    aborted: bool
    decode_url: str


class PrefillWorker:
    def __init__(
        self,
        cfg: ServeConfig,
        decode_buffers: list[torch.Tensor],
        decode_tags: torch.Tensor,
        logger: logging.Logger,
        decode_owners: torch.Tensor,
    ) -> None:
        self.cfg = cfg
        self.log = logger
        self.decode_owners = PageOwners(decode_owners, cfg.page_size)
        device = torch.device(cfg.device)
        shape = PoolShape.for_tokens(
            cfg.prefill_pool_tokens, cfg.page_size, cfg.layers, cfg.head_dim
        )
        self.pool = KVPool(make_buffers(shape, device, shared=False), cfg.page_size)
        self.owners = PageOwners(make_owners(shape.slots, shared=False), cfg.page_size)
        self.pool_tokens = shape.slots
        self.free = FreeList(shape.num_pages)
        self.decode_pool = KVPool(decode_buffers, cfg.page_size)
        # Our description of decode's pool, for the page tags we write with the KV.
        self.decode_view = PagedKVPool(decode_buffers, cfg.page_size, tag_store=decode_tags)
        self.model = ReciteModel(cfg.head_dim, device, ffn_width=cfg.ffn_width, layers=cfg.layers)
        self.watch: KVWatch | None = make_watch(
            cfg, "prefill", describe(self.pool), self.pool_tokens
        )
        if self.watch is not None:
            self.watch.on_free(list(range(shape.num_pages)))  # stamp the pool free at start
        # SGLang's max_req_input_len: one slot is kept back.
        self.max_input = self.pool_tokens - 1
        self.lock = threading.Lock()
        self.requests: dict[str, PrefillRequest] = {}
        self.transfers = 0
        self.rejected = 0
        # How "transfer complete" reaches decode (HTTP), and how a delayed write is sent later
        # (a thread): an in-process driver (tests/minipd/inprocess.py) sets both.
        self.complete: Callable[[str, Body], tuple[int, Body]] = _post_complete
        self.send_later: Callable[[Transfer, float], None] = self._send_on_thread
        logger.info(
            startup_line(self.pool_tokens, cfg.context_length, cfg.max_running_requests, device)
        )

    def routes(self) -> dict[tuple[str, str], httpjson.Route]:
        return {
            ("GET", "/health"): lambda body: (200, {"status": "ok", "role": "prefill"}),
            ("GET", "/stats"): self.stats,
            ("POST", "/bootstrap"): self.bootstrap,
            ("POST", "/transfer"): self.transfer,
            ("POST", "/abort"): self.abort,
        }

    def stats(self, body: Body) -> tuple[int, Body]:
        with self.lock:
            return 200, {
                "transfers": self.transfers,
                "rejected": self.rejected,
                "free_pages": len(self.free),
                "waiting": len(self.requests),
                "process_cpu_seconds": time.process_time(),
                "hook_seconds": hook_seconds(self.watch),
            }

    # -- PrefillBootstrapQueue.add ------------------------------------------------------------

    def bootstrap(self, body: Body) -> tuple[int, Body]:
        rid = str(body["rid"])
        rows = tokenizer.from_wire(str(body["tokens"]))
        req = PrefillRequest(rid, len(rows), rows)
        if req.prompt_tokens > self.max_input:
            req.set_finish_with_abort(
                f"Input length ({req.prompt_tokens} tokens) exceeds the maximum allowed length "
                f"({self.max_input} tokens). Use a shorter input or enable --allow-auto-truncate."
            )
            self.log.info("rid=%s prompt_tokens=%d aborted: pool check", rid, req.prompt_tokens)
        if self.cfg.release.admission_checks_to_finish and req.to_finish is not None:
            with self.lock:
                self.rejected += 1
            return error(400, req.to_finish)  # rejected at the door: nothing reserved
        if req.finished():
            return error(400, req.finished_reason or "finished")
        with self.lock:
            self._expire()
            if self.watch is not None:  # the queue admits it: kvwatch checks that it may
                verdict = self.watch.on_admission(
                    rid,
                    "prefill_bootstrap",
                    aborted=req.to_finish is not None,
                    finished=req.finished(),
                )
                stop = settle(self.log, [verdict])
                if stop is not None:
                    return blocked(stop)
            self.requests[rid] = req
        return 200, {"prompt_tokens": req.prompt_tokens}

    def abort(self, body: Body) -> tuple[int, Body]:
        with self.lock:
            self.requests.pop(str(body.get("rid")), None)
        return 200, {}

    def _expire(self) -> None:
        limit = time.monotonic() - max(self.cfg.transfer_timeout, 1.0) * 4
        for rid in [r for r, q in self.requests.items() if q.created < limit]:
            del self.requests[rid]

    # -- forward pass, result processing, KV send ---------------------------------------------

    def transfer(self, body: Body) -> tuple[int, Body]:
        rid = str(body["rid"])
        dest = [int(p) for p in body["dest_pages"]]
        tags = [int(t) for t in body.get("dest_tags") or []]
        with self.lock:
            req = self.requests.pop(rid, None)
            if req is None:
                return error(404, f"unknown request {rid}")
            count = pages_for(len(req.rows), self.cfg.page_size)
            src = self.free.alloc(count)
            if src is None:
                return error(503, "prefill KV pool exhausted")
            if self.watch is not None:
                stop = settle(self.log, self.watch.on_alloc(src, rid))
                if stop is not None:
                    self._release(src)
                    return blocked(stop)
            slots = self.pool.slots_of(src, len(req.rows))
            self.model.write(self.pool, slots, req.rows)
            self.owners.wrote(slots, rid)
            if req.to_finish is not None and self.cfg.release.retire_aborted_prefill:
                self._release(src)  # retired before its result reaches decode
                self.rejected += 1
                return error(400, req.to_finish)
            if count > len(dest):
                self._release(src)
                return error(500, "decode reserved fewer pages than the prompt needs")
            self.transfers += 1
            seal = self.watch.seal(rid, src, len(req.rows)) if self.watch else None
            job = Transfer(
                rid,
                self.transfers,
                src,
                dest[:count],
                tags[:count],
                seal,
                req.to_finish is not None,
                str(body["decode_url"]),
            )
        faults = self.cfg.faults
        if job.number == faults.late_write:
            self.log.info("rid=%s fault: page writes delayed %.2fs", rid, faults.late_write_delay)
            self.send_later(job, faults.late_write_delay)
            return 200, {"written_pages": count, "drained": False}
        self._send(job, 0.0)
        return 200, {"written_pages": count, "drained": True}

    def _send_on_thread(self, job: Transfer, delay: float) -> None:
        threading.Thread(target=self._send, args=(job, delay)).start()

    def _send(self, job: Transfer, delay: float) -> None:
        """Write the pages into decode's pool, tag them, then send "transfer complete"."""
        if delay:
            time.sleep(delay)
        faults = self.cfg.faults
        src, dest, tags = job.src, job.dest, job.tags
        if job.number == faults.drop_page:
            lost = len(dest) // 2
            self.log.info("rid=%s fault: page write %d of %d dropped", job.rid, lost, len(dest))
            src, dest = src[:lost] + src[lost + 1 :], dest[:lost] + dest[lost + 1 :]
            tags = tags[:lost] + tags[lost + 1 :] if tags else tags
        copy_pages(self.pool, src, self.decode_pool, dest)
        self.decode_owners.copied(self.owners, src, dest)
        if tags:
            self.decode_view.mark_written(dest, tags)
        if job.number == faults.bit_flip and dest:
            page = dest[len(dest) // 2]
            raw = self.decode_pool.page_rows(self.decode_pool.values(0)).view(torch.uint8)
            raw[page, 6] ^= 0x10
            self.log.info("rid=%s fault: one bit flipped in transfer", job.rid)
        with self.lock:
            self._release(job.src)
        message: dict[str, Any] = {
            "rid": job.rid,
            "seal": job.seal.to_wire() if job.seal is not None else None,
            "aborted": job.aborted,
            "written_pages": len(job.src),
        }
        status, _ = self.complete(job.decode_url, message)
        if status != 200:
            self.log.warning("rid=%s transfer complete not delivered: %d", job.rid, status)

    def _release(self, pages: list[int]) -> None:
        if self.watch is not None:
            settle(self.log, self.watch.on_free(pages))
            # On an accelerator, checks deferred to a sync point; on CPU this is empty.
            settle(self.log, self.watch.resolve())
        self.free.free(pages)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()


def _post_complete(decode_url: str, message: Body) -> tuple[int, Body]:
    return httpjson.call(decode_url, "/transfer_complete", message)


def main(
    cfg: ServeConfig,
    decode_buffers: list[torch.Tensor],
    decode_tags: torch.Tensor,
    decode_owners: torch.Tensor,
    ready: Queue[tuple[str, int]],
    parent_pid: int,
) -> None:
    def built(logger: logging.Logger) -> PrefillWorker:
        return PrefillWorker(cfg, decode_buffers, decode_tags, logger, decode_owners)

    process.serve("prefill", cfg.prefill_port, cfg.log_dir, ready, parent_pid, built)
