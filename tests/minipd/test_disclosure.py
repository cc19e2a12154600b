"""The disclosure list against ground truth, over randomised engine histories.

Each history runs minipd's prefill and decode workers in one process (tests/minipd/inprocess.py):
requests of any length (partial last pages, over-length prompts that prefill cuts to a
placeholder), aborts with prefill's write still in flight, late writes landing in freed or
reused pages, decode steps interleaved with all of it, on every release, with scrub off,
on_free and on_reserve. What kvwatch's hooks spooled is then held to minipd's own record of who
wrote each slot (``PageOwners``), taken as each decode step reads:

- every reader named (an event with sources: what ``kvwatch incidents --exposed`` lists) really
  read another request's KV;
- every source named had its KV read by that reader, in no more pages than the reader read of
  it;
- so no request that overwrote a page before reading it is named;
- in enforce mode, a request failed by a check ahead of its read is still an incident but no
  reader: its events say ``detail.stopped_before_read`` (and it read nothing), ``--exposed``
  and ``kvwatch_exposed_requests_total`` leave it out.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine_hooks.testing import read_spool
from kvspool import Source
from kvspool.records import stopped_before_read
from kvwatch.commands.incidents import exposure
from kvwatch.ingest.spool.reader import SpoolReader
from kvwatch.store.incident import Finding, counts, group
from kvwatch.store.journal import Journal
from minipd.releases import RELEASES
from tests.minipd.inprocess import Engine, Reads

#: Enough for make test (at least 2,000 histories), derandomised: the same histories every run.
#: A small decode pool, so that freed pages come round again within a history (the free list
#: is FIFO): late writes land in reused pages, over-length prompts read others' pages.
DECODE_PAGES = 12
HISTORIES = int(os.environ.get("KVWATCH_DISCLOSURE_HISTORIES", "2000"))
#: Enforce-mode histories shaped to stop requests before they read (400 by default, ~15 s).
STOPPING_HISTORIES = max(1, HISTORIES // 5)

_submit = st.tuples(
    st.just("submit"),
    # Tokens: short ones (partial pages, a pool page left partly written), any, and over
    # prefill's 31-token limit (a one-token placeholder read as the whole prompt).
    st.one_of(st.integers(1, 6), st.integers(1, 44), st.integers(32, 44)),
    st.integers(1, 6),
    st.booleans(),  # prefill's write delayed
)
_which = st.integers(0, 15)
#: Steps as often as the rest together: requests finish and free their pages for the next ones.
_op = st.sampled_from(["submit", "step", "step", "step", "abort", "land"]).flatmap(
    lambda op: (
        _submit
        if op == "submit"
        else st.tuples(st.just(op))
        if op == "step"
        else st.tuples(st.just(op), _which)
    )
)


@dataclass(frozen=True)
class History:
    version: str
    scrub: str
    deferred_release: bool | None
    ops: list[tuple[Any, ...]]
    #: Start with every decode page written by earlier requests (else some never are).
    warm: bool = False
    #: The detectors' mode: in enforce mode a finding fails its request.
    mode: str = "log"


histories = st.builds(
    History,
    # The releases that admit an over-length prompt's placeholder, and no scrub, drawn more
    # often: they are where other requests' KV is read.
    st.sampled_from(["0.5.19", "0.5.19", "0.5.20", *sorted(RELEASES)]),
    st.sampled_from(["off", "off", "on_free", "on_reserve"]),
    st.sampled_from([None, False]),
    st.lists(_op, min_size=8, max_size=40),
    st.booleans(),
    st.sampled_from(["log", "enforce"]),
)


#: Enforce mode, shaped so that a late write lands in a page after its reuse (about one history
#: in ten): short requests, a late write now and then, aborts of the newest request, no explicit
#: landing (the drain at the end lands it), nothing holding freed pages. The next owner's check
#: fails at admission or before a step, and enforce stops it before it reads.
_stopping_op = st.sampled_from(["submit", "submit", "submit", "step", "abort"]).flatmap(
    lambda op: (
        st.tuples(
            st.just(op), st.integers(1, 6), st.integers(1, 2), st.sampled_from([True, *[False] * 5])
        )
        if op == "submit"
        else st.tuples(st.just(op))
        if op == "step"
        else st.tuples(st.just(op), st.one_of(st.just(-1), _which))
    )
)
stopping_histories = st.builds(
    History,
    st.sampled_from(sorted(RELEASES)),
    st.sampled_from(["off", "off", "on_free", "on_reserve"]),
    st.just(False),
    st.lists(_stopping_op, min_size=8, max_size=30),
    st.booleans(),
    st.just("enforce"),
)


#: A placeholder's last page whose tail nobody wrote (zeros): that residue is nobody's.
ZERO_TAIL = History(
    "0.5.19",
    "off",
    None,
    [("submit", 1, 1, False), ("submit", 25, 1, False), ("submit", 32, 1, False)],
)
#: A late write into a freed page that the page's next owner overwrites before it reads.
LATE_WRITE = History(
    "0.5.19",
    "off",
    None,
    [("submit", 8, 2, True), ("abort", 0), ("land", 0), *[("submit", 28, 1, False), ("step",)] * 3,
     ("submit", 8, 2, False)],
)  # fmt: skip
#: A late write (r3's, aborted) landing in a page after its reuse: the next owner's admission
#: check fails (stale tag, naming r3 as whose KV the page holds) and enforce mode stops it
#: before it reads. It is an incident, but no reader.
STOPPED = History(
    "0.5.19",
    "off",
    None,
    [("submit", 1, 1, False), ("submit", 1, 1, False), ("submit", 1, 1, True),
     ("submit", 5, 1, False), ("abort", 2), *[("submit", 1, 1, False)] * 8],
    mode="enforce",
)  # fmt: skip


def run(history: History, spool: Path) -> tuple[list[dict[str, Any]], dict[str, Reads]]:
    engine = Engine.start(
        spool,
        version=history.version,
        scrub=history.scrub,
        deferred_release=history.deferred_release,
        decode_pages=DECODE_PAGES,
        mode=history.mode,
    )
    submitted: list[str] = []
    try:
        for _ in range(history.warm * DECODE_PAGES // 4):
            engine.submit(4 * engine.cfg.page_size - 1, 2)
            engine.drain()
        for op in history.ops:
            if op[0] == "submit":
                rid = engine.submit(op[1], op[2], late=op[3])
                if rid is not None:
                    submitted.append(rid)
            elif op[0] == "step":
                engine.step()
            elif submitted:
                rid = submitted[op[1] % len(submitted)]
                engine.abort(rid) if op[0] == "abort" else engine.land(rid)
        engine.drain()
    finally:
        engine.close()
    return read_spool(spool).events(), engine.reads


def check(events: list[dict[str, Any]], reads: dict[str, Reads]) -> None:
    for event in events:
        named = event.get("sources") or []
        reader = event["request_id"]
        truth = reads.get(reader, {})
        if stopped_before_read(event.get("detail")):
            assert event["action"] == "enforced" or any(
                e["action"] == "enforced" and e["request_id"] == reader for e in events
            ), f"{event} says stopped, but nothing stopped {reader}"
            assert not truth, f"{event} says {reader} was stopped before it read; it read {truth}"
            continue
        if not named and not event.get("other_sources"):
            continue
        what = f"{event['detector']}/{event['kind']} names {reader} as a reader of {named}"
        assert truth, f"{what}, but it read nobody's KV"
        assert not event.get("other_sources"), what  # a handful of requests: all named
        for source in named:
            rid = source["request_id"]
            assert rid in truth, f"{what}; it never read {rid}'s KV (it read {truth})"
            assert source["pages"] <= truth[rid][0], f"{what}; it read {truth[rid]} of {rid}"


def view_rows(events: list[dict[str, Any]]) -> list[Finding]:
    """The events as the journal's findings (what ``group`` and ``exposure`` read)."""
    return [
        Finding(
            id=i + 1,
            ts=float(i),
            node="n",
            producer="p",
            seq=i,
            role="decode",
            engine="minipd",
            engine_version="",
            model="",
            rank=0,
            request_id=e["request_id"],
            instance=e.get("instance"),
            detector=e["detector"],
            kind=e["kind"],
            mode=e.get("mode", "log"),
            action=e["action"],
            pages=list(e.get("pages") or []),
            pages_total=e["pages_total"],
            sources=[Source(**s) for s in e.get("sources") or []],
            other_sources=e.get("other_sources") or 0,
            other_source_pages=e.get("other_source_pages") or 0,
            detail=e.get("detail") or {},
        )
        for i, e in enumerate(events)
    ]


