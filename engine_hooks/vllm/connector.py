# mypy: allow-subclassing-any, disable-error-code="import-not-found"
"""``KVWatchConnector``: kvwatch as a vLLM v1 KV connector.

Add it as a ``MultiConnector`` child beside the connector that moves KV (``NixlConnector``, or a
synchronous one such as ``ExampleConnector``), in any position: it returns 0 matched tokens, so
the other connector stays the one that loads, and its pre-forward work runs in
``bind_connector_metadata``, which vLLM calls on every child before any child's
``start_load_kv``. It transfers nothing, requires no KV layout, claims no async save, supports the
hybrid KV cache manager interface (verifying single-group models; hybrid models are counted as
``unsupported_layout``), and answers every capability ``MultiConnector`` aggregates with the
neutral value, so adding it changes nothing else.

Every method returns at once and never raises into vLLM: a failure is counted as
``hook_errors{hook}`` (and shows in the spool), and the method returns what a connector that does
nothing would return.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from engine_hooks import DEFAULT_SPOOL_DIR, KVWatch, Mode, Scrub
from engine_hooks.heads import head_range
from engine_hooks.labels import Detector, Hook, Skip
from engine_hooks.options import Options
from engine_hooks.takers import DEFAULT_FREED_WATCH_S
from engine_hooks.vllm.guard import logger, safe
from engine_hooks.vllm.layout import dtype_name, head_views, kv_pool
from engine_hooks.vllm.layout import signature as layout_signature
from engine_hooks.vllm.metadata import KVWatchMetadata
from engine_hooks.vllm.scheduler import SchedulerSide
from engine_hooks.vllm.worker import WorkerSide
from kvspool.catalogue import HOOKED_DETECTORS

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "unified"}
#: The keys of the kvwatch child's ``kv_connector_extra_config`` (engine_hooks/vllm/README.md).
_OPTIONS: Final = frozenset(
    {"spool", "mode", "role", "model", "resolve_interval_s", "node", "transport"}
    | {"freed_watch_s", "scrub"}
)


def _modes(check: Options, where: str, value: Any) -> Mode | dict[str, Mode]:
    """The ``mode`` option: one mode, or per detector (``{"default": "log", "checksum":
    "enforce"}``), each value checked."""
    if not isinstance(value, Mapping):
        return check.mode("mode", where, value, Mode.LOG)
    default = check.mode("mode", f"{where}.default", value.get("default", "log"), Mode.LOG)
    out: dict[str, Mode] = {"default": default}
    names = set(HOOKED_DETECTORS)
    check.unknown(set(map(str, value)) - names - {"default"}, names | {"default"}, f"{where}.")
    for name in HOOKED_DETECTORS:
        if name in value:
            out[name] = check.mode(f"mode_{name}", f"{where}.{name}", value[name], default)
    return out


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:
        return ""


class KVWatchConnector(KVConnectorBase_V1, SupportsHMA):
    """kvwatch's detectors as a KV connector: seal on prefill, verify on decode."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        extra: dict[str, Any] = dict(ktc.kv_connector_extra_config or {})
        self.engine_role = str(extra.get("role") or _ROLES.get(str(ktc.kv_role), "unified"))
        model_config = getattr(vllm_config, "model_config", None)
        self.model = str(extra.get("model") or getattr(model_config, "served_model_name", "") or "")
        spool = extra.get("spool", DEFAULT_SPOOL_DIR)
        self.spool_dir: str | None = str(spool) if spool else None
        # Each option checked (engine_hooks.options): a bad one is an error line and a config
        # error on this process's hellos, never a silent default.
        check = Options(logger)
        where = "kv_connector_extra_config."
        check.unknown(set(extra) - _OPTIONS, _OPTIONS, where)
        self.mode = _modes(check, where + "mode", extra.get("mode", "log"))
        self.scrub = check.scrub("scrub", where + "scrub", extra.get("scrub", Scrub.OFF))
        self.resolve_interval = check.seconds(
            "resolve_interval_s",
            where + "resolve_interval_s",
            extra.get("resolve_interval_s", 1.0),
            1.0,
            0.0,
        )
        # Who this engine is to its peers (their findings name it), and the transport's name.
        self.node = str(extra.get("node") or socket.gethostname())[:128]
        self.transport = str(extra.get("transport") or "")
        self.freed_watch_s = check.seconds(
            "freed_watch_s",
            where + "freed_watch_s",
            extra.get("freed_watch_s", DEFAULT_FREED_WATCH_S),
            DEFAULT_FREED_WATCH_S,
            0.0,
        )
        self.config_errors = tuple(check.errors)
        self.rank = _tp_rank(vllm_config)
        parallel = getattr(vllm_config, "parallel_config", None)
        self.tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        self.cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
        groups = kv_cache_config.kv_cache_groups
        spec = groups[0].kv_cache_spec if groups else None
        self.block_size = int(getattr(spec, "block_size", 0) or 0)
        dtype = getattr(spec, "dtype", None)
        self.kv_dtype = dtype if isinstance(dtype, torch.dtype) else None
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.single_group = len(groups) == 1
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self.watch: KVWatch | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._start_scheduler(model_config)

    # -- set-up ---------------------------------------------------------------------------------

    def _new_watch(self, pool: Any) -> KVWatch:
        return KVWatch(
            pool,
            role=self.engine_role,
            engine="vllm",
            engine_version=_vllm_version(),
            model=self.model,
            rank=self.rank,
            mode=self.mode,
            spool=self.spool_dir,
            scrub=self.scrub,
            config_errors=self.config_errors,
        )

    @safe(Hook.STARTUP)
    def _start_scheduler(self, model_config: Any) -> None:
        self.watch = self._new_watch(None)
        identity = {"node": self.node, "engine_id": str(self._kv_transfer_config.engine_id)}
        self.scheduler = SchedulerSide(
            self.num_blocks, self.block_size, self.tp_size, identity, self.transport
        )
        max_len = getattr(model_config, "max_model_len", None)
        if max_len and self.block_size:
            # Block 0 is the null block: the pool holds num_blocks - 1 usable blocks.
            pool_tokens = (self.num_blocks - 1) * self.block_size
            self.watch.report_pool(pool_tokens, int(max_len), self.block_size)

    # -- worker side ----------------------------------------------------------------------------

    @safe(Hook.STARTUP)
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        pool, signature = None, None
        if self.single_group and self.block_size:
            local = head_views(kv_caches, self.num_blocks)
            kv_heads = self._total_kv_heads(int(local[0].shape[1]) if local else 0)
            head_start, _ = head_range(self.rank, self.tp_size, kv_heads)
            pool = kv_pool(
                kv_caches, self.num_blocks, self.block_size, self.kv_dtype, head_start=head_start
            )
            signature = layout_signature(
                kv_caches,
                self.num_blocks,
                self.block_size,
                dtype=self._dtype_name(),
                kv_heads=kv_heads,
                head_start=head_start,
            )
        self.watch = self._new_watch(pool)
        if pool is None:
            for detector in (Detector.CANARY, Detector.CHECKSUM, Detector.PAGE_TAG):
                self.watch.skip(detector, Skip.UNSUPPORTED_LAYOUT)
            return
        self.worker = WorkerSide(self.watch, pool, self.rank, self.resolve_interval, signature)
        if self.engine_role != "decode":
            self.worker.watch_lease_expiry(self.freed_watch_s)

    def _total_kv_heads(self, local: int) -> int:
        """The model's KV heads (every rank's), from vLLM's model config; else this rank's
        times the TP width."""
        model_config = getattr(self._vllm_config, "model_config", None)
        try:
            return int(model_config.get_total_num_kv_heads())  # type: ignore[union-attr]
        except Exception:
            return local * self.tp_size

    def _dtype_name(self) -> str:
        """What a KV element is (:func:`layout.dtype_name`)."""
        return dtype_name(self.cache_dtype, self.kv_dtype)

    @safe(Hook.VERIFY)
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # The one worker hook that vLLM's model runners call before the forward in every step
        # (start_load_kv runs after it when no load is synchronous): see worker.py.
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, KVWatchMetadata):
            self.worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return  # kvwatch loads nothing; its pre-forward work is in bind_connector_metadata

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    @safe(Hook.SEAL)
    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.save()

    @safe(Hook.VERIFY, set)
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    @safe(Hook.SEAL)
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.worker_meta() if self.worker is not None else None

    @safe(Hook.STARTUP)
    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.watch is not None:
            self.watch.close()

    # -- scheduler side -------------------------------------------------------------------------

    @safe(Hook.STARTUP)
    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.ledger.attach(gpu_block_pool)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # MultiConnector asks every child, with the tokens decode's own prefix cache holds: the
        # KV from another engine starts there.
        self._local_hit(request, num_computed_tokens)
        return 0, False

    @safe(Hook.RESERVE)
    def _local_hit(self, request: Any, num_computed_tokens: int) -> None:
        if self.scheduler is not None:
            self.scheduler.local_hit(request, num_computed_tokens)

    @safe(Hook.RESERVE)
    def on_new_request(self, request: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.on_new_request(request)

    @safe(Hook.RESERVE)
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.scheduler is not None:
            self.scheduler.update_state_after_alloc(request, blocks)

    @safe(Hook.SEAL, KVWatchMetadata)
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self.scheduler is None:
            return KVWatchMetadata()
        meta = self.scheduler.build(scheduler_output)
        self._count_skips()
        return meta

    @safe(Hook.SEAL)
    def update_connector_output(self, connector_output: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, self._finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, self._finished(request, block_ids)

    @safe(Hook.SEAL)
    def _finished(self, request: Any, block_ids: tuple[list[int], ...]) -> dict[str, Any] | None:
        if self.scheduler is None:
            return None
        return self.scheduler.request_finished(request, block_ids)

    def _count_skips(self) -> None:
        assert self.scheduler is not None and self.watch is not None
        skips, self.scheduler.skips = self.scheduler.skips, []
        for reason in skips:
            self.watch.skip(Detector.CHECKSUM, reason)
        if self.scheduler.ledger.errors:
            self.watch.hook_failed(Hook.ALLOC, self.scheduler.ledger.errors)
            self.scheduler.ledger.errors = 0

    # -- what vLLM asks of every connector ------------------------------------------------------

    # MultiConnector aggregates these over its children (all() / any()): kvwatch answers with
    # the value that leaves the aggregate what the other children make it.
    @property
    def requires_kv_delivery(self) -> bool:
        return False  # kvwatch hands no KV off (any())

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return True  # kvwatch has no external hits to complete (all())

    # get_required_kvcache_layout: the base class's None (kvwatch reads any block-dense layout).


def _tp_rank(vllm_config: Any) -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return int(getattr(getattr(vllm_config, "parallel_config", None), "rank", 0) or 0)
