"""``kvwatch incidents``: the fleet-wide list and the disclosure view (``--exposed``), from real
journals and incidents logs, through the real command line."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwatch.commands import incidents as views
from kvwatch.ingest.spool.reader import SpoolReader
from kvwatch.store import incident as incidents
from kvwatch.store.incident import Finding
from kvwatch.store.incidents_log import IncidentsLog
from kvwatch.store.journal import Journal
from kvwatch.store.state import State
from tests.kvwatch.daemonproc import run_cli
from tests.kvwatch.spoolgen import T0, Producer
from tests.kvwatch.views import as_finding


def _node(
    tmp_path: Path, node: str, frames: list[tuple[str, dict[str, Any]]], name: str | None = None
) -> Path:
    """A node's journal holding ``frames`` (request id, event options) from a decode engine."""
    name = name or node
    spool = tmp_path / f"spool-{name}"
    spool.mkdir()
    path = tmp_path / f"{name}.db"
    journal = Journal(path)
    p = Producer(spool, f"sglang-decode-r0-1-{name}", node=node)
    p.append(p.hello(), *(p.event(request, **options) for request, options in frames))
    SpoolReader(spool, journal, journal.load(), idle_grace=3600.0, node=node).poll()
    journal.close()
    return path


def _src(request: str, pages: int, instance: str | None = None) -> dict[str, Any]:
    return {"request_id": request, "pages": pages, "instance": instance}


@pytest.fixture
def fleet(tmp_path: Path) -> tuple[Path, Path]:
    a = _node(
        tmp_path,
        "node-a",
        [
            ("req-17", {"sources": [_src("alice", 5, "alice#1"), _src("bob", 2)]}),
            # A second detector on the same pages: the pair's pages count once.
            (
                "req-17",
                {
                    "detector": "checksum",
                    "kind": "digest",
                    "sources": [_src("alice", 4, "alice#1")],
                    "other_sources": 3,
                    "other_source_pages": 6,
                },
            ),
            ("clean-finding", {"detector": "admission", "kind": "other"}),
        ],
    )
    b = _node(tmp_path, "node-b", [("req-99", {"sources": [_src("bob", 1)]})])
    return a, b


def test_the_disclosure_view_names_readers_sources_and_pages(fleet: tuple[Path, Path]) -> None:
    rows = incidents.group(incidents.merge(Journal(p, readonly=True).incidents() for p in fleet))
    view = views.exposure(rows, since=None, until=None)
    assert view["v"] == views.EXPOSED_VERSION
    readers = {(r["node"], r["request_id"]): r for r in view["readers"]}
    assert set(readers) == {("node-a", "req-17"), ("node-b", "req-99")}  # not the clean one
    req17 = readers[("node-a", "req-17")]
    assert req17["role"] == "decode" and req17["engine"] == "sglang"
    assert req17["findings"] == 2 and req17["detectors"] == ["canary", "checksum"]
    assert req17["sources"] == [
        {"request_id": "alice", "instance": "alice#1", "pages": 5},
        {"request_id": "bob", "instance": None, "pages": 2},
    ]
    assert req17["other_sources"] == 3
    # bob on node-a and bob on node-b are two requests: a KV pool is one node's.
    sources = {(s["node"], s["request_id"]): s for s in view["sources"]}
    assert sources[("node-a", "alice")]["readers"] == [
        {"request_id": "req-17", "instance": None, "pages": 5}
    ]
    assert sources[("node-b", "bob")]["pages"] == 1
    assert view["counts"] == {
        "incidents": 3,  # req-17 (two findings), clean-finding, req-99
        "exposed": 3 + 3,
        "readers": 2,
        "sources": 3,
        "unnamed_sources": 3,
        "unnamed_source_pages": 6,
        "pages": 5 + 2 + 1 + 6,
    }


