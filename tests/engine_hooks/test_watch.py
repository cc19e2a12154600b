"""KVWatch reports to the spool: events for mismatches, cumulative counters, gauges; no KV bytes."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch

from engine_hooks import KVWatch, hookpoints, watch
from engine_hooks.detectors import Admission, Canary, PageTags, TransferChecksum
from engine_hooks.pagestate import DevicePages
from engine_hooks.testing import read_spool
from kvspool import catalogue
from tests.engine_hooks.harness import Pair, as_list, fill, make_pool


def test_events_counters_and_gauges_reach_the_spool(tmp_path: Path) -> None:
    pair = Pair.build("mha", torch.bfloat16, spool=tmp_path)
    pair.decode.report_pool(1000, 4000, 4)
    dst, ticket = pair.reserve("leaky", 6)
    _, seal = pair.prefill_write("leaky", dst, ticket, written=1)
    pair.decode.verify_admit(ticket, seal)
    pair.decode.close()
    pair.prefill.close()
    contents = read_spool(tmp_path)
    assert not contents.errors
    events = contents.events(request_id="leaky")
    assert {e["detector"] for e in events} == {"canary", "checksum", "page_tag"}
    for e in events:
        assert e["pages"] == dst[1:] or sorted(e["pages"]) == sorted(dst[1:])
        assert e["pages_total"] == 5
        assert e["action"] == "logged"
    counters = contents.latest_counters()
    assert counters["mismatches"][(("detector", "canary"), ("kind", "unwritten_page"))] == 1
    assert counters["verifications"][(("detector", "checksum"),)] == 1
    assert any(name == "hook_seconds" for name in counters)
    gauges = [r for r in contents.records if r["type"] == "gauges"]
    assert gauges[-1]["gauges"][0] == ["kv_pool_tokens", {}, 1000]


def test_no_kv_bytes_in_the_spool(tmp_path: Path) -> None:
    pair = Pair.build("mla", torch.bfloat16, spool=tmp_path)
    for i in range(3):  # earlier users, whose KV the reader then reads: sources are named
        pages, _, _ = pair.clean_request(f"user-{i}", 8)
        pair.free("decode", pages)
    dst, ticket = pair.reserve("r", 6)
    _, seal = pair.prefill_write("r", dst, ticket, written=1)
    pair.decode.verify_admit(ticket, seal)
    pair.decode.close()
    pair.prefill.close()
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("*.kvs"))
    for page in dst:  # neither the reader's KV nor the users' KV it read
        assert pair.dpool.page_views[0][page][16:48].numpy().tobytes() not in raw
    events = read_spool(tmp_path).events(request_id="r")
    assert events and all(e["sources"] for e in events)
    for event in events:  # a source is a request id, its instance, a page count, a time
        for source in event["sources"]:
            assert set(source) <= {"request_id", "instance", "pages", "written_at"}
            assert source["request_id"].startswith("user-")
            assert isinstance(source["pages"], int) and isinstance(source["written_at"], float)
        assert set(event) - {"sources"} <= {
            "v", "type", "producer", "seq", "ts", "detector", "kind", "mode", "action",
            "request_id", "pages", "pages_total", "detail", "instance", "other_sources",
            "other_source_pages",
        }  # fmt: skip
    for record in read_spool(tmp_path).records:
        text = json.dumps(record)
        assert "tensor" not in text


def test_counters_are_flushed_periodically(tmp_path: Path) -> None:
    watch = KVWatch(None, role="prefill", engine="sglang", spool=tmp_path, flush_interval=0.05)
    watch.on_admission("r", "prefill_bootstrap", aborted=True, finished=False)
    time.sleep(0.3)
    snapshots = [r for r in read_spool(tmp_path).records if r["type"] == "counters"]
    assert len(snapshots) >= 3
    assert ["aborted_admissions", {"queue": "prefill_bootstrap"}, 1] in snapshots[-1]["counters"]
    watch.close()
    watch.close()  # idempotent


def test_a_request_is_reported_once_per_detector_and_kind(tmp_path: Path) -> None:
    pair = Pair.build("mha", torch.bfloat16, spool=tmp_path)
    dst, ticket, _ = pair.clean_request("running", 3)
    pair.free("decode", dst[:1])
    pair.decode_free.remove(dst[0])
    pair.decode.on_alloc([dst[0]], "thief")
    for _ in range(5):  # every decode step still sees the stale page, and says so
        assert len(pair.decode.check_batch([ticket])) == 1
    pair.decode.close()
    pair.prefill.close()
    contents = read_spool(tmp_path)
    assert len(contents.events(request_id="running")) == 1
    mismatches = contents.latest_counters()["mismatches"]
    assert mismatches[(("detector", "page_tag"), ("kind", "stale_tag"))] == 1


def test_extended_tickets_are_checked_every_step_on_every_page() -> None:
    """Decode's own pages join the ticket (``extend``): the per-step batch check covers them
    through every growth of the ticket's cached tensor, and finds a stale one among them."""
    pair = Pair.build("mha", torch.bfloat16, pages=256)
    watch = pair.decode
    first, ticket = pair.reserve("grows", 100)  # over _VECTOR_PAGES: the tensor path
    _, other = pair.reserve("other", 3)
    watch._state.own_writes(ticket.pages)  # type: ignore[union-attr]
    watch._state.own_writes(other.pages)  # type: ignore[union-attr]
    added: list[int] = []
    for _ in range(80):  # past the cached buffer's room: appended in place, then rebuilt
        pages, verdicts = pair.alloc("decode", 1, "grows")
        assert verdicts == []
        watch.extend(ticket, pages)
        added += pages
        assert watch.check_batch([ticket, other]) == []
    assert ticket.tensors(watch.pool.device)[0].tolist() == first + added  # type: ignore[union-attr]
    watch.pool.tag_store[added[-1]] += 1  # type: ignore[union-attr]
    watch.pool.tag_store[added[5]] += 1  # type: ignore[union-attr]
    verdicts = watch.check_batch([other, ticket])
    assert [(v.request_id, v.kind, sorted(v.pages)) for v in verdicts] == [
        ("grows", "stale_tag", sorted([added[5], added[-1]]))
    ]


