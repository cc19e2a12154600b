"""A decode server's KV side built from SGLang's own classes, driven through SGLang's own methods.

What runs is SGLang's: the decode door (``DecodePreallocQueue.add``, the release's own body), the
prefix match and ``_pre_alloc`` that reserve a request's pages, ``ScheduleBatch``'s
``prepare_for_prebuilt`` and ``process_prebuilt`` (the radix tree's insert on admission),
``Scheduler.process_batch_result`` with the release's own result processor (finish, release,
the tree's checkpoint), ``prepare_for_decode`` (``alloc_decode``) and ``filter_batch`` /
``merge_batch``. kvwatch's hooks are on because SGLang's ``load_plugins()`` put them there: the
tests never call a hook.

What stands in, because it needs a model, a GPU or a network and holds no KV state: the KV
transfer (SGLang's own fake transport, ``TransferBackend.FAKE``, and :meth:`Bed.transfer`
writing the pages as prefill's RDMA would), the model forward (:meth:`Bed.step` writes the
step's KV slots), and the scheduler's metrics and load publishing (no-ops).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import types
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from engine_hooks.sglang import compat

#: Token slots per page the PD tests use (SGLang's ``--page-size``).
PAGE_SIZES = (16, 64)

#: v0.5.19's ``alloc_extend`` / ``alloc_decode`` are Triton kernels only: on a CPU they run in
#: Triton's interpreter (``conftest.py`` turns it on for such a release); v0.5.22+ fall back to
#: torch off CUDA.
NATIVE_DECODE_ON_CPU = compat.version_tuple(compat.sglang_version()) >= (0, 5, 22)
DECODE_ON_CPU = NATIVE_DECODE_ON_CPU or os.environ.get("TRITON_INTERPRET") == "1"
NO_DECODE_ON_CPU = "this release's alloc_extend/alloc_decode are Triton-only (need a GPU)"


class _Quiet:
    """The scheduler's metrics reporter and load publisher: counts nothing, publishes nothing."""

    num_generated_tokens = 0
    forward_ct_decode = 0
    decode_log_interval = 1 << 30
    enable_metrics = False

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class Streamer:
    """The scheduler's output streamer: remembers which requests it finished."""

    def __init__(self) -> None:
        self.finished: list[Any] = []

    def stream_output(self, reqs: Iterable[Any], return_logprob: Any = False, *a: Any) -> None:
        self.finished.extend(r for r in reqs if r.finished())


def _model_config() -> Any:
    # The few model facts the batch code reads; no weights.
    return types.SimpleNamespace(
        vocab_size=32000,
        is_encoder_decoder=False,
        is_multimodal=False,
        hf_eos_token_id=None,
        self_opened_think_start_ids=None,
        think_end_ids=None,
    )


def _same(batch: Any, *args: Any, **kwargs: Any) -> Any:
    return batch


def _no_spec() -> Any:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SpeculativeAlgorithm.NONE