def test_cli_merges_journals_and_logs_once_and_filters_by_time(
    fleet: tuple[Path, Path], tmp_path: Path
) -> None:
    a, b = fleet
    # node-b's incidents also shipped as a log: listed once.
    log = tmp_path / "node-b.jsonl"
    journal = Journal(b)
    IncidentsLog(log, max_bytes=1 << 20, keep=3).drain(journal)
    journal.close()
    merged = run_cli("incidents", "--journal", str(a), "--incidents-log", str(log), "--json")
    both = run_cli(
        "incidents", "--journal", str(a), "--journal", str(b), "--incidents-log", str(log)
    )
    assert merged.returncode == both.returncode == 0, merged.stderr + both.stderr
    rows = json.loads(merged.stdout)
    # One incident per affected request, by first finding's time, then node.
    assert [(r["node"], r["request_id"], len(r["findings"])) for r in rows] == [
        ("node-a", "req-17", 2),
        ("node-b", "req-99", 1),
        ("node-a", "clean-finding", 1),
    ]
    assert "4 finding(s), 6 exposed request(s), 3 incident(s)" in both.stdout
    assert "node-b" in both.stdout
    header = both.stdout.splitlines()[0].split()
    assert "EXPOSED" in header and "ID" in header
    # --since/--until: record i of each node has ts T0 + i.
    window = run_cli(
        "incidents", "--journal", str(a), "--journal", str(b), "--json",
        "--since", _iso(T0 + 2), "--until", _iso(T0 + 3.5),
    )  # fmt: skip
    assert [(r["node"], [f["seq"] for f in r["findings"]]) for r in json.loads(window.stdout)] == [
        ("node-a", [2, 3]),
        ("node-b", [2]),
    ]


