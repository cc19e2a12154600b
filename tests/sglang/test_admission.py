"""A real Req, rejected with set_finish_with_abort, at the real admission doors."""

from __future__ import annotations

from typing import Any

import pytest

from engine_hooks.sglang import compat
from tests.sglang import sgl


class RetiringScheduler:
    """The one scheduler call the fixed doors make for a rejected request.

    A real ``Scheduler`` needs a model and a device; this stands in for its
    ``retire_unadmitted_request`` only, finishing the request as SGLang's does
    (``update_finish_state``) and remembering that it was asked to.
    """

    def __init__(self) -> None:
        self.retired: list[str] = []

    def retire_unadmitted_request(self, req: Any) -> None:
        self.retired.append(req.rid)
        req.update_finish_state()


def door(name: str) -> tuple[Any, Any]:
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

    cls = PrefillBootstrapQueue if name == "prefill_bootstrap" else DecodePreallocQueue
    queue = cls.__new__(cls)  # the constructor needs a model runner and a transfer backend
    queue.scheduler = RetiringScheduler()
    queue.queue = []

    def add(req: Any) -> Any:
        if name == "prefill_bootstrap":
            return queue.add(req, 8)  # num_kv_heads
        return queue.add(req)

    return queue, add


FIXED = compat.version_tuple(compat.sglang_version()) >= (0, 5, 21)


@pytest.mark.skipif(not FIXED, reason="this release admits aborted requests: see the next test")
@pytest.mark.parametrize("name", ["prefill_bootstrap", "decode_prealloc"])
@pytest.mark.parametrize("mode", ["log", "enforce"])
def test_fixed_release_retires_it_and_kvwatch_stays_silent(
    request: pytest.FixtureRequest, name: str, mode: str
) -> None:
    rt = request.getfixturevalue("kv" if mode == "log" else "kv_enforce")
    req = sgl.request(f"rejected-{name}", 32)
    req.set_finish_with_abort("input too long for the KV pool")
    assert req.to_finish is not None and not req.finished()  # the incident's state
    queue, add = door(name)
    add(req)
    assert queue.scheduler.retired == [req.rid]  # SGLang's own door retired it
    assert req.finished()
    contents = sgl.spool(rt)
    assert contents.events() == []
    assert sgl.counter(contents, "verifications", detector="admission") == 1
    assert sgl.counter(contents, "aborted_admissions", queue=name) == 0


@pytest.mark.skipif(FIXED, reason="this release retires aborted requests at both doors")
@pytest.mark.parametrize("name", ["prefill_bootstrap", "decode_prealloc"])
def test_unfixed_release_admits_it_and_kvwatch_records_or_retires(
    kv_enforce: Any, name: str
) -> None:
    class OldScheduler:
        """An older scheduler: no retire_unadmitted_request, only the output path."""

        def __init__(self) -> None:
            self.streamed: list[str] = []

        def stream_output(self, reqs: list[Any], return_logprob: bool) -> None:
            self.streamed.extend(r.rid for r in reqs)

    req = sgl.request(f"rejected-{name}", 32)
    req.set_finish_with_abort("input too long for the KV pool")
    queue, add = door(name)
    queue.scheduler = OldScheduler()
    add(req)  # enforce: retired at the door, before the release's own add runs
    assert req.finished() and queue.scheduler.streamed == [req.rid]
    events = sgl.spool(kv_enforce).events(detector="admission", kind="aborted_admitted")
    assert [e["action"] for e in events] == ["enforced"]


@pytest.mark.skipif(FIXED, reason="this release retires aborted requests at both doors")
def test_unfixed_release_log_mode_records_the_admission(kv: Any) -> None:
    """The incident: v0.5.19's PrefillBootstrapQueue.add admits a rejected request (it checks
    nothing), and kvwatch records it. The KV sender needs a transfer backend, so this one
    instance's ``create_sender`` only says yes; ``add`` itself is SGLang's."""
    req = sgl.request("rejected-log", 32)
    req.set_finish_with_abort("input too long for the KV pool")
    queue, add = door("prefill_bootstrap")
    queue.create_sender = lambda req, num_kv_heads: True
    add(req)
    assert queue.queue == [req]  # admitted: the bug
    events = sgl.spool(kv).events(detector="admission", kind="aborted_admitted")
    assert [(e["request_id"], e["action"]) for e in events] == [("rejected-log", "logged")]
    assert sgl.counter(sgl.spool(kv), "aborted_admissions", queue="prefill_bootstrap") == 1


def test_a_retracted_request_with_a_pending_abort_is_not_flagged(kv: Any) -> None:
    """A preempted request re-enters the door holding resources its queue releases: SGLang
    admits it by design (is_unadmitted_reject), and kvwatch must not call that a leak."""
    req = sgl.request("retracted-7", 32)
    req.set_finish_with_abort("aborted while running")
    req.is_retracted = True
    queue, add = door("prefill_bootstrap")
    queue.create_sender = lambda req, num_kv_heads: True  # the sender needs a transfer backend
    add(req)
    assert queue.queue == [req]
    contents = sgl.spool(kv)
    assert contents.events() == []
    assert sgl.counter(contents, "verifications", detector="admission") == 1
