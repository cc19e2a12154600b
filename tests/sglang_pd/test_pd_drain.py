"""An aborted transfer that SGLang's decode releases on its timeout, in real servers.

The Mooncake bed's prefill at page size 16 and its drain decode beside the bed's own
(``bed.drain_decode``: kvwatch in ``log`` mode on both), decode's pool 64 pages so that freed
pages are reused at once, SGLang's deferred-release timeout
(``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``) at ``DRAIN_RELEASE_TIMEOUT_S`` and
kvwatch's window (``KVWATCH_FREED_WATCH_S``) at ``DRAIN_WINDOW_S`` (``bed.py``).

**How the transfer fails, and why it is real.** The prefill server's scheduler process (where
its Mooncake transfer engine and its bootstrap thread run) is stopped with SIGSTOP: a prefill
that stalls (a long pause, a starved or swapped process, a partition on its rank port). A
request is sent to prefill and decode as a PD router sends it. Decode, whose bootstrap info and
connection to prefill are cached, reserves the request's pages, publishes them to prefill
(``DecodePreallocQueue`` ``_pre_alloc`` then ``send_metadata``, ``disaggregation/decode.py``
1611 and 1863): from then on prefill may write into them at any time. Decode then aborts the
request (``POST /abort_request``, what a client that goes away also causes):
``Scheduler.abort_request`` calls ``kv_receiver.abort()`` for a request in the transfer queue
(``managers/scheduler.py`` 5770-5780), which marks the room Failed and sends prefill the ABORT
with a fresh drain generation (``common/conn.py`` 2955-2998). ``pop_transferred`` sees
``KVPoll.Failed`` and, since the ABORT went out, holds the pages (``decode.py`` 2861-2966,
``_defer_release`` 2996) until prefill acknowledges that its writes into them have stopped.
Prefill acknowledges only once its transfer for that room has drained (``ABORT_ACK`` from
``_maybe_ack_drained_abort``, ``common/conn.py`` 1044, called from its bootstrap thread and
transfer workers, ``mooncake/conn.py`` 2561, 2849, 2914); a stopped prefill sends nothing, so
``resolve_deferred_releases`` releases the pages at the deadline (``decode.py`` 3046-3108:
"timed out ... releasing anyway", outcome "timeout"). Only then is prefill continued: its late
ACK finds no armed room on decode (``clear_deferred_abort_state`` ran at the release,
``note_abort_ack`` keeps nothing). Prefill had not run the request's forward when it was
stopped, so here no byte of it reaches decode late (prefill fails the request when it goes on):
what is real is decode's side, which cannot know that and releases blind at the deadline, as it
does for a prefill whose write is still in flight. The control is the same abort with prefill
continued as soon as decode holds the pages: prefill's ACK comes within the timeout and
SGLang's outcome is "drained".

Then requests (:data:`TAKER_WORDS` words: more pages than the pool has besides the freed
ones, so they must take some of them) go through the pool. Ground truth is SGLang's own: the
reserved rows (``_pre_alloc``'s result), the release and its outcome (``drain_rows``), each batch's
rows (``page_owners``), written in the order decode's scheduler did them; never kvwatch's
bookkeeping. On "timeout": one ``page_tag``/``freed_before_drain`` finding per request that took
the freed pages in the window, naming the aborted request (its rid) as its source, and none for
one that did not; on "drained": none though the pages are taken; clean requests: none.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from engine_hooks.testing import SpoolContents, read_spool
from tests.sglang_pd.bed import (
    DRAIN_POOL_TOKENS,
    DRAIN_RELEASE_TIMEOUT_S,
    DRAIN_TRANSPORT,
    DRAIN_WINDOW_S,
    PAGE_SIZE,
    Bed,
    Prefill,
    Process,
    Reply,
    generate_body,
    post,
    with_room,
)

#: The Mooncake bed only (conftest.py): the drain decode is beside its own.
pytestmark = pytest.mark.parametrize("bed", [DRAIN_TRANSPORT], indirect=True)
MAX_TOKENS = 8
ABORTED_WORDS = 135  # about 330 tokens: 21 pages
# About 795 tokens: 50 pages, more than the 43 the pool has besides the aborted request's, so a
# taker gets some of them whatever else the free list holds (SGLang's decode allocator hands out
# its sorted free pages first and merges freed ones in only when those run short).
TAKER_WORDS = 325
SMALL_WORDS = 2  # one page, prompt and output: a request in the window that need not take them
WAIT_S = 30.0
SGLANG_TIMED_OUT = "Deferred KV release for room {room} timed out"
SGLANG_HELD = "Decode transfer failed for request rank=0 decode_req.req.rid='{rid}'"

TEXT = (
    "a request aborted while prefill writes its pages is held on decode until prefill says its "
    "writes stopped or the deadline passes and the pages go back to the pool for the next"
)


def words(seed: int, count: int) -> str:
    vocabulary = TEXT.split()
    return " ".join(vocabulary[(seed * 5 + i * 7) % len(vocabulary)] for i in range(count))


@dataclass
class Drain:
    prefill: Prefill
    decode: Process
    #: Prefill's scheduler process: its transfer engine, bootstrap thread and forward.
    scheduler: psutil.Process
    pool: ThreadPoolExecutor
    spools: dict[str, Path]  # "prefill", "decode"

    @property
    def owners(self) -> Path:
        return Path(self.decode.env["KVWATCH_BED_OWNERS"])

    def lines(self) -> list[dict[str, Any]]:
        """SGLang's lines, in decode's order; a line still being written is left for later."""
        text = self.owners.read_text() if self.owners.exists() else ""
        return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]

    def spool(self, name: str) -> SpoolContents:
        return read_spool(self.spools[name])

    def body(self, text: str, rid: str) -> dict[str, Any]:
        return with_room(generate_body(text, MAX_TOKENS, rid), self.prefill.bootstrap)

    def pd(self, text: str, rid: str) -> tuple[Reply, float]:
        """One PD request as the router sends it; decode's reply and when it came."""
        body = self.body(text, rid)
        first = self.pool.submit(post, self.prefill.server.url, body)
        served = post(self.decode.url, body)
        first.result()
        return served, time.time()