def test_cli_exposed_view_text_and_json(fleet: tuple[Path, Path]) -> None:
    a, b = fleet
    text = run_cli("incidents", "--exposed", "--journal", str(a), "--journal", str(b))
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "READERS" in out and "SOURCES" in out
    assert "alice (5), bob (2), +3 more" in out
    assert "req-17 (5)" in out  # alice's reader
    assert (
        "2 reader(s), 3 named source(s) and 3 unnamed, 14 page(s) of theirs read;"
        " 3 incident(s) (affected requests), 6 exposed request(s)"
    ) in out
    data = run_cli("incidents", "--exposed", "--json", "--journal", str(a), "--since", "3650d")
    view = json.loads(data.stdout)
    assert view["v"] == 2 and view["counts"]["readers"] == 1 and view["since"] is not None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--until", "30"), "--until '30': expected a duration (1h, 7d) or a UTC time"),
        (("--since", "5"), "--since '5': expected a duration"),
        (("--incidents-log", "{t}/none.jsonl"), "no incidents log at {t}/none.jsonl"),
        (("--incidents-log", "{t}"), "is a directory"),
        (("--incidents-log", "/dev/zero"), "/dev/zero is not a regular file"),
    ],
)
def test_cli_mistakes_are_one_line(
    fleet: tuple[Path, Path], tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    result = run_cli("incidents", *(a.format(t=tmp_path) for a in args))
    assert result.returncode in (1, 2)
    assert message.format(t=tmp_path) in result.stderr
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr


def _iso(ts: float) -> str:
    from kvwatch.store.incidents_log import iso

    return iso(ts)


def test_text_views_escape_control_characters(tmp_path: Path) -> None:
    """Ids and node names from another node's log reach the terminal escaped, once, in both
    text views; JSON keeps them as they are."""
    node = "a\x1b]0;pwned\x07"
    path = _node(
        tmp_path,
        node,
        [("h-ctrl\x1b[31m", {"sources": [_src("x\n\x1b[2J", 3, "i\tj\x9b")]})],
        name="evil",
    )
    for extra in ((), ("--exposed",)):
        result = run_cli("incidents", *extra, "--journal", str(path))
        assert result.returncode == 0, result.stderr
        out = result.stdout
        assert not any(c in out for c in "\x1b\x07\x9b\t\r"), repr(out)
        assert "a\\x1b]0;pwned\\x07" in out and "h-ctrl\\x1b[31m" in out
        # One row per incident or request: the source's newline did not break the table.
        rows = [line for line in out.splitlines() if "h-ctrl" in line or "\\n\\x1b[2J" in line]
        assert rows and all("\\n" not in line or "x\\n\\x1b[2J" in line for line in rows)
    exposed = run_cli("incidents", "--exposed", "--journal", str(path)).stdout
    assert "x\\n\\x1b[2J (3)" in exposed and "i\\tj\\x9b" in exposed
    assert len([line for line in exposed.splitlines() if line.startswith("a\\x1b")]) == 1
    data = json.loads(run_cli("incidents", "--json", "--journal", str(path)).stdout)
    assert data[0]["node"] == node and data[0]["request_id"] == "h-ctrl\x1b[31m"


def _finding(**fields: Any) -> dict[str, Any]:
    row = {
        "id": 1, "time": T0, "node": "n", "role": "decode", "engine": "minipd",
        "engine_version": "1", "model": "m", "rank": 0, "producer": "p", "seq": 1,
        "request_id": "req-1", "instance": "i-1", "detector": "canary",
        "kind": "unwritten_page", "mode": "log", "action": "logged", "pages": [1],
        "pages_total": 1, "detail": {}, "sources": [], "other_sources": 0,
        "other_source_pages": 0,
    }  # fmt: skip
    row.update(fields)
    return row


def _findings(*rows: dict[str, Any]) -> list[Finding]:
    """``rows`` as Findings, in time order (as :func:`kvwatch.store.incident.merge` gives)."""
    return sorted(map(as_finding, rows), key=lambda f: (f.ts, f.id))


def test_one_incident_per_affected_request_instance() -> None:
    """The prefill side's admission finding, decode's admission check and decode's reader
    findings of one request (three instances, as minipd mints them) are one incident with the
    reader's sources counted once; a reused id that repeats a finding from a new instance, or
    comes after the join window, is another incident."""
    a, b = _src("alice", 5, "a#1"), _src("bob", 2)
    rows = [
        _finding(id=1, role="prefill", producer="pre", instance="x-1", detector="admission",
                 kind="aborted_admitted"),
        _finding(id=2, time=T0 + 0.01, instance="x-12", detector="admission",
                 kind="aborted_admitted"),
        _finding(id=3, time=T0 + 0.02, instance="x-11", sources=[{**a, "written_at": T0}]),
        _finding(id=4, time=T0 + 0.03, instance="x-11", detector="page_tag", kind="stale_tag",
                 sources=[{**a, "written_at": T0}, {**b, "written_at": T0}]),
        # The id reused by the client: the same finding from a new instance.
        _finding(id=5, time=T0 + 1, instance="x-20", sources=[{**b, "written_at": T0}]),
        # And again, long after.
        _finding(id=6, time=T0 + incidents.JOIN_SECONDS + 30, instance="x-30", detector="checksum",
                 kind="digest"),
        # Another node's request of the same id is another request.
        _finding(id=7, time=T0 + 0.02, node="other", instance="x-11"),
    ]  # fmt: skip
    grouped = incidents.group(_findings(*rows))
    assert [(i["node"], [f["id"] for f in i["findings"]]) for i in grouped] == [
        ("n", [1, 2, 3, 4]),
        ("other", [7]),
        ("n", [5]),
        ("n", [6]),
    ]
    first = grouped[0]
    assert first["id"] == 1 and first["role"] == "decode" and first["instance"] == "x-11"
    assert first["roles"] == ["prefill", "decode"]
    assert [s["request_id"] for s in first["sources"]] == ["alice", "bob"]
    assert first["exposed"] == 2
    # bob is exposed to two incidents on node n: one exposed request.
    assert incidents.counts(grouped) == {"affected": 4, "exposed": 2}
    view = views.exposure(grouped, since=None, until=None)
    assert view["counts"]["incidents"] == 4 and view["counts"]["exposed"] == 2
    assert view["counts"]["readers"] == 2 and view["counts"]["sources"] == 2


def test_every_tp_ranks_findings_on_one_request_are_one_incident_with_its_ranks() -> None:
    """Decode at TP 2: both ranks' page-count findings on one request name the scheduler's one
    instance (each rank's own producer): one incident, its ranks shown, its source once."""
    a = {**_src("alice", 3, "a#1"), "written_at": T0}
    rows = [
        _finding(id=1, rank=0, producer="r0", instance="v-1", detector="checksum",
                 kind="page_count", sources=[a]),
        _finding(id=2, time=T0 + 0.01, rank=1, producer="r1", instance="v-1",
                 detector="checksum", kind="page_count", sources=[a]),
    ]  # fmt: skip
    [incident] = incidents.group(_findings(*rows))
    assert incident["ranks"] == [0, 1]
    assert incident["exposed"] == 1
    assert incidents.counts([incident]) == {"affected": 1, "exposed": 1}
    text = io.StringIO()
    views.render([incident], text, as_json=False)
    assert "decode checksum page_count, decode rank 1 checksum page_count" in text.getvalue()
    shown = io.StringIO()
    views.render([incident], shown, as_json=True)
    assert json.loads(shown.getvalue())[0]["ranks"] == [0, 1]


def test_the_affected_and_exposed_counters_count_as_every_view(
    spool: Path, reader: SpoolReader
) -> None:
    """``kvwatch_affected_requests_total`` and ``kvwatch_exposed_requests_total`` (what
    KVIntegrityMismatch's description states) count as ``kvwatch incidents`` and ``kvwatch
    status`` do (:func:`incidents.counts`): three findings of one request are one affected
    request naming alice and bob once; another request exposed to alice is a second affected
    request, and alice is still one exposed request."""
    alice, bob = _src("alice", 3, "a#1"), _src("bob", 1)
    p = Producer(spool)
    p.append(
        p.hello(),
        p.event("r", sources=[alice, bob]),
        p.event("r", detector="checksum", kind="digest", sources=[alice], other_sources=2),
        p.event("r", detector="page_tag", kind="stale_tag", sources=[bob], other_sources=1),
        p.event("other", sources=[alice]),
    )
    reader.poll()
    grouped = incidents.group(reader.journal.incidents())
    assert [i["exposed"] for i in grouped] == [4, 1]
    assert incidents.counts(grouped) == {"affected": 2, "exposed": 2 + 2}
    assert reader.state.daemon[("exposed_requests", ("decode",))] == 2 + 2
    assert reader.state.daemon[("affected_requests", ("decode",))] == 2


_FINDING = st.tuples(
    st.sampled_from(["r1", "r2", "r3"]),  # request ids, reused
    st.sampled_from([None, "i1", "i2"]),  # instances
    st.sampled_from(
        [("canary", "unwritten_page"), ("page_tag", "stale_tag"), ("checksum", "digest")]
    ),
    st.lists(st.sampled_from(["alice", "bob", "carol"]), max_size=3, unique=True),
    st.integers(0, 2),  # other_sources
    st.sampled_from([0, 1, 30, 100]),  # seconds before it (JOIN_SECONDS is 60)
)


@settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.lists(_FINDING, min_size=1, max_size=12))
def test_the_counters_equal_the_views_counts_for_any_stream(
    tmp_path_factory: pytest.TempPathFactory, findings: list[Any]
) -> None:
    """Whatever the stream (reused ids, instances, gaps around the join window, repeated
    sources), the daemon's affected and exposed counters equal what ``kvwatch status`` and
    ``kvwatch incidents`` count from the journal: one definition of both numbers."""
    tmp = tmp_path_factory.mktemp("counts")
    spool = tmp / "spool"
    spool.mkdir()
    journal = Journal(tmp / "journal.db")
    reader = SpoolReader(spool, journal, State(), idle_grace=3600.0, node="node-a")
    p = Producer(spool)
    frames = [p.hello()]
    for rid, instance, (detector, kind), names, others, gap in findings:
        p.t0 += gap
        sources = [_src(name, 1) for name in names]
        frames.append(
            p.event(rid, detector, kind, instance=instance, sources=sources, other_sources=others)
        )
    p.append(*frames)
    reader.poll()
    grouped = incidents.group(journal.incidents())
    daemon = reader.state.daemon
    assert incidents.counts(grouped) == {
        "affected": daemon[("affected_requests", ("decode",))],
        "exposed": daemon[("exposed_requests", ("decode",))],
    }
    journal.close()


