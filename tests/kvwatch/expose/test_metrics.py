from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvspool import catalogue
from kvwatch.expose.metrics import KvwatchCollector
from kvwatch.ingest.logs.parse import EngineView
from kvwatch.ingest.spool.reader import SpoolReader
from kvwatch.store.journal import Journal
from kvwatch.store.state import EngineLogView, State
from tests.kvwatch.spoolgen import Producer

GOLDEN = Path(__file__).parent / "golden" / "metrics.prom"


class FakeGpus:
    """A fixed GPU source for the golden file (the real NVML is tested in test_nvml)."""

    up = True

    def memory(self) -> list[tuple[str, int, int, int]]:
        return [("0", 80 << 30, 60 << 30, 20 << 30)]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool not found: install Debian's 'prometheus' package"
            " (make test does: apt-get install -y prometheus prometheus-alertmanager)"
        )
    return path


#: A fixed time, so that the golden text is the same on every run.
FIXED_T0 = 1_790_000_000.0


def fixed_state(spool: Path, journal: Journal) -> State:
    state = journal.load()
    decode = Producer(spool, "sglang-decode-r0-100-aaaa0001", role="decode", t0=FIXED_T0)
    decode.append(
        decode.hello(),
        decode.gauges(681280, 1048576),
        decode.counters(40, mismatches=2),
        decode.event(
            "req-7",
            sources=[{"request_id": "req-3", "pages": 4}, {"request_id": "req-4", "pages": 3}],
            other_sources=2,
            other_source_pages=5,
        ),
        decode.event("req-8", detector="checksum", kind="digest"),
        # A transferred request's finding names the node that sent its KV.
        decode.event("req-10", detector="checksum", kind="digest", detail={"peer_node": "pf-1"}),
    )
    prefill = Producer(spool, "sglang-prefill-r0-101-aaaa0002", role="prefill", t0=FIXED_T0)
    hello = prefill.hello()
    prefill.append(hello, prefill.gauges(2040000, 1048576), prefill.counters(39))
    odd = Producer(
        spool, "custom-weird-r0-102-aaaa0003", role="verifier", engine="tgi", t0=FIXED_T0
    )
    odd.append(odd.hello(), odd.frame("gauges", {"gauges": []}, skip=2))
    broken = bytearray(decode.event("req-9"))
    broken[-3] ^= 0xFF
    decode.append(bytes(broken))
    reader = SpoolReader(spool, journal, state, idle_grace=3600.0)
    reader.clock_past = float("inf")  # keep FIXED_T0 as it is
    reader.poll()
    view = EngineView(role="prefill", rank=0, engine="vllm")
    view.pool_tokens, view.context_length_tokens = 1234567, 131072
    state.logs["vllm.log"] = EngineLogView("prefill", "vllm", "llama", 0, view.gauges(), "0.33.0")
    state.collectors["spool"] = (True, 0.0)
    return state


def render(state: State, gpus: object | None = None) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvwatchCollector(state, gpus))  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def normalise(text: str) -> str:
    text = re.sub(r'python="[^"]+"', 'python="X"', text)
    text = re.sub(r"(kvwatch_collector_duration_seconds\{[^}]*\}) \S+", r"\1 0.0", text)
    return text


