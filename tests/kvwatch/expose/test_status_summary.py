"""The status headline is the worst of integrity, unsafe band, coverage and freshness, built
from the daemon's real state after real spool records (the spool reader, not a hand-made dict)."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.expose.metrics import KvwatchCollector, rank_coverage
from kvwatch.expose.status import STALE_SECONDS, Alarm, AlarmSettings, Summary, alarm
from kvwatch.expose.status import summarize as summarize_with
from kvwatch.ingest.spool.reader import SpoolReader
from kvwatch.store.journal import Journal
from kvwatch.store.state import State
from tests.kvwatch.daemonproc import REPO
from tests.kvwatch.spoolgen import T0, Producer


def summarize(state: State, now: float, journal: Journal | None = None) -> Summary:
    """The summary with the integrity alarm the journal gives at ``now`` (none: no journal)."""
    settings = AlarmSettings()
    found = alarm(journal, settings, now) if journal is not None else Alarm(settings)
    return summarize_with(state, found, now)


def levels(state: State, now: float) -> dict[str, str]:
    return {c.name: c.level for c in summarize(state, now).checks}


def fresh(state: State) -> float:
    return state.last_record_ts + 1.0


def test_no_producer_is_not_ok(state: State) -> None:
    summary = summarize(state, time.time())
    assert summary.level == "warning"
    assert summary.headline.startswith("WARNING: no live producer")


def test_clean_traffic_is_ok(spool: Path, state: State, reader: SpoolReader) -> None:
    producer = Producer(spool)
    hello = producer.hello()
    clean = producer.frame(
        "counters",
        {"counters": [["verifications", {"detector": d}, 10] for d in ("canary", "checksum")]},
    )
    producer.append(hello, clean, producer.gauges(2_000_000, 131_072))
    reader.poll()
    summary = summarize(state, fresh(state), reader.journal)
    assert summary.level == "ok", summary.as_dict()
    assert summary.headline.startswith("OK: integrity: no unacknowledged incident")


def test_detector_verifying_nothing(spool: Path, state: State, reader: SpoolReader) -> None:
    producer = Producer(spool)
    hello = producer.hello()
    skipped = producer.frame(
        "counters",
        {
            "counters": [
                ["verifications", {"detector": "canary"}, 10],
                ["verifications_skipped", {"detector": "checksum", "reason": "no_seal"}, 10],
            ]
        },
    )
    producer.append(hello, skipped)
    reader.poll()
    summary = summarize(state, fresh(state))
    assert levels(state, fresh(state))["coverage"] == "warning"
    assert "detector checksum verifies nothing" in summary.headline


def test_a_rank_that_verifies_nothing_is_not_covered(
    spool: Path, state: State, reader: SpoolReader
) -> None:
    """Decode at TP 2: rank 0 verifies every transfer, rank 1 skips every one (a writer whose
    seals its layout cannot read). The summed counters say checksum verifies; the rank's own
    series and the coverage check say rank 1 does not."""
    for rank in (0, 1):
        producer = Producer(spool, f"vllm-decode-r{rank}-10{rank}-aaaa000{rank}", rank=rank)
        done = 0 if rank else 8
        skip, why = ("checksum", "other") if rank else ("page_tag", "mode_off")
        producer.append(
            producer.hello(),
            producer.frame(
                "counters",
                {
                    "counters": [
                        ["verifications", {"detector": "canary"}, 8],
                        ["verifications", {"detector": "checksum"}, done],
                        ["verifications_skipped", {"detector": skip, "reason": why}, 8],
                    ]
                },
            ),
        )
    reader.poll()
    summary = summarize(state, fresh(state))
    assert levels(state, fresh(state))["coverage"] == "warning"
    assert "checksum verifies nothing on decode rank 1 of sglang glm-5.3" in summary.headline
    text = render_metrics(state)
    assert _series(text, "kvwatch_rank_verifications_total", "checksum", "0") == 8.0
    assert _series(text, "kvwatch_rank_verifications_total", "checksum", "1") == 0.0
    assert _series(text, "kvwatch_rank_verifications_skipped_total", "checksum", "1") == 8.0
    # mode_off is a choice, not a gap: rank 0's page tags are not counted as skipped.
    assert _series(text, "kvwatch_rank_verifications_skipped_total", "page_tag", "0") is None


def test_a_restarted_ranks_counters_never_go_down(
    spool: Path, state: State, reader: SpoolReader
) -> None:
    """Rank 0's process verified 8 transfers and was replaced (its segments gone from the spool):
    the rank's counter keeps those 8 beside the new process's 2, so ``rate()`` sees no reset;
    the coverage check reads only the live process (2 verified: covered)."""
    old = Producer(spool, "vllm-decode-r0-100-aaaa0000", rank=0)
    counts = [["verifications", {"detector": "checksum"}, 8]]
    old.append(old.hello(), old.frame("counters", {"counters": counts}))
    reader.poll()
    text = render_metrics(state)
    assert _series(text, "kvwatch_rank_verifications_total", "checksum", "0") == 8.0
    for segment in spool.glob(f"{old.name}*"):
        segment.unlink()
    new = Producer(spool, "vllm-decode-r0-200-aaaa0001", rank=0)
    counts = [["verifications", {"detector": "checksum"}, 2]]
    new.append(new.hello(), new.frame("counters", {"counters": counts}))
    reader.poll()
    assert state.producers[old.name].retired and not state.producers[new.name].retired
    text = render_metrics(state)
    assert _series(text, "kvwatch_rank_verifications_total", "checksum", "0") == 10.0
    assert rank_coverage(state)[("decode", "sglang", "glm-5.3", "0", "hooks")] == {
        "checksum": (2.0, 0.0)
    }


def render_metrics(state: State) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvwatchCollector(state))
    return generate_latest(registry).decode()


def _series(text: str, name: str, detector: str, rank: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == name and (labels["detector"], labels["rank"]) == (detector, rank):
                return float(sample.value)
    return None


def test_stale_records_with_a_live_producer(spool: Path, state: State, reader: SpoolReader) -> None:
    producer = Producer(spool)
    producer.append(producer.hello(), producer.frame("counters", {"counters": []}))
    reader.poll()
    later = state.last_record_ts + STALE_SECONDS + 60
    assert state.live_producers == 1
    assert levels(state, later)["freshness"] == "warning"
    assert "have stalled" in summarize(state, later).headline


def test_integrity_outranks_everything(spool: Path, state: State, reader: SpoolReader) -> None:
    producer = Producer(spool)
    producer.append(
        producer.hello(),
        producer.counters(10, mismatches=3),
        producer.gauges(681_280, 1_048_576),
        producer.event("r1"),
        producer.event("r1", detector="checksum", kind="digest"),
        producer.event("r2", sources=[{"request_id": "alice", "pages": 2}]),
    )
    reader.poll()
    summary = summarize(state, fresh(state), reader.journal)
    assert summary.level == "alarm"
    assert levels(state, fresh(state))["unsafe_band"] == "alarm"  # critical, as its rule
    # Affected requests, not detector hits: r1's two findings are one incident.
    assert summary.headline.startswith(
        "ALARM: INTEGRITY ALERT: 2 affected request(s), 1 exposed request(s) (last 5m)"
    ), summary.headline


def test_an_event_without_its_counter_snapshot_still_alarms(
    spool: Path, state: State, reader: SpoolReader
) -> None:
    """An engine killed right after writing an event never sends the counters that carry it:
    the journal's incident must not read "no KV mismatch"."""
    producer = Producer(spool)
    producer.append(producer.hello(), producer.counters(10), producer.event("r"))
    reader.poll()
    summary = summarize(state, fresh(state), reader.journal)
    assert summary.level == "alarm", summary.as_dict()
    assert "1 affected request(s), 0 exposed request(s)" in summary.headline
    # Out of the window (the rule's 5 minutes), the alarm ends; until acknowledged, it stays.
    later = fresh(state) + 301
    assert summarize(state, later, reader.journal).checks[0].level == "ok"
    kept = alarm(reader.journal, AlarmSettings(until_ack=True), later)
    assert kept.raised and kept.counts == {"affected": 1, "exposed": 0}