def test_a_request_stopped_before_it_read_is_an_incident_but_no_reader(
    spool: Path, reader: SpoolReader
) -> None:
    """Enforce failed ``r`` before it read (``detail.stopped_before_read``): its finding names
    whose KV the pages held, but it is no reader, exposes nobody, and is still an incident.
    ``t`` was stopped at one finding but had read at another: only that one's source counts."""
    alice, bob = _src("alice", 3, "a#1"), _src("bob", 1)
    p = Producer(spool)
    p.append(
        p.hello(),
        p.event("r", detector="page_tag", kind="stale_tag", sources=[alice], stopped=True),
        p.event("t", sources=[bob]),
        p.event("t", detector="page_tag", kind="stale_tag", sources=[alice], stopped=True),
    )
    reader.poll()
    assert reader.state.daemon[("exposed_requests", ("decode",))] == 1  # bob, read by t
    grouped = incidents.group(reader.journal.incidents())
    assert [(i["request_id"], i["exposed"], len(i["findings"])) for i in grouped] == [
        ("r", 0, 1),
        ("t", 1, 2),
    ]
    assert grouped[0]["findings"][0]["sources"][0]["request_id"] == "alice"  # kept as evidence
    view = views.exposure(grouped, since=None, until=None)
    assert [
        (r["request_id"], [s["request_id"] for s in r["sources"]]) for r in view["readers"]
    ] == [("t", ["bob"])]
    assert view["counts"]["incidents"] == 2 and view["counts"]["exposed"] == 1


