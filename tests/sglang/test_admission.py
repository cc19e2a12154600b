"""A real Req, rejected with set_finish_with_abort, at the real admission doors: each release's own
``PrefillBootstrapQueue.add`` and ``DecodePreallocQueue.add`` bodies run (v0.5.19's unpatched ones
included), on the decode side inside the bed's real prealloc queue (see ``bed.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engine_hooks.sglang import compat
from tests.sglang import sgl
from tests.sglang.bed import Bed

FIXED = compat.version_tuple(compat.sglang_version()) >= (0, 5, 21)
QUEUES = ["prefill_bootstrap", "decode_prealloc"]


@pytest.fixture
def bed(sglang_plugins: Any) -> Iterator[Bed]:
    with Bed(page_size=16, radix=False) as b:
        yield b


def rejected(bed: Bed, rid: str) -> Any:
    req = bed.request(rid, list(range(1, 33)))
    req.set_finish_with_abort("input too long for the KV pool")
    assert req.to_finish is not None and not req.finished()  # the incident's state
    return req


def prefill_door(bed: Bed) -> Any:
    """SGLang's prefill door. Its constructor needs a model runner and a transfer backend, so
    the queue is built bare: its scheduler is the bed's, and this one queue's ``create_sender``
    (the transport) only says yes; ``add`` itself is the release's."""
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

    queue = PrefillBootstrapQueue.__new__(PrefillBootstrapQueue)
    queue.scheduler = bed.scheduler
    queue.queue = []
    queue.create_sender = lambda req, num_kv_heads: True
    return queue


def enter(bed: Bed, name: str, req: Any) -> bool:
    """The request at the door ``name``; True when the queue took it."""
    if name == "decode_prealloc":
        return bed.arrive(req)
    queue = prefill_door(bed)
    queue.add(req, 8)  # num_kv_heads
    return req in queue.queue


@pytest.mark.parametrize("name", QUEUES)
def test_a_clean_request_passes_both_doors(kv: Any, bed: Bed, name: str) -> None:
    assert enter(bed, name, bed.request("clean-1", list(range(1, 33))))
    contents = sgl.spool(kv)
    assert contents.events() == []
    assert sgl.counter(contents, "verifications", detector="admission") == 1


@pytest.mark.skipif(not FIXED, reason="this release admits aborted requests: see the next tests")
@pytest.mark.parametrize("name", QUEUES)
@pytest.mark.parametrize("mode", ["log", "enforce"])
def test_fixed_release_retires_it_and_kvwatch_stays_silent(
    request: pytest.FixtureRequest, bed: Bed, name: str, mode: str
) -> None:
    rt = request.getfixturevalue("kv" if mode == "log" else "kv_enforce")
    req = rejected(bed, f"rejected-{name}")
    assert not enter(bed, name, req)
    assert req.finished() and bed.streamer.finished == [req]  # SGLang's door retired it
    contents = sgl.spool(rt)
    assert contents.events() == []
    assert sgl.counter(contents, "verifications", detector="admission") == 1
    assert sgl.counter(contents, "aborted_admissions", queue=name) == 0


@pytest.mark.skipif(FIXED, reason="this release retires aborted requests at both doors")
@pytest.mark.parametrize("name", QUEUES)
def test_unfixed_release_admits_it_and_kvwatch_records_it(kv: Any, bed: Bed, name: str) -> None:
    """The incident: v0.5.19's doors admit a rejected request (they check nothing; the decode
    door's own capacity check passes the one-token stub), and kvwatch records it."""
    req = rejected(bed, f"rejected-{name}")
    assert enter(bed, name, req)  # admitted: the bug
    contents = sgl.spool(kv)
    events = contents.events(detector="admission", kind="aborted_admitted")
    assert [(e["request_id"], e["action"]) for e in events] == [(req.rid, "logged")]
    assert sgl.counter(contents, "aborted_admissions", queue=name) == 1


@pytest.mark.skipif(FIXED, reason="this release retires aborted requests at both doors")
@pytest.mark.parametrize("name", QUEUES)
def test_unfixed_release_enforce_retires_it_at_the_door(
    kv_enforce: Any, bed: Bed, name: str
) -> None:
    req = rejected(bed, f"rejected-{name}")
    assert not enter(bed, name, req)  # retired before the release's own add runs
    assert req.finished() and bed.streamer.finished == [req]
    events = sgl.spool(kv_enforce).events(detector="admission", kind="aborted_admitted")
    assert [e["action"] for e in events] == ["enforced"]


@pytest.mark.skipif(FIXED, reason="this release retires aborted requests at both doors")
def test_a_reused_request_id_at_a_door_is_two_admissions(kv: Any, bed: Bed) -> None:
    for _ in range(2):
        enter(bed, "decode_prealloc", rejected(bed, "same-rid"))
    events = sgl.spool(kv).events(detector="admission")
    assert len(events) == 2 and len({e["instance"] for e in events}) == 2


def test_a_retracted_request_with_a_pending_abort_is_not_flagged(kv: Any, bed: Bed) -> None:
    """A preempted request re-enters the door holding resources its queue releases: SGLang
    admits it by design (is_unadmitted_reject), and kvwatch must not call that a leak."""
    req = rejected(bed, "retracted-7")
    req.is_retracted = True
    assert enter(bed, "prefill_bootstrap", req)
    contents = sgl.spool(kv)
    assert contents.events() == []
    assert sgl.counter(contents, "verifications", detector="admission") == 1