def _settings(examples: int) -> Any:
    return settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


@_settings(HISTORIES)
@given(histories)
@example(ZERO_TAIL)
@example(LATE_WRITE)
@example(STOPPED)
def test_every_named_reader_and_source_is_true(history: History) -> None:
    holds_to_ground_truth(history)


@_settings(STOPPING_HISTORIES)
@given(stopping_histories)
def test_a_request_stopped_before_it_read_is_never_named(history: History) -> None:
    """Enforce mode where it stops requests before they read: each is an incident, never a
    reader (``--exposed``) nor counted exposed, and really read nothing."""
    holds_to_ground_truth(history)


def holds_to_ground_truth(history: History) -> None:
    with tempfile.TemporaryDirectory(prefix="kvwatch-disclosure-") as spool:
        events, reads = run(history, Path(spool))
    check(events, reads)
    incidents = group(view_rows(events))
    # Every affected request is an incident, a stopped one too (it still alarms).
    assert {e["request_id"] for e in events} == {i["request_id"] for i in incidents}
    view = exposure(incidents, since=None, until=None)
    for reader in view["readers"]:  # the disclosure team's list, as the daemon builds it
        truth = reads.get(reader["request_id"], {})
        assert truth, f"--exposed lists {reader['request_id']}, which read nobody's KV"
        for source in reader["sources"]:
            assert source["request_id"] in truth, (reader["request_id"], source, truth)
            assert source["pages"] <= truth[source["request_id"]][0], (reader, truth)


