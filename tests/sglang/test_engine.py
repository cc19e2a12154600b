"""Start-up gauges, SGLang's own detectors harvested, and the records reaching the daemon."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import time
import types
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_hooks.sglang import compat, hooks_engine
from tests.sglang import sgl
from tests.sglang.bed import Bed

REPO = Path(__file__).resolve().parents[2]
MAIN_PYTHON = REPO / ".venv" / "bin" / "python"


def test_pool_versus_context_and_engine_identity(kv: Any) -> None:
    from sglang.srt.server_args import ServerArgs

    wanted = {
        "model_path": "zai-org/GLM-5.3",
        "served_model_name": "glm-5.3",
        "disaggregation_mode": "decode",
        "disaggregation_transfer_backend": "mooncake",
        "page_size": sgl.PAGE_SIZE,
        "kv_canary": "log",
        "disaggregation_enable_kv_checksum": True,  # v0.5.21+
    }
    known = set(getattr(ServerArgs, "__struct_fields__", ())) or {
        f.name for f in dataclasses.fields(ServerArgs)
    }
    server_args = ServerArgs(**{k: v for k, v in wanted.items() if k in known})
    checksum_flag = "disaggregation_enable_kv_checksum" in known
    # SGLang's Scheduler.__init__(server_args, port_args), stopped at its first step (the rest
    # loads a model): the BEFORE hook has run by then, ahead of the pool build.
    from sglang.srt.managers.scheduler import Scheduler

    class StopInitError(Exception):
        pass

    def stop(self: Any) -> None:
        raise StopInitError

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Scheduler, "init_startup_timing_begin", stop, raising=False)
        # (server_args, port_args); v0.5.19 also takes the ranks, all 0 on one rank.
        ranks = [0] * (len(inspect.signature(Scheduler.__init__).parameters) - 3)
        with pytest.raises(StopInitError):
            Scheduler(server_args, None, *ranks)
    sgl.allocator(sgl.mha_pool())  # the pool is built after the role is known
    hooks_engine.report_pool(681_280, 1_048_576, sgl.PAGE_SIZE)
    contents = sgl.spool(kv)
    hello = next(r for r in contents.records if r["type"] == "hello")
    assert (hello["engine"], hello["role"], hello["model"], hello["rank"]) == (
        "sglang",
        "decode",
        "glm-5.3",
        0,
    )
    assert hello["engine_version"] == compat.sglang_version()
    assert hello["transfer_backend"] == "mooncake" and hello["kv_checksum"] is checksum_flag
    gauges = [r for r in contents.records if r["type"] == "gauges"][-1]["gauges"]
    assert ["kv_pool_tokens", {}, 681_280] in gauges
    assert ["context_length_tokens", {}, 1_048_576] in gauges


def test_sglang_kv_canary_violation_becomes_an_event_without_token_ids(kv: Any) -> None:
    # Whether the release has the point, not whether a hook got attached: a missing hook
    # must fail this test, not skip it.
    if not compat.exists(compat.CANARY_REPORTER + "._format_violation"):
        pytest.skip("this release has no kv-canary")
    from sglang.kernels.ops.kv_canary.consts import FailReason, RealKvHashMode
    from sglang.kernels.ops.kv_canary.verify import CanaryLaunchTag
    from sglang.srt.kv_canary.config import CanaryConfig, CanaryMode
    from sglang.srt.kv_canary.runner.violation_reporter import ViolationReporter
    from sglang.srt.kv_canary.state import CanaryDeviceState

    config = CanaryConfig(
        mode=CanaryMode.LOG,
        ring_capacity=8,
        sweep_interval=0,
        real_kv_hash_mode=next(iter(RealKvHashMode)),
        enable_write_input_assert=False,
        enable_verify_token_assert=False,
        stats_print_every_n_steps=0,
    )
    state = CanaryDeviceState.allocate(
        config=config, device=torch.device("cpu"), num_tags=len(CanaryLaunchTag)
    )
    # What SGLang's verify kernel writes into the ring when a slot's stored token is wrong.
    tag = next(iter(CanaryLaunchTag))
    bits = int(FailReason.VERIFY_TOKEN_MISMATCH)
    state.violation_log.violation_ring[0] = torch.tensor(
        [int(tag), 77, 5, 424242, 313131, 0, 0, bits]
    )
    state.violation_log.violation_write_index[0] = 1
    ViolationReporter(config=config, device_state=state).log_or_raise_violation(
        outer_step_counter=9
    )
    contents = sgl.spool(kv)
    events = contents.events(detector="engine_canary")
    assert len(events) == 1
    assert events[0]["detail"]["fail_reason"] == "verify_token_mismatch"
    assert events[0]["detail"]["slot"] == 77
    assert sgl.counter(contents, "mismatches", detector="engine_canary", kind="other") == 1
    raw = b"".join(p.read_bytes() for p in Path(kv.settings.spool).iterdir())
    assert b"424242" not in raw and b"313131" not in raw  # stored/expected token ids


def test_sglang_kv_checksum_coverage_and_mismatch(kv: Any) -> None:
    if not compat.exists(compat.DECODE_MIXIN + "._verify_kv_checksums"):
        pytest.skip("this release has no --disaggregation-enable-kv-checksum")
    from sglang.srt.disaggregation.decode import SchedulerDisaggregationDecodeMixin as Mixin

    reqs = [sgl.request("a"), sgl.request("b")]
    # Checksum off on this node (kv_checksum_computer is None): both requests skip it.
    off = types.SimpleNamespace(kv_checksum_computer=None)
    Mixin._verify_kv_checksums(off, sgl.batch(reqs))
    # A mismatch (the digest compare itself needs CUDA): SGLang's own handler, on a decode
    # scheduler holding the request, aborts it and releases its KV. SGLang raises instead in CI
    # unless the mismatch was injected, as its own injection knob says this one is.
    with Bed(page_size=16, radix=False) as bed, pytest.MonkeyPatch.context() as patch:
        patch.setenv("SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB", "0.5")
        req = bed.request("b", list(range(1, 33)))
        assert bed.arrive(req)
        bed.reserve(req)
        bed.transfer(req)
        free = bed.allocator.available_size()
        Mixin._handle_kv_checksum_mismatch(bed.scheduler, req, "KV checksum mismatch")
        assert req.finished() and bed.allocator.available_size() > free
    contents = sgl.spool(kv)
    skipped = sgl.counter(
        contents, "verifications_skipped", detector="engine_checksum", reason="mode_off"
    )
    assert skipped == 2
    events = contents.events(detector="engine_checksum", kind="digest")
    assert [(e["request_id"], e["action"]) for e in events] == [("b", "enforced")]
    assert events[0]["instance"] == kv.instance_of(req)


def _start_daemon(tmp: Path, spool: str) -> tuple[subprocess.Popen[bytes], Path, int]:
    log = tmp / "daemon.log"
    args = [str(MAIN_PYTHON), "-m", "kvwatch.cli", "daemon", "--spool-dir", spool]
    args += ["--journal", str(tmp / "journal.db"), "--listen", "127.0.0.1:0", "--no-nvml"]
    args += ["--poll-interval", "0.05s"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("{") and '"daemon.started"' in line:
                return proc, log, int(str(json.loads(line)["listen"]).rsplit(":", 1)[1])
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"kvwatch daemon did not start: {log.read_text()[-2000:]}")


def test_records_reach_the_daemon_metrics(kv: Any, tmp_path: Path) -> None:
    if not MAIN_PYTHON.exists():
        pytest.fail("no main .venv: the daemon runs there (it needs no torch); run make test")
    probe = subprocess.run([str(MAIN_PYTHON), "-c", "import kvwatch.daemon"], cwd=REPO, check=False)
    if probe.returncode != 0:
        pytest.fail("the kvwatch daemon is not importable in .venv")
    pool = sgl.mha_pool()
    alloc = sgl.allocator(pool)
    pages = sgl.pages_of(alloc.alloc(8))
    alloc.free(torch.tensor([p * sgl.PAGE_SIZE for p in pages]))
    sgl.write_page(pool, pages[0])
    alloc.alloc(8)
    hooks_engine.report_pool(681_280, 1_048_576, sgl.PAGE_SIZE)
    sgl.spool(kv)  # flush
    proc, _log, port = _start_daemon(tmp_path, kv.settings.spool)
    try:
        wanted = ('detector="canary"', 'kind="write_to_free_page"')
        deadline = time.monotonic() + 20
        text = ""
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
            lines = [ln for ln in text.splitlines() if ln.startswith("kvwatch_mismatches_total{")]
            if any(all(w in ln for w in wanted) and not ln.endswith(" 0.0") for ln in lines):
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"no canary mismatch in /metrics:\n{text[-3000:]}")
        assert any(
            ln.startswith("kvwatch_kv_pool_tokens") and ln.endswith(" 681280.0")
            for ln in text.splitlines()
        ), text[-3000:]
        assert 'engine="sglang"' in text
    finally:
        proc.terminate()
        proc.wait(timeout=10)