def wait_until(check: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.1)


def scheduler_of(server: Process) -> psutil.Process:
    """The server's scheduler process (SGLang titles it ``sglang::scheduler``)."""
    assert server.proc is not None
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        if " ".join(child.cmdline()).startswith("sglang::scheduler"):
            return child
    raise AssertionError(f"{server.name}: no sglang::scheduler process")


@pytest.fixture(scope="module")
def drain(bed: Bed) -> Iterator[Drain]:
    assert bed.drain is not None, f"no drain decode in the {bed.transport} bed"
    prefill = bed.prefills[PAGE_SIZE]
    spools = {"prefill": bed.spools[prefill.server.name], "decode": bed.drain.spool}
    with ExitStack() as stack:
        pool = stack.enter_context(ThreadPoolExecutor(4))
        scheduler = scheduler_of(prefill.server)
        # Before the pool waits for prefill's replies, and before the bed goes on.
        stack.callback(lambda: scheduler.is_running() and scheduler.resume())
        yield Drain(prefill, bed.drain, scheduler, pool, spools)


def describe(found: list[dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    return [(e["detector"], e["kind"], e["action"], e["request_id"]) for e in found]


def counter(spool: SpoolContents, name: str) -> float:
    return sum(spool.latest_counters().get(name, {}).values())


@dataclass
class Aborted:
    rid: str
    room: int
    at_prefill: Future[Reply]
    served: Reply


def abort_while_prefill_stalls(drain: Drain, rid: str, seed: int) -> Aborted:
    """Prefill's scheduler stopped; the request sent to both; decode reserves its pages and
    publishes them to prefill, then aborts it: SGLang holds the pages. Prefill stays stopped."""
    body = drain.body(words(seed, ABORTED_WORDS), rid)
    drain.scheduler.suspend()  # SIGSTOP
    try:
        at_prefill = drain.pool.submit(post, drain.prefill.server.url, body)
        at_decode = drain.pool.submit(post, drain.decode.url, body)
        wait_until(lambda: reserved(drain, rid), f"decode reserved {rid}'s pages")
        asked = requests.post(drain.decode.url + "/abort_request", json={"rid": rid}, timeout=10)
        assert asked.status_code == 200, asked.text
        served = at_decode.result(timeout=WAIT_S)
        # SGLang's own line: the transfer failed ("Aborted by AbortReq.") and its pages are held.
        wait_until(lambda: SGLANG_HELD.format(rid=rid) in drain.decode.text(), f"{rid} held")
        assert served.status != 200, served  # the client got the abort
        assert drain.scheduler.status() == psutil.STATUS_STOPPED  # prefill sent no ACK
    except BaseException:
        drain.scheduler.resume()
        raise
    return Aborted(rid, int(body["bootstrap_room"]), at_prefill, served)


def reserved(drain: Drain, rid: str) -> set[int]:
    rows = [line for line in drain.lines() if line["rid"] == rid and line.get("reserved")]
    return set(rows[0]["pages"]) if rows else set()


def outcome(drain: Drain, rid: str) -> str | None:
    said = [line["outcome"] for line in drain.lines() if line["rid"] == rid and "outcome" in line]
    return said[0] if said else None


def released_at(drain: Drain, rid: str) -> float:
    return next(line["at"] for line in drain.lines() if line["rid"] == rid and "released" in line)


def takers(drain: Drain, rid: str) -> dict[str, set[int]]:
    """Ground truth: every other request whose reserved or running row held one of ``rid``'s
    pages after SGLang released them, and which of them (SGLang's rows, in the order decode's
    scheduler wrote them)."""
    lines = drain.lines()
    freed = reserved(drain, rid)
    start = next(i for i, line in enumerate(lines) if line["rid"] == rid and "released" in line)
    got: dict[str, set[int]] = {}
    for line in lines[start + 1 :]:
        hit = freed & set(line["pages"])
        if line["rid"] != rid and hit:
            got.setdefault(line["rid"], set()).update(hit)
    return got


def through_the_pool(drain: Drain, name: str, seed: int) -> dict[str, float]:
    """A one-page request, then two that need more pages than the pool has besides the freed
    ones (one at a time: each alone must take some). Their rids and when decode answered."""
    done: dict[str, float] = {}
    plan = [(f"{name}-small", words(seed, SMALL_WORDS))]
    plan += [(f"{name}-taker-{i}", words(seed + 1 + i, TAKER_WORDS)) for i in range(2)]
    for rid, text in plan:
        served, at = drain.pd(text, rid)
        assert served.status == 200, f"{rid}: {served.body}"
        done[rid] = at
    return done


def test_clean_requests_give_no_finding(drain: Drain) -> None:
    for i, count in enumerate((6, 40, 120)):
        served, _ = drain.pd(words(i, count), f"clean-{i}")
        assert served.status == 200, served.body
    # kvwatch loaded in both schedulers, and nothing found.
    for name in ("prefill", "decode"):
        spool = drain.spool(name)
        assert any(r.get("type") == "hello" for r in spool.records), name
        assert describe(spool.events()) == [], name
    assert "kvwatch: SGLang 0.5.23 plugin loaded, mode=" in drain.decode.text()
    assert f"max_total_num_tokens={DRAIN_POOL_TOKENS}" in drain.decode.text()  # 64 pages


def test_a_drained_release_gives_no_finding_though_its_pages_are_taken(drain: Drain) -> None:
    aborted = abort_while_prefill_stalls(drain, "drain-control", seed=10)
    drain.scheduler.resume()  # prefill goes on in time: it acknowledges the drain
    assert wait_until(lambda: outcome(drain, aborted.rid), "SGLang's outcome") == "drained"
    assert SGLANG_TIMED_OUT.format(room=aborted.room) not in drain.decode.text()
    assert aborted.at_prefill.result(timeout=WAIT_S).status != 200  # prefill failed it too
    through_the_pool(drain, "after-drained", seed=11)
    got = takers(drain, aborted.rid)
    assert got, "the freed pages were taken"
    # A window opened here would close during the next test, which finds nothing of it.
    time.sleep(2.0)  # one spool flush
    for name in ("prefill", "decode"):
        assert describe(drain.spool(name).events()) == [], name


def test_a_timed_out_release_names_each_request_that_took_its_pages(drain: Drain) -> None:
    aborted = abort_while_prefill_stalls(drain, "drain-timeout", seed=20)
    try:
        wait_until(
            lambda: SGLANG_TIMED_OUT.format(room=aborted.room) in drain.decode.text(),
            "SGLang's own timeout warning",
            DRAIN_RELEASE_TIMEOUT_S + WAIT_S,
        )
        assert "releasing anyway" in drain.decode.text()
        assert wait_until(lambda: outcome(drain, aborted.rid), "SGLang's outcome") == "timeout"
    finally:
        drain.scheduler.resume()  # prefill goes on only now: its ACK comes too late
    assert aborted.at_prefill.result(timeout=WAIT_S).status != 200
    freed = reserved(drain, aborted.rid)
    since = released_at(drain, aborted.rid)
    answered = through_the_pool(drain, "after-timeout", seed=21)
    # Every request in the window was done with its pages inside it (decode answered).
    assert max(answered.values()) < since + DRAIN_WINDOW_S, (answered, since)
    got = takers(drain, aborted.rid)
    assert got, "the freed pages were taken"
    assert set(answered) - set(got), "a request in the window that took none of them"

    def found() -> list[dict[str, Any]]:
        return drain.spool("decode").events(kind="freed_before_drain")

    wait_until(lambda: len(found()) >= len(got), "the findings", DRAIN_WINDOW_S + WAIT_S)
    time.sleep(2.0)  # one more flush: nothing else comes
    events = found()
    assert sorted(e["request_id"] for e in events) == sorted(got), (events, got)
    for event in events:
        assert (event["detector"], event["action"]) == ("page_tag", "logged"), event
        assert set(event["pages"]) == got[event["request_id"]], event
        assert [s["request_id"] for s in event["sources"]] == [aborted.rid], event
        assert event["sources"][0]["pages"] == len(got[event["request_id"]]), event
        assert event["detail"]["freed_pages"] == len(freed), event
    # Nothing else on either server: the takers' own transfers verified clean.
    assert len(drain.spool("decode").events()) == len(events)
    assert describe(drain.spool("prefill").events()) == []
    for name in ("prefill", "decode"):
        assert counter(drain.spool(name), "hook_errors") == 0, name
    # Decode goes on serving; a request after the window is no taker.
    served, _ = drain.pd(words(50, 40), "after-window")
    assert served.status == 200, served.body
    time.sleep(2.0)
    assert len(drain.spool("decode").events()) == len(events)