def test_hook_and_detector_names_are_the_catalogues() -> None:
    hooks = set(catalogue.HOOK.values) - {catalogue.OTHER}
    assert hooks == watch.HOOKS  # every catalogued hook is timed and counted, and no other
    assert set(hookpoints.HOOK_DETECTORS) | {"flush"} == hooks
    detectors = {kind.name for kind in (Canary, TransferChecksum, PageTags, Admission)}
    assert detectors == set(catalogue.HOOKED_DETECTORS) == set(watch.DETECTOR_NAMES)
    with pytest.raises(ValueError, match="'alocate' is not a catalogued hook"):
        hookpoints.hook("alocate", list)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a catalogued detector"):
        catalogue.DETECTOR.check(catalogue.OTHER)


def test_a_reused_request_id_is_two_requests(tmp_path: Path) -> None:
    """Clients reuse request ids: two requests with one id, each reading three unwritten pages,
    are two instances, two events and two mismatches (the id alone would hide the second)."""
    pair = Pair.build("mha", torch.bfloat16, spool=tmp_path)
    tickets = []
    for _ in range(2):
        dst, ticket = pair.reserve("same-rid", 4)
        pair.prefill_write("same-rid", dst, ticket, written=1)
        assert (
            len([v for v in pair.decode.verify_admit(ticket, None) if v.kind == "unwritten_page"])
            == 1
        )
        tickets.append(ticket)
    assert tickets[0].instance and tickets[0].instance != tickets[1].instance
    pair.decode.close()
    pair.prefill.close()
    contents = read_spool(tmp_path)
    events = contents.events(request_id="same-rid", detector="canary")
    assert sorted(e["instance"] for e in events) == sorted(t.instance for t in tickets)
    assert all(e["pages_total"] == 3 for e in events)
    mismatches = contents.latest_counters()["mismatches"]
    assert mismatches[(("detector", "canary"), ("kind", "unwritten_page"))] == 2


def test_a_reused_request_id_at_the_door_is_two_admissions(tmp_path: Path) -> None:
    watch = KVWatch(None, role="prefill", engine="sglang", spool=tmp_path)
    for _ in range(2):
        watch.on_admission("same-rid", "prefill_bootstrap", aborted=True, finished=False)
    watch.close()
    events = read_spool(tmp_path).events(detector="admission")
    assert len(events) == 2 and len({e["instance"] for e in events}) == 2


def _watch(mode: str, device_backend: bool) -> KVWatch:
    w = KVWatch(make_pool("mha", torch.bfloat16, 12), role="decode", engine="minipd", mode=mode)
    assert w.pool is not None
    if device_backend:  # the accelerator backend, run on CPU tensors
        w._use_state(DevicePages(w.pool, kernel=False))
    w.on_free(range(12))
    return w


@pytest.mark.parametrize("device_backend", [False, True], ids=["host", "device"])
def test_landed_marks_only_the_pages_the_transfer_wrote(device_backend: bool) -> None:
    """A transfer that carries no tags marks written exactly the pages it wrote."""
    w = _watch("log", device_backend)
    assert w.pool is not None and w._state is not None
    w.on_alloc([2, 3, 4, 5])
    ticket = w.on_reserve("reader", [2, 3, 4, 5])
    assert ticket is not None
    fill(w.pool, [2, 4], random.Random(1))  # the transfer wrote two of the four pages
    w.landed(ticket)
    stale = [bool(b) for b in w._state.stale(ticket.pages, ticket.tags)]
    assert stale == [False, True, False, True]