def _lease_case() -> list[dict[str, Any]]:
    """A lease that expired: prefill (node p) freed request x-p's blocks, t1 and t2 took some
    (t2 after decode's read), decode (node d) read them as request x-d and found a digest
    mismatch naming its peer."""
    peer = {"peer_node": "p", "peer_request_id": "x-p", "peer_instance": "p#1",
            "peer_engine_id": "e-p", "transport": "nixl"}  # fmt: skip
    return [
        _finding(id=1, time=T0 + 10, node="d", request_id="x-d", instance="d#1",
                 detector="checksum", kind="digest", detail=peer),
        _finding(id=1, time=T0 + 20, node="p", role="prefill", request_id="x-p", rank=1,
                 instance="p#1", detector="page_tag", kind="freed_before_read",
                 sources=[{**_src("t1", 2, "t1#1"), "written_at": T0 + 5},
                          {**_src("t2", 1, "t2#1"), "written_at": T0 + 12}]),
        # Another prefill node's request of the same id and instance is another request.
        _finding(id=2, time=T0 + 20, node="q", role="prefill", request_id="x-p",
                 instance="p#1", detector="page_tag", kind="freed_before_read",
                 sources=[{**_src("u1", 3, "u1#1"), "written_at": T0 + 5}]),
    ]  # fmt: skip


def test_a_reader_joins_the_writers_side_of_the_same_request_instance() -> None:
    """Decode's finding names its peer (prefill's node, request id and instance): the fleet
    view makes them one incident, and names as the reader's sources, on prefill's node, the
    requests that took the sent blocks before the read (t1), not after (t2)."""
    grouped = incidents.group(_findings(*_lease_case()))
    assert [(i["node"], i["request_id"]) for i in grouped] == [("d", "x-d"), ("q", "x-p")]
    reader = grouped[0]
    assert reader["roles"] == ["decode", "prefill"] and len(reader["findings"]) == 2
    assert reader["ranks"] == [0, 1]  # the ranks of every finding it holds, the writer's too
    assert reader["peer"] == {"node": "p", "request_id": "x-p", "instance": "p#1"}
    assert [(s["node"], s["request_id"], s["pages"]) for s in reader["sources"]] == [("p", "t1", 2)]
    assert incidents.counts(grouped) == {"affected": 2, "exposed": 2}
    view = views.exposure(grouped, since=None, until=None)
    (first, _other) = view["readers"]
    assert first["request_id"] == "x-d" and first["node"] == "d"
    assert first["sources"] == [{"request_id": "t1", "instance": "t1#1", "pages": 2, "node": "p"}]
    assert {(s["node"], s["request_id"]) for s in view["sources"]} == {("p", "t1"), ("q", "u1")}
    out = io.StringIO()
    views.render_exposure(view, out, as_json=False)
    assert "t1@p (2)" in out.getvalue()


