"""Hooks on PD disaggregation: the two admission doors, decode's reserve, admit and steps.

- ``PrefillBootstrapQueue.add`` / ``DecodePreallocQueue.add`` (AROUND): an aborted request
  (``to_finish`` set, ``finished()`` False) that passes the door is recorded; in enforce mode,
  on a release that would admit it, it is retired at the door instead.
- ``DecodePreallocQueue._pre_alloc`` (AFTER): decode reserved the request's pages: stamp them
  with reserved canaries and keep a ticket (page ids and generations).
- ``process_prebuilt`` (BEFORE): decode admits: every reserved page must have been written and
  still carry the request's generation. Enforce mode fails the request (HTTP 500).
  (AFTER): the ticket follows the request's row. With the decode radix cache, the tree insert
  inside ``process_prebuilt`` frees a request's pages that duplicate cached ones and points its
  row at the cached pages; the ticket must name what the row reads, not the freed pages.
- ``process_batch_result_prebuilt`` (AFTER): a request finished at admission lets go of its
  ticket.
- ``Scheduler.process_batch_result`` (AFTER): per decode step, the running requests' pages
  still carry their generations; deferred device results are read here, where SGLang has
  already synchronised on the step's output.
- ``DecodeTransferQueue._do_release`` (BEFORE) and ``_observe_deferred_kv_release`` (AFTER):
  an aborted transfer's held pages go back, and SGLang's outcome for them; on a timeout, the
  requests that take them are named when ``resolve_deferred_releases`` (AFTER, every iteration
  of decode's loop) finds the window over (:mod:`engine_hooks.sglang.drain`).

Page tags are not carried over the transfer (SGLang's metadata has no field for them), so on
decode the tag check is generation-only: it catches a page reallocated under a live request.

Tickets and events are keyed by the request's instance (one ``Req`` object), not its id.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import torch

from engine_hooks import Mode, Verdict
from engine_hooks.labels import Detector, Hook, Skip
from engine_hooks.sglang.drain import DrainWatch
from engine_hooks.sglang.guard import failed, safe
from engine_hooks.sglang.report import log_verdicts
from engine_hooks.sglang.runtime import Held, runtime
from engine_hooks.watch import KVWatch, Ticket

logger = logging.getLogger("kvwatch.sglang")

ENFORCE_MESSAGE = "kvwatch: KV cache integrity check failed; request not served"


# -- admission ----------------------------------------------------------------------------------


def _abort_state(req: Any) -> tuple[bool, bool]:
    """(aborted, finished) for a request at a door. Aborted means ``to_finish`` is set on a
    request entering for the first time; a retracted or resumed one that still holds KV is
    released by its queue (SGLang's own ``is_unadmitted_reject`` where the release has it)."""
    finished = bool(req.finished())
    if getattr(req, "to_finish", None) is None:
        return False, finished
    utils = importlib.import_module("sglang.srt.disaggregation.utils")
    fresh = getattr(utils, "is_unadmitted_reject", None)
    if callable(fresh):
        return bool(fresh(req)), finished
    return not getattr(req, "is_retracted", False), finished


def _retire(queue: Any, req: Any) -> bool:
    """Retire an aborted request at the door of a release that would admit it: deliver the
    abort already in ``to_finish`` through the output path, as the fixed releases do."""
    scheduler = getattr(queue, "scheduler", None)
    stream = getattr(getattr(scheduler, "output_streamer", None), "stream_output", None)
    stream = stream or getattr(scheduler, "stream_output", None)
    if not callable(stream):
        return False
    req.finished_reason, req.to_finish = req.to_finish, None
    stream([req], req.return_logprob)
    return True


@dataclass(slots=True)
class _Door:
    """A request at an admission door, as seen before the queue's own ``add``."""

    watch: KVWatch | None  # None: nothing to record after the add
    aborted: bool = False
    finished: bool = False
    instance: str = ""
    retired: bool = False  # retired at the door: the queue's ``add`` is not called


def _admission(
    queue_name: str, reentry: bool, original: Any, queue: Any, req: Any, *a: Any, **k: Any
) -> Any:
    door = None if reentry else _enter(queue_name, queue, req)
    if door is not None and door.retired:
        return None
    result = original(queue, req, *a, **k)
    if door is not None and door.watch is not None:
        _entered(door, queue_name, req)
    return result


@safe(Hook.ADMISSION)
def _enter(queue_name: str, queue: Any, req: Any) -> _Door:
    rt = runtime()
    watch = rt.engine_watch()
    instance = rt.instance_of(req)
    aborted, finished = _abort_state(req)
    enforce = watch.modes[Detector.ADMISSION] is Mode.ENFORCE
    if aborted and not finished and enforce and not _fixed_release(queue):
        verdict = watch.on_admission(
            str(req.rid), queue_name, aborted=True, finished=False, instance=instance
        )
        log_verdicts([verdict])
        # Recorded once, here, whether or not the retire below works.
        return _Door(None, aborted, finished, instance, retired=_retire(queue, req))
    return _Door(watch, aborted, finished, instance)


@safe(Hook.ADMISSION)
def _entered(door: _Door, queue_name: str, req: Any) -> None:
    assert door.watch is not None
    admitted = not req.finished()
    verdict = door.watch.on_admission(
        str(req.rid),
        queue_name,
        aborted=door.aborted,
        finished=door.finished or not admitted,
        instance=door.instance,
    )
    log_verdicts([verdict])


def _fixed_release(queue: Any) -> bool:
    """v0.5.21+ retire an aborted request at both doors themselves."""
    scheduler = getattr(queue, "scheduler", None)
    return callable(getattr(scheduler, "retire_unadmitted_request", None))


def around_prefill_add(original: Any, queue: Any, req: Any, *a: Any, **k: Any) -> Any:
    return _admission("prefill_bootstrap", False, original, queue, req, *a, **k)


def around_decode_add(original: Any, queue: Any, req: Any, *a: Any, **k: Any) -> Any:
    # Re-entries (retraction, rebootstrap) hold resources their queue releases: not our door.
    reentry = bool(k.get("is_retracted") or k.get("is_rebootstrap") or any(a[:2]))
    return _admission("decode_prealloc", reentry, original, queue, req, *a, **k)


# -- decode: reserve, admit, step -----------------------------------------------------------------


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


def _fake_transfer(req: Any) -> bool:
    """Warm-up and health-check requests use SGLang's fake transfer: nothing writes their pages.
    When the release cannot tell us, the request is not verified (no false alarms)."""
    decode = importlib.import_module("sglang.srt.disaggregation.decode")
    try:
        for name in ("_is_fake_transfer", "is_health_check_req"):
            check = getattr(decode, name, None)
            if callable(check) and check(req):
                return True
    except Exception:
        return True
    return False


@safe(Hook.RESERVE)
def after_pre_alloc(result: Any, queue: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """Decode reserved pages for a request that prefill will write: stamp them, keep a ticket."""
    if result is None or getattr(getattr(queue, "scheduler", None), "enable_hisparse", False):
        return
    allocator = queue.token_to_kv_pool_allocator
    rt = runtime()
    watch = rt.watch_for(allocator)
    if watch is None or watch.pool is None:
        # An allocator kvwatch does not watch, or an unsupported pool layout: say so in coverage.
        coverage = watch or rt.engine_watch()
        for detector in (Detector.CANARY, Detector.PAGE_TAG):
            coverage.skip(detector, Skip.NO_POOL)
        return
    if _fake_transfer(req):
        return
    page_size = int(allocator.page_size)
    prefix = _arg(args, kwargs, 2, "total_prefix_len")
    if prefix is None:
        prefix = _arg(args, kwargs, 1, "prefix_len") or 0
    if int(prefix) % page_size:
        watch.skip(Detector.CANARY, Skip.UNSUPPORTED_LAYOUT)
        return
    pages = result[::page_size] // page_size
    ticket = watch.on_reserve(str(req.rid), pages, rt.instance_of(req))
    if ticket is None:
        return
    rt.drain.took(watch, ticket.request_id, ticket.instance, pages)
    # Tags do not travel with SGLang's transfer: the write is recorded at admission
    # (KVWatch.landed), for the pages the transfer really wrote.
    rt.keep_ticket(watch, ticket, int(prefix))


def decode_pages(batch: Any, tickets: dict[int, Held], drain: DrainWatch) -> None:
    """Pages a decode step started (its token is the first of a page, in a page
    ``alloc_decode`` took) join their request's ticket, as written by it: the step checks
    cover them, and a later reader of the page is exposed to this request's KV. Reads the
    batch's host-side lengths; the page ids stay where they are (no sync). One
    :meth:`~KVWatch.extend_each` per pool: at page size 1 every request starts a page every
    step."""
    lengths = getattr(batch, "seq_lens_cpu", None)
    slots = getattr(batch, "out_cache_loc", None)
    if lengths is None or slots is None or not tickets:
        return
    started: dict[int, tuple[KVWatch, list[int], list[Ticket]]] = {}
    count = slots.numel()
    for i, length in enumerate(lengths.tolist()):
        held = tickets.get(i)
        if held is None or held.watch.pool is None or i >= count:
            continue
        if (length - 1) % held.watch.pool.page_size == 0:
            entry = started.setdefault(id(held.watch), (held.watch, [], []))
            entry[1].append(i)
            entry[2].append(held.ticket)
    for watch, rows, owners in started.values():
        assert watch.pool is not None
        # Views of the slots where it can (a run of rows, as at page size 1), else one cat:
        # never an index built on the host and copied to the device (that would sync).
        if rows[-1] - rows[0] == len(rows) - 1:
            taken = slots[rows[0] : rows[-1] + 1]
        else:
            taken = torch.cat([slots[i : i + 1] for i in rows])
        pages = taken // watch.pool.page_size
        watch.extend_each(owners, pages)
        if drain.watching:  # a timed-out release's pages: are these among them?
            for k, ticket in enumerate(owners):
                drain.took(watch, ticket.request_id, ticket.instance, pages[k : k + 1])


def _enforce(req: Any, verdicts: list[Verdict]) -> None:
    if any(v.blocks for v in verdicts):
        _fail(req)


def _fail(req: Any) -> None:
    finish_abort = importlib.import_module("sglang.srt.managers.schedule_batch").FINISH_ABORT
    # As SGLang's own grammar failure in process_prebuilt: the batch result path releases it.
    req.to_finish = finish_abort(
        ENFORCE_MESSAGE, HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError"
    )


@safe(Hook.VERIFY)
def before_process_prebuilt(batch: Any, *args: Any, **kwargs: Any) -> None:
    """Decode admits the transferred requests: verify their pages before anything reads them,
    then agree with the other TP ranks on which fail (consensus.py): each rank's checks are
    guarded one by one, so the collective runs on every rank whatever they did."""
    rt = runtime()
    reqs = list(batch.reqs)
    failed = [_verify_admitted(rt, req) for req in reqs]
    if not rt.consensus.active or not rt.settings.enforcing:
        return
    for req, mine, anyone in zip(reqs, failed, rt.consensus.agree(failed), strict=True):
        if anyone and not mine:
            _fail(req)  # another rank's shard failed its check: the request fails here too


def _verify_admitted(rt: Any, req: Any) -> bool:
    """Verify one admitted request on this rank; whether enforce fails it. Never raises: a
    failure is a counted hook error (the batch's collective must still run)."""
    try:
        held = rt.ticket(req)
        if held is None:
            return False
        watch, ticket = held.watch, held.ticket
        # The transfer completed: record which pages it wrote (the last writer of a page it
        # did not write stays that page's source).
        watch.landed(ticket)
        pool = watch.pool
        on_device = pool is not None and not pool.is_cpu
        deferrable = held.seal is None and held.skip is None  # a seal is read where verified
        if deferrable and on_device and all(m is not Mode.ENFORCE for m in watch.modes.values()):
            watch.verify_later(ticket)
            return False
        verdicts = watch.verify_admit(ticket, held.seal, skip=held.skip)
        log_verdicts(verdicts)
        _enforce(req, verdicts)
        return any(v.blocks for v in verdicts)
    except Exception as error:
        failed(Hook.VERIFY, _verify_admitted, (), error)
        return False


def _follow_row(held: Held, row: Any) -> None:
    """Point the ticket at the pages the request's row reads now (:meth:`KVWatch.follow`)."""
    watch, ticket = held.watch, held.ticket
    pool = watch.pool
    if pool is None or not ticket.page_count:
        return
    page_size = pool.page_size
    tokens = row[held.start : held.start + ticket.page_count * page_size : page_size]
    if tokens.numel() != ticket.page_count:
        return
    watch.follow(ticket, tokens // page_size)


@safe(Hook.VERIFY)
def after_process_prebuilt(result: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """After admission: each ticket follows its request's row (see the module docstring)."""
    rt = runtime()
    if not rt.tickets:
        return
    rows = batch.req_to_token_pool.req_to_token
    for req in list(batch.reqs):
        held = rt.ticket(req)
        index = getattr(getattr(req, "kv", None), "req_pool_idx", None)
        if held is not None and index is not None:
            _follow_row(held, rows[index])


def check_steps(batch: Any) -> None:
    """Per decode step: the pages the step started join their tickets; the running requests'
    pages still carry their generations (one vectorised compare per pool; on a device, read at
    the next ``resolve()``)."""
    rt = runtime()
    reqs = list(batch.reqs)
    held_at = {i: h for i, h in enumerate(rt.ticket(r) for r in reqs) if h is not None}
    decode_pages(batch, held_at, rt.drain)
    batches: dict[int, tuple[KVWatch, list[Ticket]]] = {}
    by_instance: dict[str, Any] = {}
    for i, req in enumerate(reqs):
        if req.finished():
            rt.drop_ticket(req)
            continue
        held = held_at.get(i)
        if held is not None:
            batches.setdefault(id(held.watch), (held.watch, []))[1].append(held.ticket)
            by_instance[held.ticket.instance] = req
    for watch, tickets in batches.values():
        verdicts = watch.check_batch(tickets)
        log_verdicts(verdicts)
        for verdict in verdicts:  # enforce: SGLang finishes it at its next result (HTTP 500)
            req = by_instance.get(verdict.instance)
            if req is not None:
                _enforce(req, [verdict])


@safe(Hook.STEP)
def after_prebuilt_result(result: Any, processor: Any, batch: Any, *a: Any, **k: Any) -> None:
    """Admission's results: a request finished there (one output token, failed in enforce
    mode) never reaches a decode step; its ticket goes with it."""
    rt = runtime()
    if rt.tickets:
        for req in batch.reqs:
            if req.finished():
                rt.drop_ticket(req)


@safe(Hook.STEP)
def after_process_batch_result(result: Any, scheduler: Any, batch: Any, *a: Any, **k: Any) -> None:
    rt = runtime()
    mode = getattr(batch, "forward_mode", None)
    is_decode = getattr(mode, "is_decode", None)
    if rt.settings.step_check and rt.tickets and callable(is_decode) and is_decode():
        check_steps(batch)
    for watch in list(rt.all_watches):
        log_verdicts(watch.resolve())


# -- decode: an aborted transfer's deferred release ----------------------------------------------


@safe(Hook.FREE)
def before_do_release(queue: Any, decode_req: Any, *args: Any, **kwargs: Any) -> None:
    """``DecodeTransferQueue._do_release``: a held request's pages go back (its outcome comes
    next, :func:`after_observe_release`); its ticket goes with them."""
    rt = runtime()
    req = getattr(decode_req, "req", None)
    held = rt.ticket(req) if req is not None else None
    rt.drain.releasing(*((held.watch, held.ticket) if held is not None else (None, None)))
    if held is not None:
        rt.drop_ticket(req)


@safe(Hook.STEP)
def after_resolve_releases(result: Any, queue: Any, *args: Any, **kwargs: Any) -> None:
    """``resolve_deferred_releases``, every iteration of decode's loop (idle too): the windows
    that are ``KVWATCH_FREED_WATCH_S`` old close, and their findings are written."""
    log_verdicts(runtime().drain.step())


@safe(Hook.FREE)
def after_observe_release(result: Any, queue: Any, *args: Any, **kwargs: Any) -> None:
    """``_observe_deferred_kv_release(duration_seconds, outcome)``: SGLang's outcome of the
    release just done; a "timeout" starts watching its pages (:mod:`engine_hooks.sglang.drain`)."""
    outcome = _arg(args, kwargs, 1, "outcome")
    runtime().drain.outcome(str(outcome))