def test_incidents_since_a_timestamp_and_by_kind(
    spool: Path, state: State, reader: SpoolReader, tmp_path: Path
) -> None:
    journal_path = tmp_path / "journal.db"  # the conftest's journal
    producer = Producer(spool)
    producer.append(
        producer.hello(),
        producer.event("req-old"),  # at T0 + 2 s
        producer.event("req-new", detector="checksum", kind="digest"),  # T0 + 3 s
    )
    reader.poll()

    def ids(*args: str) -> list[str]:
        result = subprocess.run(
            [sys.executable, "-m", "kvwatch.cli", "incidents", "--journal", str(journal_path),
             "--json", *args],
            cwd=REPO, capture_output=True, text=True, check=True,
        )  # fmt: skip
        return [row["request_id"] for row in json.loads(result.stdout)]  # one per incident

    # spoolgen's T0 is an hour ago, on a whole second: the events are at T0 + 2 s and T0 + 3 s.
    def utc(seconds: float, zone: str = "Z") -> str:
        moment = datetime.fromtimestamp(seconds, UTC)
        if zone == "Z":
            return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
        return moment.astimezone(timezone(timedelta(hours=2))).isoformat()

    assert ids() == ["req-old", "req-new"]
    assert ids("--since", utc(T0 + 3)) == ["req-new"]
    assert ids("--since", utc(T0 + 3, "+02:00")) == ["req-new"]
    assert ids("--since", utc(T0 + 86400)[:10]) == []
    assert ids("--kind", "digest") == ["req-new"]
    assert ids("--detector", "canary") == ["req-old"]


def test_daemon_logs_are_coloured_on_a_terminal(tmp_path: Path) -> None:
    """No --log-format: a terminal gets coloured human lines (a pipe gets JSON, as every
    DaemonProcess test shows)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvwatch.cli", "daemon", "--spool-dir", str(tmp_path / "s"),
         "--journal", str(tmp_path / "j.db"), "--listen", "127.0.0.1:0", "--no-nvml"],
        cwd=REPO, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
    )  # fmt: skip
    os.close(follower)
    seen = b""
    try:
        deadline = time.monotonic() + 30
        while b"daemon.started" not in seen:
            assert time.monotonic() < deadline, seen
            ready, _, _ = select.select([leader], [], [], 0.5)
            if ready:
                seen += os.read(leader, 65536)
    finally:
        proc.terminate()
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            # keep reading: a daemon blocked on a full terminal cannot log its way out
            if select.select([leader], [], [], 0.2)[0]:
                try:
                    seen += os.read(leader, 65536)
                except OSError:
                    break
        if proc.poll() is None:
            proc.kill()
        returncode = proc.wait(10)
        os.close(leader)
    assert returncode == 0, seen[-2000:]
    line = next(x for x in seen.splitlines() if b"daemon.started" in x)
    assert b"\x1b[" in line and not line.lstrip().startswith(b"{")