def test_golden_metrics_and_promtool(spool: Path, journal: Journal, tmp_path: Path) -> None:
    text = normalise(render(fixed_state(spool, journal), FakeGpus()))
    if os.environ.get("KVWATCH_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "golden /metrics changed: metric names are a public API"
    checked = subprocess.run(
        [promtool(), "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_known_series_starts_at_zero(journal: Journal) -> None:
    families = {f.name: f for f in text_string_to_metric_families(render(journal.load()))}
    pairs = sum(len(kinds) for kinds in catalogue.DETECTOR_KINDS.values())
    for name in ("kvwatch_mismatches", "kvwatch_findings"):
        # Only the (detector, kind) pairs a detector can report, for every role (with other):
        # 12 x 4 = 48, not every detector x role x kind (7 x 4 x 11 = 308).
        samples = families[name].samples
        assert len(samples) == pairs * 4 == 48, name
        assert {s.value for s in samples} == {0.0}
        kinds = {(s.labels["detector"], s.labels["kind"]) for s in samples}
        assert ("admission", "digest") not in kinds and ("canary", "digest") not in kinds
        assert ("checksum", "digest") in kinds and ("admission", "aborted_admitted") in kinds
    rejected = {s.labels["reason"] for s in families["kvwatch_spool_rejected"].samples}
    assert {"crc", "torn", "owner", "schema", "oversize", "sequence"} <= rejected
    assert families["kvwatch_nvml_up"].samples[0].value == 0
    assert len(families["kvwatch_exposed_requests"].samples) == 4  # roles, with other
    peers = families["kvwatch_transfer_mismatches"].samples
    assert [(s.labels, s.value) for s in peers] == [({"peer": "other"}, 0.0)]
    for name in (
        "kvwatch_spool_records",
        "kvwatch_spool_lost_records",
        "kvwatch_findings",
        "kvwatch_exposed_requests",
    ):
        assert all(s.value == 0 for s in families[name].samples)


def test_unknown_label_values_become_other_and_models_are_bounded(
    spool: Path, journal: Journal
) -> None:
    state = journal.load()
    reader = SpoolReader(spool, journal, state, idle_grace=3600.0)
    for i in range(20):
        p = Producer(spool, f"sglang-decode-r0-{i}-dddd{i:04d}", model=f"model-{i}", role="odd")
        p.append(p.hello(), p.gauges(100, 200), p.counters(1))
    reader.poll()
    families = {f.name: f for f in text_string_to_metric_families(render(state))}
    models = {s.labels["model"] for s in families["kvwatch_kv_pool_tokens"].samples}
    assert len(models) == 17 and "other" in models  # the first 16, then "other"
    roles = {s.labels["role"] for s in families["kvwatch_kv_pool_tokens"].samples}
    assert roles == {"other"}
    verified = {
        s.labels["role"]: s.value
        for s in families["kvwatch_verifications"].samples
        if s.labels["detector"] == "canary"
    }
    assert verified["other"] == 20
    assert "req-" not in render(state)  # request ids never become labels
    # A pair outside the possible ones (a newer producer's kind) is exposed as it comes.
    odd = Producer(spool, "sglang-decode-r0-99-eeee0099", role="decode")
    odd.append(odd.hello(), odd.event("r1", detector="canary", kind="digest"))
    reader.poll()
    families = {f.name: f for f in text_string_to_metric_families(render(state))}
    found = {
        (s.labels["detector"], s.labels["kind"]): s.value
        for s in families["kvwatch_findings"].samples
        if s.labels["role"] == "decode"
    }
    assert found[("canary", "digest")] == 1 and found[("canary", "unwritten_page")] == 0


def test_metrics_hold_no_request_ids_or_prompt_text(spool: Path, journal: Journal) -> None:
    text = render(fixed_state(spool, journal))
    assert "req-7" not in text and "req-8" not in text
    # The exposed sources are counted, never named.
    assert "req-3" not in text and "req-4" not in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    exposed = {s.labels["role"]: s.value for s in families["kvwatch_exposed_requests"].samples}
    assert exposed == {"decode": 4.0, "prefill": 0.0, "unified": 0.0, "other": 0.0}


def test_every_family_on_metrics_is_in_the_catalogue(spool: Path, journal: Journal) -> None:
    text = render(fixed_state(spool, journal), FakeGpus())
    exposed = {family.name for family in text_string_to_metric_families(text)}
    catalogued = (
        {s.family for s in catalogue.COUNTER_SERIES}
        | {s.family for s in catalogue.GAUGE_SERIES}
        | {f.name for f in catalogue.DAEMON_FAMILIES}
    )
    assert exposed == catalogued
    # The names the alerts and dashboards generators query (catalogue.exposed) are the samples'.
    samples = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples == set(catalogue.EXPOSED.values())
    assert catalogue.exposed("mismatches") == "kvwatch_mismatches_total"
    with pytest.raises(ValueError, match=r"kvwatch_mismatch$"):
        catalogue.exposed("mismatch")


def test_500_producers_minting_versions_keep_each_cap_exactly(tmp_path: Path) -> None:
    """Issue 22 item 9: 500 live producers, each with its own engine version, model and rank,
    read by the real daemon and scraped over HTTP: ``kvwatch_engine_info`` shows exactly the
    first 16 versions and 16 models plus ``other``, the pool gauges the first 64 ranks plus
    ``other``. The scrape's other ``version`` labels are kvwatch's own (``kvwatch_build_info``)
    and Python's (``python_info``), one value each: counted by label name over the whole scrape
    that makes 19, which is what was reported."""
    from kvwatch.store.state import MAX_MODELS, MAX_RANKS, MAX_VERSIONS
    from tests.kvwatch.daemonproc import DaemonProcess

    spool = tmp_path / "spool"
    spool.mkdir()
    for i in range(500):
        p = Producer(
            spool,
            f"sglang-decode-r{i}-{1000 + i}-{i:08x}",
            version=f"0.{i}.0",
            model=f"model-{i}",
            rank=i,
        )
        p.append(p.hello(), p.gauges(1000, 2000))
    # Unlocked segments that stay live: a long idle grace keeps every producer alive.
    daemon = DaemonProcess(tmp_path, "--no-nvml", "--idle-grace", "1h")
    try:
        daemon.wait_started()
        deadline = time.monotonic() + 60
        while True:
            text = daemon.scrape()
            families = {f.name: f for f in text_string_to_metric_families(text)}
            info = families["kvwatch_engine_info"].samples
            # Every producer read (each rank's pool gauge is there), not just the first 17.
            pools = families["kvwatch_kv_pool_tokens"].samples
            read = sum(s.value for s in families["kvwatch_producers"].samples)
            if read == 500 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        assert daemon.stop() == 0
    versions = {s.labels["version"] for s in info}
    models = {s.labels["model"] for s in info}
    assert len(versions) == MAX_VERSIONS + 1 and "other" in versions, sorted(versions)
    assert len(models) == MAX_MODELS + 1 and "other" in models
    assert versions - {"other"} <= {f"0.{i}.0" for i in range(500)}
    ranks = {s.labels["rank"] for s in pools}
    assert len(ranks) == MAX_RANKS + 1 and "other" in ranks
    elsewhere = {
        (f.name, s.labels["version"])
        for f in families.values()
        if f.name != "kvwatch_engine_info"
        for s in f.samples
        if "version" in s.labels
    }
    assert {name for name, _ in elsewhere} <= {"kvwatch_build_info", "python_info"}
    assert len(elsewhere) <= 2


def test_transfer_mismatches_by_peer_are_capped_and_survive_a_restart(
    spool: Path, journal: Journal
) -> None:
    """Per sending node, the first MAX_PEERS peers by name and the rest as other; what the
    journal keeps, a restarted daemon shows (every known peer, from its count)."""
    from kvspool.catalogue import MAX_PEERS

    state = journal.load()
    reader = SpoolReader(spool, journal, state, idle_grace=3600.0)
    p = Producer(spool, "vllm-decode-r0-7-eeee0001", engine="vllm", role="decode")
    events = [p.hello()]
    events += [
        p.event(f"r-{i}", detector="checksum", kind="digest", detail={"peer_node": f"pf-{i}"})
        for i in range(MAX_PEERS + 5)
    ]
    events.append(p.event("r-x", detector="checksum", kind="digest", detail={"peer_node": "pf-0"}))
    events.append(p.event("r-y", detector="checksum", kind="digest"))  # no peer: not counted
    p.append(*events)
    reader.poll()
    for current in (state, journal.load()):
        families = {f.name: f for f in text_string_to_metric_families(render(current))}
        peers = {s.labels["peer"]: s.value for s in families["kvwatch_transfer_mismatches"].samples}
        assert len(peers) == MAX_PEERS + 1
        assert peers["pf-0"] == 2 and peers["pf-1"] == 1 and peers["other"] == 5