class Bed:
    """One decode process's KV side: pool, allocator, rows, tree, prealloc queue, scheduler."""

    def __init__(
        self,
        *,
        page_size: int,
        radix: bool,
        pages: int = 64,
        rows: int = 64,
        context: int = 2048,
        kind: str = "mha",
    ) -> None:
        from sglang.srt.runtime_context import get_context

        # What `--disaggregation-mode decode [--disaggregation-decode-enable-radix-cache]
        # --page-size N` publishes: the radix cache stays disabled in decode unless asked for.
        from sglang.srt.server_args import ServerArgs

        fields: dict[str, Any] = dict(
            disaggregation_mode="decode",
            disaggregation_decode_enable_radix_cache=radix,
            disable_radix_cache=not radix,
            page_size=page_size,
        )
        # Retraction keeps a host copy of the request's KV (what SGLang resolves for this pool
        # at start-up; v0.5.23 publishes the choice, older releases have only this backend).
        known = getattr(ServerArgs, "__struct_fields__", None) or {
            f.name for f in dataclasses.fields(ServerArgs)
        }
        if "disaggregation_decode_retraction_backup" in known:
            fields["disaggregation_decode_retraction_backup"] = "cpu_tensor"
        self._config = get_context().override_server_args(**fields)
        server_args = self._config.install()
        try:
            self._build(server_args, page_size, radix, pages, rows, context, kind)
        except BaseException:
            self._config.restore()
            raise

    def _build(
        self,
        server_args: Any,
        page_size: int,
        radix: bool,
        pages: int,
        rows: int,
        context: int,
        kind: str,
    ) -> None:
        from sglang.srt.disaggregation.base.conn import KVArgs
        from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeReqToTokenPool
        from sglang.srt.disaggregation.fake.conn import FakeKVManager
        from sglang.srt.disaggregation.utils import DisaggregationMode, TransferBackend
        from sglang.srt.managers.overlap_utils import FutureMap
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.mem_cache import registry
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

        self.page_size = page_size
        self.radix = radix
        size = pages * page_size
        common = dict(
            size=size,
            page_size=page_size,
            dtype=torch.bfloat16,
            layer_num=2,
            device="cpu",
            enable_memory_saver=False,
        )
        if kind == "mha":
            self.pool = MHATokenToKVPool(head_num=2, head_dim=8, **common)
        else:
            self.pool = MLATokenToKVPool(kv_lora_rank=16, qk_rope_head_dim=8, **common)
        # need_sort as SGLang sets it in PD mode (prefill and decode).
        if page_size == 1:
            self.allocator = TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", self.pool, True)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                size, page_size, torch.bfloat16, "cpu", self.pool, True
            )
        self.rows = DecodeReqToTokenPool(
            size=rows,
            max_context_len=context,
            device="cpu",
            enable_memory_saver=False,
            pre_alloc_size=rows,
        )
        params = CacheInitParams(
            disable=not radix,
            req_to_token_pool=self.rows,
            token_to_kv_pool_allocator=self.allocator,
            page_size=page_size,
        )
        # The tree SGLang's own factory picks for these settings (the context's fields vary by
        # release: pass the ones this release declares).
        context = dict(
            server_args=server_args,
            params=params,
            is_hybrid_swa=False,
            is_hybrid_ssm=False,
            enable_hierarchical_cache=False,
            disable_radix_cache=not radix,
            tp_worker=None,
            model_config=None,
            tp_size=1,
            tp_rank=0,
            tp_group=None,
            effective_chunked_prefill_size=None,
        )
        declared = {f.name for f in dataclasses.fields(registry.TreeCacheBuildContext)}
        self.tree = registry.create_tree_cache(
            registry.TreeCacheBuildContext(**{k: v for k, v in context.items() if k in declared})
        )
        self.model_config = _model_config()
        self.streamer = Streamer()
        self.scheduler = self._scheduler(Scheduler, DisaggregationMode.DECODE, server_args)

        class Queue(DecodePreallocQueue):
            """SGLang's prealloc queue; its transport is SGLang's fake one (no network)."""

            def _init_kv_manager(self) -> Any:
                manager = FakeKVManager(KVArgs(), DisaggregationMode.DECODE, server_args)
                manager.prefill_info_table = {}
                return manager

        # By name: the constructor's parameters vary by release. No metadata buffers, transfer
        # queue or draft pool: the fake transport needs none.
        known = dict(
            req_to_token_pool=self.rows,
            token_to_kv_pool_allocator=self.allocator,
            scheduler=self.scheduler,
            tree_cache=self.tree,
            tp_rank=0,
            tp_size=1,
            dp_size=1,
            pp_rank=0,
            gpu_id=0,
            bootstrap_port=8998,
            max_total_num_tokens=size,
            num_reserved_decode_tokens=0,
            transfer_backend=TransferBackend.FAKE,
            # Transfers complete at once here (bed.transfer): none is ever in flight.
            transfer_queue=types.SimpleNamespace(queue=[], enable_staging=False),
        )
        names = list(inspect.signature(DecodePreallocQueue.__init__).parameters)[1:]
        self.queue = Queue(**{name: known.get(name) for name in names})
        self.scheduler.disagg_decode_prealloc_queue = self.queue
        self.future_map = FutureMap(torch.device("cpu"), _no_spec(), self.rows)
        self.scheduler.future_map = self.future_map
        self.running: Any = ScheduleBatch(reqs=[], batch_is_full=False)
        self.scheduler.running_batch = self.running
        self.dst: dict[int, torch.Tensor] = {}

    def _scheduler(self, scheduler_cls: Any, mode: Any, server_args: Any) -> Any:
        from sglang.srt.managers.scheduler_components import batch_result_processor as brp
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import (
            NewTokenRatioTracker,
        )

        scheduler = scheduler_cls.__new__(scheduler_cls)
        quiet = _Quiet()
        fields = {f.name: None for f in dataclasses.fields(brp.SchedulerBatchResultProcessor)}
        fields.update(
            is_generation=True,
            disaggregation_mode=mode,
            enable_overlap=False,
            enable_overlap_mlx=False,
            model_config=self.model_config,
            token_to_kv_pool_allocator=self.allocator,
            tree_cache=self.tree,
            req_to_token_pool=self.rows,
            metrics_reporter=quiet,
            metrics_collector=quiet,
            output_streamer=self.streamer,
            abort_request=lambda *a, **k: None,
        )
        state = {
            "batch_result_processor": brp.SchedulerBatchResultProcessor(**fields),
            "tree_cache": self.tree,
            "token_to_kv_pool_allocator": self.allocator,
            "req_to_token_pool": self.rows,
            "disaggregation_mode": mode,
            "enable_hisparse": False,
            "enable_decode_hicache": False,
            "random_seed": 0,
            "tp_worker": types.SimpleNamespace(is_hybrid_swa=False),
            "ps": types.SimpleNamespace(pp_size=1),  # v0.5.19 reads the pipeline size here
            "server_args": server_args,  # v0.5.19's _pre_alloc reads the radix setting here
            # No beam search here: the door's retire path asks it to forget no group.
            "beam_coordinator": types.SimpleNamespace(retire_group=lambda req: None),
            "output_streamer": self.streamer,
            "stream_output": self.streamer.stream_output,
            "scheduler_stage_metrics": None,
            "return_health_check_ipcs": [],
            "enable_fpm": False,
            "metrics_reporter": quiet,
            "load_publisher": quiet,
            "load_inquirer": types.SimpleNamespace(get_loads=None),
            # Metrics and load publishing only: nothing here touches KV.
            "publish_load_snapshot": lambda force=False: None,
            "_record_step_counters": lambda batch, result: None,
            # The loop's own state, as Scheduler.__init__ leaves it for this configuration.
            "waiting_queue": [],
            "max_running_requests": 1 << 20,
            "spec_algorithm": _no_spec(),
            "model_config": self.model_config,
            "enable_overlap": False,
            "enable_priority_scheduling": False,
            "enable_skip_finishing_decode": False,
            "chunked_req": None,
            "kv_checksum_computer": None,
            "forward_ct": 0,
            "last_batch": None,
            "new_token_ratio_tracker": NewTokenRatioTracker.from_config(),
            "decode_offload_manager": None,
            # No grammars, n-gram embeddings or DP attention in these models.
            "grammar_manager": types.SimpleNamespace(has_waiting_grammars=lambda: False),
            "ngram_embedding_manager": types.SimpleNamespace(prepare_for_forward=_same),
            "dp_attn_adapter": types.SimpleNamespace(maybe_prepare_mlp_sync_batch=_same),
        }
        for name, value in state.items():
            setattr(scheduler, name, value)
        return scheduler

    def close(self) -> None:
        self._config.restore()

    def __enter__(self) -> Bed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests ------------------------------------------------------------------------------

    def request(
        self, rid: str, tokens: Sequence[int], max_new_tokens: int = 8, room: int | None = None
    ) -> Any:
        """``room``: the bootstrap room the router drew (every TP rank sees the same one)."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        params = SamplingParams(max_new_tokens=max_new_tokens)
        params.normalize(None)
        # A PD request names its prefill's bootstrap server (not SGLang's fake-transfer host).
        return Req(
            rid,
            "",
            array("q", tokens),
            params,
            bootstrap_host="127.0.0.1",
            bootstrap_port=8998,
            bootstrap_room=abs(hash((rid, id(tokens)))) % (1 << 62) if room is None else room,
        )

    def arrive(self, req: Any) -> bool:
        """SGLang's decode door; True when the request entered the prealloc queue."""
        self.queue.add(req)
        return any(d.req is req for d in self.queue.queue)

    def reserve(self, req: Any) -> torch.Tensor:
        """What ``pop_preallocated`` does for a request whose prefill answered: match the decode
        radix cache and lock the prefix (radix on), then SGLang's ``_pre_alloc``."""
        from sglang.srt.runtime_context import get_disagg

        self.queue.queue = [d for d in self.queue.queue if d.req is not req]
        self.queue.pending_reqs = [d for d in self.queue.pending_reqs if d.req is not req]
        if get_disagg().disaggregation_decode_enable_radix_cache:
            match = self.queue._match_prefix_and_lock(req)
            prefix_indices = match.prefix_indices
            prefix, total = match.l1_prefix_len, match.decode_prefix_len
        else:
            prefix_indices, prefix, total = None, 0, 0
        dst: torch.Tensor = self.queue._pre_alloc(req, prefix_indices, prefix, total)
        req.kv.cache_protected_len = total
        self.dst[id(req)] = dst
        return dst

    def dst_pages(self, req: Any) -> list[int]:
        dst = self.dst[id(req)]
        return sorted({int(i) // self.page_size for i in dst.tolist()})

    def write_pages(self, pages: Iterable[int], value: float = 0.5) -> None:
        p = self.page_size
        for buf in self.buffers():
            for page in pages:
                buf[page * p : (page + 1) * p] = value

    def buffers(self) -> list[torch.Tensor]:
        k = getattr(self.pool, "k_buffer", None)
        return [*k, *self.pool.v_buffer] if k is not None else list(self.pool.kv_buffer)

    def transfer(self, req: Any, written: int | None = None, first_token: int = 11) -> None:
        """Prefill writes the reserved pages (all, or the first ``written``) and hands over the
        first output token, as the transfer's completion does."""
        pages = self.dst_pages(req)
        self.write_pages(pages if written is None else pages[:written])
        req.output_ids.append(first_token)

    # -- the decode scheduler's loop --------------------------------------------------------

    def admit(self, reqs: list[Any]) -> list[Any]:
        """Transferred requests join the waiting queue (as ``pop_transferred`` leaves them), and
        the scheduler runs one iteration: admission (``process_prebuilt``) and a decode step.
        Returns the requests finished in it (at admission, in enforce mode, among them)."""
        self.scheduler.waiting_queue.extend(reqs)
        return self.step()

    def step(self, token: int = 13) -> list[Any]:
        """One iteration of the decode event loop: resume retracted requests, then SGLang's
        ``get_next_disagg_decode_batch_to_run`` (prebuilt admission, filter, merge,
        ``update_running_batch``: retraction, ``prepare_for_decode``), the forward (this stand-in
        writes the step's KV slots) and ``process_batch_result``. Returns what finished."""
        from sglang.srt.managers.utils import GenerationBatchResult

        before = len(self.streamer.finished)
        self.scheduler.waiting_queue.extend(self.queue.resume_retracted_reqs())
        plan = self.scheduler.get_next_disagg_decode_batch_to_run(self.running)
        self.running = self.scheduler.running_batch = plan.running_batch
        batch = self.scheduler.ngram_embedding_manager.prepare_for_forward(plan.batch_to_run)
        if batch:
            for buf in self.buffers():
                buf[batch.out_cache_loc] = 0.25
            result = GenerationBatchResult(
                next_token_ids=torch.full((len(batch.reqs),), token, dtype=torch.int64)
            )
            self.scheduler.forward_ct += 1
            self.scheduler.process_batch_result(batch, result)
        self.scheduler.last_batch = batch
        return self.streamer.finished[before:]

    def idle(self) -> bool:
        return (
            self.running.is_empty()
            and not self.scheduler.waiting_queue
            and not self.queue.retracted_queue
        )

    def run_until_idle(self, limit: int = 10000) -> None:
        for _ in range(limit):
            if self.idle():
                return
            self.step()
        raise AssertionError("decode did not drain")