def test_exposed_skips_an_older_producers_write_to_free_page() -> None:
    """Before this kvwatch, the event named the page's next owner, with the late writer as a
    source: the disclosure view must not list that next owner as a reader."""
    legacy = {
        "request_id": "next-owner", "detector": "canary", "kind": "write_to_free_page",
        "action": "logged", "pages_total": 1,
        "sources": [{"request_id": "aborted-2", "pages": 1, "written_at": 0.0}],
    }  # fmt: skip
    assert exposure(group(view_rows([legacy])), since=None, until=None)["readers"] == []
    assert group(view_rows([legacy]))[0]["exposed"] == 0


def test_a_request_stopped_before_it_read_is_an_incident_but_no_reader() -> None:
    """The late write after reuse that enforce mode stops: the event names whose KV the page
    holds, but the request read nothing, and is listed as an incident only."""
    with tempfile.TemporaryDirectory(prefix="kvwatch-disclosure-") as spool:
        events, reads = run(STOPPED, Path(spool))
    stopped = [e for e in events if e["kind"] == "stale_tag"]
    assert stopped and all(e["action"] == "enforced" for e in stopped), events
    assert all(e["sources"] and stopped_before_read(e["detail"]) for e in stopped), stopped
    assert not reads.get(stopped[0]["request_id"]), reads
    incidents = group(view_rows(events))
    assert stopped[0]["request_id"] in {i["request_id"] for i in incidents}
    assert exposure(incidents, since=None, until=None)["readers"] == []
    assert counts(incidents)["exposed"] == 0


@settings(max_examples=60, derandomize=True, deadline=None, database=None)
@given(st.one_of(histories, stopping_histories))
@example(ZERO_TAIL)
@example(LATE_WRITE)
@example(STOPPED)
def test_the_daemons_exposed_view_is_true(history: History) -> None:
    """The same over fewer histories, through the daemon's own path: the spool read into a
    journal, ``kvwatch incidents --exposed``'s view built from its incidents."""
    with tempfile.TemporaryDirectory(prefix="kvwatch-disclosure-") as tmp:
        spool = Path(tmp) / "spool"
        events, reads = run(history, spool)
        journal = Journal(Path(tmp) / "journal.db")
        try:
            state = journal.load()
            reader = SpoolReader(spool, journal, state, quarantine_dir=Path(tmp) / "q")
            while reader.poll().more:
                pass
            rows = journal.incidents()
        finally:
            journal.close()
    assert len(rows) == len(events)
    view = exposure(group(rows), since=None, until=None)
    # kvwatch_exposed_requests_total counts what the view counts (a stopped request: nobody).
    counted = sum(v for (name, _), v in state.daemon.items() if name == "exposed_requests")
    assert counted == view["counts"]["exposed"], (counted, view["counts"])
    for named in view["readers"]:
        truth = reads.get(named["request_id"], {})
        assert truth, f"--exposed lists {named['request_id']}, which read nobody's KV"
        for source in named["sources"]:
            assert source["request_id"] in truth, (named["request_id"], source, truth)
            assert source["pages"] <= truth[source["request_id"]][0], (named, truth)