@pytest.mark.parametrize("device_backend", [False, True], ids=["host", "device"])
def test_landed_without_a_canary_counts_every_page_written(device_backend: bool) -> None:
    w = _watch("off", device_backend)
    assert w._state is not None
    w.on_alloc([2, 3])
    ticket = w.on_reserve("reader", [2, 3])
    assert ticket is not None
    w.landed(ticket)  # the canary cannot tell: the transfer is taken at its word
    assert [bool(b) for b in w._state.stale(ticket.pages, ticket.tags)] == [False, False]


@pytest.mark.parametrize("device_backend", [False, True], ids=["host", "device"])
def test_wrote_marks_the_pages_written_by_their_request(device_backend: bool) -> None:
    """An engine's own forward writes: the pages are written for their current generation and
    name the writer (request and instance) as their holder."""
    w = _watch("log", device_backend)
    assert w._state is not None
    w.on_alloc([2, 3])
    index = w._state.index([2, 3])
    gens = w._state.generations(index)
    assert [bool(b) for b in w._state.stale(index, gens)] == [True, True]
    w.wrote("writer", [2, 3], "writer-1")
    w.wrote("writer", [])  # nothing written: nothing recorded
    assert [bool(b) for b in w._state.stale(index, gens)] == [False, False]
    keys, _ = w._state.sources(index)
    assert [w._requests.get(k) for k in keys] == [("writer", "writer-1")] * 2


def test_wrote_and_landed_never_raise_and_are_timed() -> None:
    w = _watch("log", False)
    ticket = w.on_reserve("reader", [2])
    assert ticket is not None
    w.wrote("writer", [99])  # no such page
    w.landed(watch.Ticket("reader", [99], [1]))
    assert w.counter("hook_errors", "wrote") == 1
    assert w.counter("hook_errors", "landed") == 1
    w.landed(ticket)
    assert w.counter("hook_seconds", "landed") > 0
    assert w.counter("hook_seconds", "wrote") > 0


def test_a_mismatch_writes_its_counters_at_once_not_a_flush_interval_later(tmp_path: Path) -> None:
    """The alert pages on the mismatch counter: an engine killed within a flush interval of the
    event would leave a journaled leak that pages nobody. The counters follow the event at once
    (from the flush thread: the engine's thread never waits on it)."""
    watch = KVWatch(None, role="decode", engine="sglang", spool=tmp_path, flush_interval=3600)
    watch.on_admission("r", "decode_prealloc", aborted=True, finished=False)
    deadline = time.monotonic() + 10
    mismatches = 0.0
    while time.monotonic() < deadline and not mismatches:
        snapshots = [r for r in read_spool(tmp_path).records if r["type"] == "counters"]
        mismatches = sum(
            value for name, _, value in snapshots[-1]["counters"] if name == "mismatches"
        )
        time.sleep(0.05)
    watch.close()
    assert mismatches == 1


def test_ids_that_utf8_cannot_hold_still_reach_the_spool(tmp_path: Path) -> None:
    """A lone surrogate in a request id would make the whole event unwritable: it is escaped."""
    watch = KVWatch(None, role="decode", engine="sglang", spool=tmp_path)
    watch.on_admission("bad\ud800" + "x" * 300, "decode_prealloc", aborted=True, finished=False)
    watch.close()
    (event,) = read_spool(tmp_path).events(detector="admission")
    assert event["request_id"].startswith("bad\\ud800x") and len(event["request_id"]) == 128


@pytest.mark.parametrize("device_backend", [False, True], ids=["host", "device"])
def test_extend_each_is_extend_for_each_ticket(device_backend: bool) -> None:
    """One page for each of several tickets in one call (a decode step at page size 1) leaves
    the tickets, the write records and the step check as ``extend`` once per ticket does."""
    results = []
    for batched in (False, True):
        w = _watch("log", device_backend)
        assert w._state is not None
        w.on_alloc([0, 1, 2])
        tickets = [w.on_reserve(f"r{i}", [i]) for i in range(3)]
        assert all(t is not None for t in tickets)
        held = [t for t in tickets if t is not None]
        fill(w.pool, [0, 1, 2], random.Random(1))  # the transfer writes the reserved pages
        for t in held:
            w.landed(t)
        for step in range(2):
            pages = [3 + 3 * step + i for i in range(3)]
            w.on_alloc(pages)
            if batched:
                w.extend_each(held, pages)
            else:
                for t, page in zip(held, pages, strict=True):
                    w.extend(t, [page])
        assert w.check_batch(held) == []
        keys, _ = w._state.sources(list(range(9)))
        results.append(([as_list(t.pages) for t in held], [as_list(t.tags) for t in held], keys))
    assert results[0] == results[1]
    assert results[1][0] == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