def test_an_aborted_transfer_released_on_a_timeout_names_its_takers_as_readers(
    tmp_path: Path,
) -> None:
    """SGLang decode released an aborted transfer's pages on its timeout (``freed_before_drain``):
    each request that took some is a reader of its own incident, the aborted request its source,
    through the spool reader, the journal and ``incidents --exposed``."""
    aborted = [_src("gone", 0, "gone#1")]
    frames = [
        (rid, {"detector": "page_tag", "kind": "freed_before_drain", "instance": f"{rid}#1",
               "sources": [{**aborted[0], "pages": n}]})
        for rid, n in (("t1", 3), ("t2", 1))
    ]  # fmt: skip
    dec = _node(tmp_path, "dec", frames)
    out = run_cli("incidents", "--exposed", "--json", "--journal", str(dec))
    assert out.returncode == 0, out.stderr
    view = json.loads(out.stdout)
    assert [(r["request_id"], r["sources"]) for r in view["readers"]] == [
        (rid, [{"request_id": "gone", "instance": "gone#1", "pages": n}])
        for rid, n in (("t1", 3), ("t2", 1))
    ]
    assert view["counts"]["incidents"] == 2 and view["counts"]["exposed"] == 1


def test_a_writers_side_finding_without_its_reader_stays_an_incident() -> None:
    (alone,) = incidents.group(_findings(*_lease_case()[1:2]))
    assert alone["node"] == "p" and [s["request_id"] for s in alone["sources"]] == ["t1", "t2"]


def test_cli_exposed_joins_a_decode_journal_and_a_prefill_incidents_log(tmp_path: Path) -> None:
    """The lease case as the disclosure team gets it: decode's journal and prefill's incidents
    log, through the spool reader, the journal, the log and the command line."""
    peer = {"peer_node": "pre", "peer_request_id": "x-p", "peer_instance": "p#1"}
    dec = _node(
        tmp_path, "dec", [("x-d", {"detector": "checksum", "kind": "digest", "detail": peer})]
    )
    spool = tmp_path / "spool-pre"
    spool.mkdir()
    journal = Journal(tmp_path / "pre.db")
    p = Producer(spool, "vllm-prefill-r0-2-bbbb0001", node="pre", role="prefill")
    taker = [{"request_id": "t1", "pages": 3, "instance": "t1#1", "written_at": T0 - 5}]
    late = [{"request_id": "t9", "pages": 1, "instance": "t9#1", "written_at": T0 + 500}]
    p.append(
        p.hello(),
        p.event("x-p", "page_tag", "freed_before_read", instance="p#1", sources=taker + late),
    )
    SpoolReader(spool, journal, journal.load(), idle_grace=3600.0, node="pre").poll()
    log = tmp_path / "pre.jsonl"
    IncidentsLog(log, max_bytes=1 << 20, keep=3).drain(journal)
    journal.close()
    out = run_cli(
        "incidents", "--exposed", "--json", "--journal", str(dec), "--incidents-log", str(log)
    )
    assert out.returncode == 0, out.stderr
    view = json.loads(out.stdout)
    (reader,) = view["readers"]
    assert (reader["node"], reader["request_id"]) == ("dec", "x-d")
    assert reader["peer"] == {"node": "pre", "request_id": "x-p", "instance": "p#1"}
    assert reader["sources"] == [
        {"request_id": "t1", "instance": "t1#1", "pages": 3, "node": "pre"}
    ]
    assert view["counts"]["incidents"] == 1 and view["counts"]["exposed"] == 1
