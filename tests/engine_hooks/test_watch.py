"""KVWatch reports to the spool: events for mismatches, cumulative counters, gauges; no KV bytes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from engine_hooks import KVWatch, watch
from engine_hooks.detectors import Admission, Canary, PageTags, TransferChecksum
from engine_hooks.testing import read_spool
from kvspool import catalogue
from tests.engine_hooks.harness import Pair


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
    watch.state.own_writes(ticket.pages)  # type: ignore[union-attr]
    watch.state.own_writes(other.pages)  # type: ignore[union-attr]
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
    assert set(watch._HOOK_DETECTORS) | {"flush"} == hooks
    detectors = {kind.name for kind in (Canary, TransferChecksum, PageTags, Admission)}
    assert detectors == set(catalogue.HOOKED_DETECTORS) == set(watch.DETECTOR_NAMES)
    with pytest.raises(ValueError, match="'alocate' is not a catalogued hook"):
        watch._hook("alocate", list)
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
