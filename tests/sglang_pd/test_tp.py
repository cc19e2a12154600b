"""kvwatch in real SGLang 0.5.23 PD servers at tensor parallelism, over Mooncake.

SGLang's CPU path runs TP 2 on these machines (one scheduler per rank, each bound to a core:
``SGLANG_CPU_OMP_THREADS_BIND="0|1"``; without it SGLang refuses more ranks than NUMA nodes).
One bed: a prefill at TP 2 (the corrupter beside kvwatch), a prefill at TP 1, and decodes at
TP 2 in ``log`` and ``enforce``, kvwatch in every scheduler:

- TP 2 -> TP 2: each decode rank checks its shard against its prefill rank's seal (SGLang sends
  rank ``r``'s heads and metadata row to decode rank ``r``); one rank's shard corrupted after
  the seal is that rank's finding; in enforce the ranks agree (consensus.py) and the request
  fails on both (HTTP 500: only rank 0 answers the client, so a verdict on rank 1 alone would
  have served it), with no rank left waiting, and the next request is served;
- TP 1 -> TP 2: a decode rank holds half of each page prefill sealed whole, so it cannot check
  the seal: zero findings (before the seal carried its writer's slice, every request was a
  false ``digest`` on both ranks) and ``skipped{checksum, unsupported_layout}`` on each rank,
  which per-rank coverage shows; the canary and page tags still verify.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine_hooks.testing import SpoolContents, read_spool
from tests.sglang_pd.bed import (
    KVWATCH_ABORT,
    Process,
    Reply,
    generate_body,
    only_loopback,
    post,
    serving_all,
    sglang_server,
    transport_failure,
    with_room,
)
from tests.sglang_pd.corrupter import MARK
from tests.sglang_pd.test_pd import MAX_TOKENS, SPOOL_WAIT_S, prompt

TRANSPORT = "mooncake"
PAGE = 16
TEXTS = [prompt(21, 40), prompt(22, 70), prompt(23, 25)]


@dataclass
class TPBed:
    prefill: dict[int, tuple[Process, int]]  # by TP width: the server, its bootstrap port
    decode: dict[str, Process]  # by kvwatch mode, TP 2 each
    spools: dict[str, Path]

    def pd(self, width: int, mode: str, text: str, rid: str | None = None) -> Reply:
        """One PD request from the prefill at ``width`` to decode ``mode``, as the router sends
        it; a transport failure (not a kvwatch finding) is retried once, its cause printed."""
        prefill, bootstrap = self.prefill[width]
        served = Reply(0, None, "")
        for attempt in (1, 2):
            body = with_room(generate_body(text, MAX_TOKENS, rid), bootstrap)
            with ThreadPoolExecutor(2) as pool:
                first = pool.submit(post, prefill.url, body)
                decoded = pool.submit(post, self.decode[mode].url, body)
                first.result()
                served = decoded.result()
            cause = transport_failure(served)
            if cause is None:
                return served
            if attempt == 1:
                print(f"retrying on decode-{mode}: a transport failure, {cause[:300]}")
        return served

    def spool(self, name: str) -> SpoolContents:
        return read_spool(self.spools[name])


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TPBed]:
    assert only_loopback(), "run the bed inside a loopback-only netns (tests/sglang_pd/run.sh)"
    workdir = tmp_path_factory.mktemp("tp")
    spools: dict[str, Path] = {}
    prefill: dict[int, tuple[Process, int]] = {}
    for width in (1, 2):
        server, spool, bootstrap = sglang_server(
            f"prefill-tp{width}",
            workdir,
            role="prefill",
            transport=TRANSPORT,
            plugins="kvwatch,cpu_bed,corrupt_after_seal",
            page_size=PAGE,
            tp=width,
        )
        prefill[width] = (server, bootstrap)
        spools[server.name] = spool
    decode: dict[str, Process] = {}
    for mode in ("log", "enforce"):
        server, spool, _ = sglang_server(
            f"decode-{mode}", workdir, role="decode", transport=TRANSPORT, mode=mode,
            page_size=PAGE, tp=2,
        )  # fmt: skip
        decode[mode] = server
        spools[server.name] = spool
    with serving_all([p for p, _ in prefill.values()] + list(decode.values())):
        yield TPBed(prefill, decode, spools)


def rank_counter(bed: TPBed, server: str, rank: int, name: str, **labels: str) -> float:
    series = bed.spool(server).latest_counters(rank).get(name, {})
    return sum(v for k, v in series.items() if all(dict(k).get(a) == b for a, b in labels.items()))


def settled(bed: TPBed, server: str, name: str, at_least: float, **labels: str) -> list[float]:
    """The counter on each decode rank, once every rank's reaches ``at_least`` (the hooks
    flush their counters every second)."""
    deadline = time.monotonic() + SPOOL_WAIT_S
    while True:
        seen = [rank_counter(bed, server, r, name, **labels) for r in (0, 1)]
        if min(seen) >= at_least or time.monotonic() > deadline:
            return seen
        time.sleep(0.5)


def described(bed: TPBed, server: str) -> list[tuple[str, str, str, int]]:
    spool = bed.spool(server)
    ranks = spool.ranks()
    return [(e["detector"], e["kind"], e["action"], ranks[e["producer"]]) for e in spool.events()]


def test_tp2_to_tp2_clean_traffic_is_verified_on_every_decode_rank(bed: TPBed) -> None:
    outputs = {}
    for text in TEXTS:
        for mode in ("log", "enforce"):
            served = bed.pd(2, mode, text)
            assert served.status == 200, f"{mode}: {served.body}"
            outputs.setdefault(text, served.output_ids)
            assert served.output_ids == outputs[text], mode
    for mode in ("log", "enforce"):
        server = f"decode-{mode}"
        seen = settled(bed, server, "verifications", len(TEXTS), detector="checksum")
        assert min(seen) >= len(TEXTS), (server, seen)
        for rank in (0, 1):
            skipped = rank_counter(bed, server, rank, "verifications_skipped", detector="checksum")
            assert skipped == 0, (server, rank)
    for name in bed.spools:
        assert described(bed, name) == [], name


def test_tp1_to_tp2_is_no_finding_and_an_unverified_rank_is_counted(bed: TPBed) -> None:
    expected = [bed.pd(2, "log", text).output_ids for text in TEXTS]
    server = "decode-log"
    before = [
        rank_counter(bed, server, r, "verifications_skipped", reason="unsupported_layout")
        for r in (0, 1)
    ]
    for text, want in zip(TEXTS, expected, strict=True):
        served = bed.pd(1, "log", text)
        assert served.status == 200, served.body
        assert served.output_ids == want  # the KV moved right: the same reply as TP 2 -> 2
    seen = settled(
        bed, server, "verifications_skipped", before[0] + len(TEXTS), reason="unsupported_layout"
    )
    assert [s - b for s, b in zip(seen, before, strict=True)] == [len(TEXTS)] * 2, seen
    assert described(bed, server) == []
    assert described(bed, "prefill-tp1") == []


def corrupted(bed: TPBed, mode: str, words: int) -> tuple[Reply, list[tuple[Any, ...]]]:
    server = f"decode-{mode}"
    before = len(bed.spool(server).events())
    rid = f"{MARK}-rank1-{mode}"
    served = bed.pd(2, mode, f"{mode} tp " + prompt(31, words), rid=rid)
    deadline = time.monotonic() + SPOOL_WAIT_S
    while len(bed.spool(server).events()) == before and time.monotonic() < deadline:
        time.sleep(0.5)
    return served, described(bed, server)[before:]


def test_one_ranks_corrupted_shard_is_its_finding_in_log_mode(bed: TPBed) -> None:
    served, new = corrupted(bed, "log", 40)
    assert served.status == 200, served.body
    assert new == [("checksum", "digest", "logged", 1)], new


def test_in_enforce_one_ranks_failed_shard_fails_the_request_on_every_rank(bed: TPBed) -> None:
    started = time.monotonic()
    served, new = corrupted(bed, "enforce", 45)
    # Failed on rank 0 too (it answers the client) on rank 1's verdict; nobody hung.
    assert served.status != 200 and KVWATCH_ABORT in served.body, served
    assert time.monotonic() - started < 60
    assert new == [("checksum", "digest", "enforced", 1)], new
    again = bed.pd(2, "enforce", TEXTS[0])
    assert again.status == 200, again.body
