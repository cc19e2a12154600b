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


#: A model directory holding only its Hugging Face config: SGLang's own ``ModelConfig`` reads
#: the context length from it (no weights are loaded: the model worker is a stand-in).
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "max_position_embeddings": 1_048_576,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "torch_dtype": "bfloat16",
}

#: ``Scheduler.__init__`` steps that need what this CPU stage lacks, replaced by no-ops: ZMQ
#: sockets to the tokenizer and detokenizer (ipc channels, request receiver, output streamer,
#: KV-event publisher), torch.distributed groups (profiler, weight updater, dp-attention
#: adapter, grammar manager's first rank, request dispatcher), the loaded model runner (overlap
#: and its future map, n-gram embedding, the batch-result processor and the timing summary that
#: read them), the disaggregation KV manager (a transfer engine), and the observers that read
#: those. Names absent from a release are skipped; a step not named here runs for real.
NO_OP_STEPS = (
    "init_ipc_channels",
    "init_request_receiver",
    "init_output_streamer",
    "init_kv_events_publisher",
    "init_running_status",
    "init_profiler",
    "init_weight_updater",
    "init_dp_attn_adapter",
    "init_grammar_manager",
    "init_request_dispatcher",
    "init_overlap",
    "maybe_init_ngram_embedding",
    "init_batch_result_processor",
    "init_startup_timing_summary",
    "init_disaggregation",
    "init_pool_stats_observer",
    "init_invariant_checker",
    "init_load_inquirer",
)


def _start_scheduler(server_args: Any) -> Any:
    """SGLang's own ``Scheduler.__init__`` run to its end (hooks included, by the registry),
    with the steps that load a model or open sockets and process groups replaced."""
    import types as t

    from sglang.srt import runtime_context as rc
    from sglang.srt.managers import scheduler as module
    from sglang.srt.managers.scheduler import Scheduler

    built: list[Any] = []

    def model_worker(self: Any) -> None:
        # What init_model_worker leaves after loading weights and sizing the KV pool: the pool
        # and its allocator, built here as there (after the BEFORE hook knows the role).
        allocator = sgl.allocator(sgl.mha_pool())
        built.append(allocator)
        runner = t.SimpleNamespace(canary_manager=None, token_to_kv_pool_allocator=allocator)
        self.tp_worker = self.model_worker = t.SimpleNamespace(
            model_runner=runner, weight_load_time=0.0, graph_time_usage=0.0
        )
        self.draft_worker = None
        self.kv_cache_allocation_time = 0.0
        self.max_total_num_tokens = allocator.size
        self.max_prefill_tokens = 16384
        self.max_running_requests = self.max_queued_requests = 8
        self.max_req_len = self.max_req_input_len = self.model_config.context_len - 1
        self.random_seed, self.device, self.forward_stream = 1, "cpu", None
        self.min_free_slots_delayer = self.pad_input_ids_func = None
        group = t.SimpleNamespace(cpu_group=None, world_size=1, rank_in_group=0)
        for name in ("tp", "attn_tp", "attn_cp", "pp", "world", "dp_tp"):
            setattr(self, f"{name}_group", group)
            setattr(self, f"{name}_cpu_group", None)

    def kv_cache(**_: Any) -> Any:
        # What build_kv_cache returns: the pool and allocator init_model_worker sized.
        allocator = built[-1]
        return t.SimpleNamespace(
            is_hybrid_swa=False,
            is_hybrid_ssm=False,
            sliding_window_size=None,
            full_tokens_per_layer=allocator.size,
            swa_tokens_per_layer=None,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=allocator,
            disable_radix_cache=True,
            tree_cache=None,
        )

    with pytest.MonkeyPatch.context() as patch:
        # A context of its own, published the way SGLang's launcher does, so the session's
        # overrides survive the test.
        context = rc.RuntimeContext(parallel=rc.ParallelContext())
        patch.setattr(rc, "_CONTEXT", context)
        patch.setattr(rc, "_PARALLEL", context.parallel)
        if hasattr(rc, "SpawnRanks"):
            rc.publish(server_args, role="scheduler", ranks=rc.SpawnRanks(world_rank=0, gpu_id=0))
        else:
            rc.publish(server_args, role="scheduler")
        patch.setattr(Scheduler, "init_model_worker", model_worker)
        for name in NO_OP_STEPS:
            patch.setattr(Scheduler, name, lambda self, *a, **k: None, raising=False)
        if hasattr(module, "bootstrap"):  # torch.distributed and the model's layer runtime
            patch.setattr(module.bootstrap, "init_parallel_runtime", lambda **k: None)
            patch.setattr(module.bootstrap, "init_layer_runtime", lambda **k: None)
        if hasattr(module, "kv_cache_builder"):
            patch.setattr(module.kv_cache_builder, "build_kv_cache", kv_cache)
        # (server_args, port_args); v0.5.19 also takes the ranks, all 0 on one rank.
        ranks = [0] * (len(inspect.signature(Scheduler.__init__).parameters) - 3)
        return Scheduler(server_args, t.SimpleNamespace(nccl_port=0), *ranks)


def test_pool_versus_context_and_engine_identity(kv: Any, tmp_path: Path) -> None:
    from sglang.srt.server_args import ServerArgs

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    wanted = {
        "model_path": str(model),
        "served_model_name": "glm-5.3",
        "skip_tokenizer_init": True,
        "device": "cpu",
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
    scheduler = _start_scheduler(server_args)
    assert scheduler.is_initializing is False  # __init__ ran to its last line
    assert scheduler.model_config.context_len == 1_048_576  # SGLang's own ModelConfig
    contents = sgl.spool(kv)
    hello = next(r for r in contents.records if r["type"] == "hello")
    assert (hello["engine"], hello["role"], hello["model"], hello["rank"]) == (
        "sglang",
        "decode",
        "glm-5.3",
        0,
    )
    assert hello["engine_version"] == compat.sglang_version()
    # The engine's PD settings reach the spool with it, through the typed reader.
    assert hello["transfer_backend"] == "mooncake" and hello["kv_checksum"] is checksum_flag
    assert hello["disaggregation_mode"] == "decode" and hello["page_size"] == sgl.PAGE_SIZE
    gauges = [r for r in contents.records if r["type"] == "gauges"][-1]["gauges"]
    assert ["kv_pool_tokens", {}, sgl.SIZE] in gauges
    assert ["context_length_tokens", {}, 1_048_576] in gauges
    assert ["page_size_tokens", {}, sgl.PAGE_SIZE] in gauges


def test_sglang_kv_canary_violation_becomes_an_event_without_token_ids(kv: Any) -> None:
    # Whether the release has the point, not whether a hook got attached: a missing hook
    # must fail this test, not skip it.
    present = compat.exists(compat.CANARY_REPORTER + "._format_violation")
    sgl.needs("0.5.22", present, "--kv-canary")
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
    present = compat.exists(compat.DECODE_MIXIN + "._verify_kv_checksums")
    sgl.needs("0.5.21", present, "--disaggregation-enable-kv-checksum")
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
