"""The decode worker: reserves pages, admits on "transfer complete", generates in batches.

Steps 1 and 3 of the incident's handoff. Decode reserves destination pages for the whole prompt,
never sees prefill's writes land (they go straight into its shared-memory pool), and on the
"transfer complete" message admits the request and reads every reserved page. Requests join
and leave the running batch between steps (continuous batching); pages go back to the free list
when a request ends, without being cleared.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.queues import Queue

import numpy as np
import torch

from engine_hooks import KVWatch, Seal, Ticket, Verdict
from minipd import httpjson, process, tokenizer
from minipd.config import ServeConfig
from minipd.httpjson import Body, error
from minipd.kvcache import FreeList, KVPool, PageOwners, pages_for
from minipd.logs import startup_line
from minipd.model import ReciteModel
from minipd.watching import Seen, blocked, describe, hook_seconds, make_watch, settle

RESERVED, TRANSFERRED, RUNNING, HELD, DONE = "reserved", "transferred", "running", "held", "done"
_FORGET_SECONDS = 600.0


@dataclass(slots=True)
class DecodeRequest:
    rid: str
    prompt_tokens: int
    max_new_tokens: int
    pages: list[int]
    ticket: Ticket | None
    budget: int  # pages promised for the tokens it will generate
    created: float = field(default_factory=time.monotonic)
    state: str = RESERVED
    seal: Seal | None = None
    aborted_upstream: bool = False
    output: list[tokenizer.Rows] = field(default_factory=list)
    slots: torch.Tensor | None = None
    done: threading.Event = field(default_factory=threading.Event)
    status: int = 0
    reply: Body = field(default_factory=dict)
    held_since: float = 0.0


@dataclass(slots=True)
class DecodeStats:
    admitted: int = 0
    finished: int = 0
    failed: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    step_hook_seconds: float = 0.0
    # The same on the scheduler thread's CPU clock: what other processes on a busy machine
    # take from us does not count.
    step_cpu_seconds: float = 0.0
    step_hook_cpu_seconds: float = 0.0
    tokens: int = 0
    pages_verified_at_admit: int = 0
    pages_checked_in_steps: int = 0


class DecodeWorker:
    def __init__(
        self,
        cfg: ServeConfig,
        buffers: list[torch.Tensor],
        tags: torch.Tensor,
        logger: logging.Logger,
        owners: torch.Tensor,
    ) -> None:
        self.cfg = cfg
        self.log = logger
        self.pool = KVPool(buffers, cfg.page_size)
        self.owners = PageOwners(owners, cfg.page_size)
        self.pool_tokens = self.pool.num_pages * cfg.page_size
        self.free = FreeList(self.pool.num_pages)
        self.model = ReciteModel(
            cfg.head_dim, self.pool.device, ffn_width=cfg.ffn_width, layers=cfg.layers
        )
        self.watch: KVWatch | None = make_watch(
            cfg, "decode", describe(self.pool, tags), self.pool_tokens
        )
        if self.watch is not None:
            self.watch.on_free(list(range(self.pool.num_pages)))
        self.cond = threading.Condition()
        self.requests: dict[str, DecodeRequest] = {}
        self.held: dict[str, DecodeRequest] = {}
        self.arrived: deque[str] = deque()
        self.running: list[DecodeRequest] = []
        self.promised = 0
        self.completions = 0
        self.stats = DecodeStats()
        self.seen = Seen()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="decode-scheduler", daemon=True)
        logger.info(
            startup_line(
                self.pool_tokens, cfg.context_length, cfg.max_running_requests, self.pool.device
            )
        )

    def routes(self) -> dict[tuple[str, str], httpjson.Route]:
        return {
            ("GET", "/health"): lambda body: (200, {"status": "ok", "role": "decode"}),
            ("GET", "/stats"): self.get_stats,
            ("POST", "/reserve"): self.reserve,
            ("POST", "/transfer_complete"): self.transfer_complete,
            ("POST", "/wait"): self.wait,
            ("POST", "/abort"): self.abort,
        }

    def get_stats(self, body: Body) -> tuple[int, Body]:
        with self.cond:
            out: Body = {name: getattr(self.stats, name) for name in DecodeStats.__slots__}
            out.update(free_pages=len(self.free), running=len(self.running), held=len(self.held))
            out["process_cpu_seconds"] = time.process_time()
            out["hook_seconds"] = hook_seconds(self.watch)
            return 200, out

    # -- step 1: DecodePreallocQueue: reserve pages for the whole prompt -----------------------

    def reserve(self, body: Body) -> tuple[int, Body]:
        rid = str(body["rid"])
        prompt_tokens = int(body["prompt_tokens"])
        max_new = int(body["max_new_tokens"])
        need = pages_for(prompt_tokens, self.cfg.page_size)
        total = pages_for(prompt_tokens + max_new, self.cfg.page_size)
        if total > self.pool.num_pages:
            return error(503, "the request can never fit the decode KV pool")
        deadline = time.monotonic() + self.cfg.transfer_timeout
        with self.cond:
            while len(self.free) - self.promised < total:
                left = deadline - time.monotonic()
                if left <= 0 or self.stopping.is_set():
                    return error(503, "decode KV pool full")
                self.cond.wait(min(left, 0.5))
            pages = self.free.alloc(need)
            assert pages is not None
            ticket = None
            if self.watch is not None:
                stop = settle(self.log, self.watch.on_alloc(pages, rid))
                if stop is not None:
                    self._free_pages(pages)
                    return blocked(stop)
                ticket = self.watch.on_reserve(rid, pages)
            req = DecodeRequest(rid, prompt_tokens, max_new, pages, ticket, total - need)
            self.owners.named(rid)
            self.promised += req.budget
            self.requests[rid] = req
        return 200, {"pages": pages, "tags": ticket_tags(ticket)}

    # -- step 3: "transfer complete", admit ----------------------------------------------------

    def transfer_complete(self, body: Body) -> tuple[int, Body]:
        rid = str(body["rid"])
        with self.cond:
            held = self.held.pop(rid, None)
            if held is not None:  # deferred release: prefill's writes have drained now
                self.log.info("rid=%s late transfer drained; held pages released", rid)
                self._free_pages(held.pages)
                held.pages = []
                return 200, {}
            req = self.requests.get(rid)
            if req is None or req.state != RESERVED:
                self.log.info("rid=%s transfer complete for no waiting request", rid)
                return 200, {}
            seal = body.get("seal")
            req.seal = Seal.from_wire(seal) if isinstance(seal, dict) else None
            req.aborted_upstream = bool(body.get("aborted"))
            req.state = TRANSFERRED
            self.arrived.append(rid)
            self.cond.notify_all()
        return 200, {}

    def _admit(self, req: DecodeRequest) -> None:
        if req.aborted_upstream and self.cfg.release.admission_checks_to_finish:
            self._fail(req, *error(400, "request was aborted by prefill"), drained=True)
            return
        if self.watch is not None:  # the queue admits it: kvwatch checks that it may
            verdict = self.watch.on_admission(
                req.rid, "decode_prealloc", aborted=req.aborted_upstream, finished=False
            )
            stop = settle(self.log, [verdict])
            if stop is not None:
                self._fail(req, *blocked(stop), drained=True)
                return
            # Before anything reads the pages, and a blocking verdict fails the request here.
            verdicts = self.watch.verify_admit(req.ticket, req.seal, before_read=True)
            self.stats.pages_verified_at_admit += len(req.pages)
            stop = settle(self.log, verdicts, self.seen)
            if stop is not None:
                self._fail(req, *blocked(stop), drained=True)
                return
        req.state = RUNNING
        self._refresh_slots(req)
        self._log_exposure(req, "admit")
        self.running.append(req)
        self.stats.admitted += 1

    def _log_exposure(self, req: DecodeRequest, when: str) -> None:
        """minipd's own record of whose KV the request's pages hold as it reads them (ids and
        counts only): the ground truth for kvwatch's sources. A slot counts only if it holds a
        token's KV now (a zeroed or never-written slot holds nobody's)."""
        if req.slots is None:
            return
        # What its last step read: step i attends over the prompt and the i tokens before it.
        context = req.slots[: req.prompt_tokens + max(0, len(req.output) - 1)]
        context = context[self.model.holds_token(self.pool, context)]
        for source, (pages, tokens) in sorted(self.owners.held(context, req.rid).items()):
            self.log.info(
                "rid=%s read KV of rid=%s pages=%d tokens=%d at %s",
                req.rid,
                source,
                pages,
                tokens,
                when,
            )

    def _refresh_slots(self, req: DecodeRequest) -> None:
        req.slots = self.pool.slots_of(req.pages, len(req.pages) * self.cfg.page_size)

    # -- generation ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self.stopping.is_set():
            with self.cond:
                try:
                    self._schedule()
                except Exception:
                    # A bug must not stop the engine: fail what was running, keep serving.
                    self.log.exception("decode step failed")
                    for req in list(self.running):
                        self._fail(req, *error(500, "decode step failed"), drained=True)

    def _schedule(self) -> None:
        self._expire()
        while self.arrived:
            req = self.requests.get(self.arrived.popleft())
            if req is not None and req.state == TRANSFERRED:
                self._admit(req)
        batch = self.running[: self.cfg.max_running_requests]
        if not batch:
            self.cond.wait(0.05)
            return
        self._step(batch)

    def _step(self, batch: list[DecodeRequest]) -> None:
        started, cpu_started = time.perf_counter(), time.thread_time()
        if self.watch is not None:
            batch = self._check_tags(batch)
        for req in batch:
            self._decode_one(req)
        if self.watch is not None:
            # On an accelerator the step's checks are read here, after the step's own sync
            # (reading the new tokens); on CPU they were read at once and this is empty.
            self._stop_blocked(self.watch.resolve())
        self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - started
        self.stats.step_cpu_seconds += time.thread_time() - cpu_started

    def _check_tags(self, batch: list[DecodeRequest]) -> list[DecodeRequest]:
        """Page tags of the whole batch in one check, before attention reads the pages."""
        assert self.watch is not None
        tickets = [r.ticket for r in batch if r.ticket is not None]
        started, cpu_started = time.perf_counter(), time.thread_time()
        # Before the step reads the pages; a blocked request leaves the batch below.
        verdicts = self.watch.check_batch(tickets, before_read=True)
        self.stats.step_hook_seconds += time.perf_counter() - started
        self.stats.step_hook_cpu_seconds += time.thread_time() - cpu_started
        self.stats.pages_checked_in_steps += sum(t.page_count for t in tickets)
        failed = self._stop_blocked(verdicts)
        return [r for r in batch if r.rid not in failed]

    def _stop_blocked(self, verdicts: list[Verdict]) -> set[str]:
        """Log the mismatches; fail the running requests that enforce mode stops."""
        settle(self.log, verdicts, self.seen)
        failed = {v.request_id: v for v in verdicts if v.blocks}
        for req in list(self.running):
            if req.rid in failed:
                self._fail(req, *blocked(failed[req.rid]), drained=True)
        return set(failed)

    def _decode_one(self, req: DecodeRequest) -> None:
        step = len(req.output)
        context = req.prompt_tokens + step
        assert req.slots is not None
        row = self.model.next_token(self.pool, req.slots[:context], target=step)
        req.output.append(row)
        self.stats.tokens += 1
        if len(req.output) >= req.max_new_tokens:
            self._finish(req)
            return
        if context // self.cfg.page_size >= len(req.pages) and not self._grow(req):
            return
        self.model.write(self.pool, req.slots[context : context + 1], row)
        self.owners.wrote(req.slots[context : context + 1], req.rid)

    def _grow(self, req: DecodeRequest) -> bool:
        """A new page for the request's own tokens, from the budget promised at reserve."""
        pages = self.free.alloc(1)
        if pages is None:
            self._fail(req, *error(500, "decode KV pool exhausted"), drained=True)
            return False
        req.budget -= 1
        self.promised -= 1
        if self.watch is not None and req.ticket is not None:
            started, cpu_started = time.perf_counter(), time.thread_time()
            verdicts = self.watch.on_alloc(pages, req.rid)  # free canary, tag bump
            self.watch.extend(req.ticket, pages)
            self.stats.step_hook_seconds += time.perf_counter() - started
            self.stats.step_hook_cpu_seconds += time.thread_time() - cpu_started
            stop = settle(self.log, verdicts)
            req.pages.extend(pages)
            if stop is not None:
                self._fail(req, *blocked(stop), drained=True)
                return False
        else:
            req.pages.extend(pages)
        self._refresh_slots(req)
        return True

    def _finish(self, req: DecodeRequest) -> None:
        self.completions += 1
        self._log_exposure(req, "finish")
        pages = req.pages
        self._end(req, drained=True)
        if self.completions == self.cfg.faults.double_free and pages:
            self.log.info("rid=%s fault: page freed twice", req.rid)
            self._free_pages(pages[:1])
        rows = np.concatenate(req.output) if req.output else np.zeros((0, tokenizer.DIGITS))
        req.status = 200
        req.reply = {
            "output": tokenizer.to_wire(rows.astype(np.uint16)),
            "completion_tokens": len(req.output),
        }
        self.stats.finished += 1
        req.done.set()

    # -- ending a request ---------------------------------------------------------------------

    def _fail(self, req: DecodeRequest, status: int, reply: Body, *, drained: bool) -> None:
        self.log.info("rid=%s failed: %d", req.rid, status)
        self._end(req, drained=drained)
        req.status, req.reply = status, reply
        self.stats.failed += 1
        req.done.set()

    def _end(self, req: DecodeRequest, *, drained: bool) -> None:
        """Take the request out of the batch and give back its pages, or hold them while
        prefill may still be writing (deferred release)."""
        if req in self.running:
            self.running.remove(req)
        self.promised -= req.budget
        req.budget = 0
        req.state = DONE
        if not req.pages:
            return
        if not drained and self.cfg.defers_release:
            req.state = HELD
            req.held_since = time.monotonic()
            self.held[req.rid] = req
            return
        self._free_pages(req.pages)
        req.pages = []

    def _free_pages(self, pages: list[int]) -> None:
        if self.watch is not None:
            settle(self.log, self.watch.on_free(pages))
        self.free.free(pages)
        self.cond.notify_all()

    def _expire(self) -> None:
        now = time.monotonic()
        for rid, req in list(self.requests.items()):
            if req.state == DONE and now - req.created > _FORGET_SECONDS:
                del self.requests[rid]  # nobody came for the result
            if req.state == RESERVED and now - req.created > self.cfg.transfer_timeout:
                self.log.info("rid=%s KV transfer timed out", req.rid)
                self._fail(req, *error(500, "KV transfer timed out"), drained=False)
        for rid, req in list(self.held.items()):
            if now - req.held_since > self.cfg.kv_hold_timeout:
                self.log.info("rid=%s hold timed out; pages released", rid)
                del self.held[rid]
                self._free_pages(req.pages)
                req.pages = []

    # -- the router's calls -------------------------------------------------------------------

    def wait(self, body: Body) -> tuple[int, Body]:
        rid = str(body["rid"])
        with self.cond:
            req = self.requests.get(rid)
        if req is None:
            return error(404, f"unknown request {rid}")
        req.done.wait(float(body.get("timeout", 3600)))
        with self.cond:
            if not req.done.is_set():
                return error(504, "decode did not finish in time")
            self.requests.pop(rid, None)
        return req.status, req.reply

    def abort(self, body: Body) -> tuple[int, Body]:
        """The router drops the decode half of a request whose prefill failed."""
        rid = str(body["rid"])
        with self.cond:
            req = self.requests.pop(rid, None)
            if req is not None and not req.done.is_set():
                self._fail(req, *error(499, "aborted by router"), drained=bool(body.get("drained")))
        return 200, {}

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        if self.watch is not None:
            self.watch.close()


def ticket_tags(ticket: Ticket | None) -> list[int]:
    """The generations a writer must tag the pages with (they travel to prefill)."""
    if ticket is None:
        return []
    tags = ticket.tags
    return [int(t) for t in (tags.tolist() if isinstance(tags, torch.Tensor) else tags)]


def main(
    cfg: ServeConfig,
    buffers: list[torch.Tensor],
    tags: torch.Tensor,
    owners: torch.Tensor,
    ready: Queue[tuple[str, int]],
    parent_pid: int,
) -> None:
    def started(logger: logging.Logger) -> DecodeWorker:
        worker = DecodeWorker(cfg, buffers, tags, logger, owners)
        worker.start()
        return worker

    process.serve("decode", cfg.decode_port, cfg.log_dir, ready, parent_pid, started)
