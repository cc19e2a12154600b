"""Which SGLang is this, and does it have every hook point the plugin needs?

The plugin checks every hook point before it registers anything. A missing *required* point
(the allocator, the two admission doors, the abort call) means a release this plugin does not
know: it refuses with one log line and registers nothing. A missing *optional* point (SGLang's
own checksum and canary, which arrived in later releases) only leaves that feature out.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass

S = "sglang.srt."
ALLOCATOR = S + "mem_cache.allocator.paged.PagedTokenToKVPoolAllocator"
TOKEN_ALLOCATOR = S + "mem_cache.allocator.token.TokenToKVPoolAllocator"  # page size 1
POOLS = S + "mem_cache.memory_pool"
PREFILL_QUEUE = S + "disaggregation.prefill.PrefillBootstrapQueue"
DECODE_QUEUE = S + "disaggregation.decode.DecodePreallocQueue"
PREFILL_MIXIN = S + "disaggregation.prefill.SchedulerDisaggregationPrefillMixin"
TRANSFER_QUEUE = S + "disaggregation.decode.DecodeTransferQueue"
DECODE_MIXIN = S + "disaggregation.decode.SchedulerDisaggregationDecodeMixin"
BATCH_MIXIN = (
    S + "disaggregation.decode_schedule_batch_mixin.ScheduleBatchDisaggregationDecodeMixin"
)
SCHEDULER = S + "managers.scheduler.Scheduler"
REQ = S + "managers.schedule_batch.Req"
RESULTS = S + "managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
CANARY_REPORTER = S + "kv_canary.runner.violation_reporter"

#: Points the plugin cannot work without. Classes and methods checked, some not hooked.
REQUIRED = (
    ALLOCATOR + ".__init__",
    ALLOCATOR + ".alloc",
    ALLOCATOR + ".alloc_extend",
    ALLOCATOR + ".alloc_decode",
    ALLOCATOR + "._release_page_ids",
    ALLOCATOR + ".clear",
    POOLS + ".MHATokenToKVPool",
    POOLS + ".MLATokenToKVPool",
    PREFILL_QUEUE + ".add",
    DECODE_QUEUE + ".add",
    REQ + ".set_finish_with_abort",
    REQ + ".finished",
)

#: Points that add a feature where the release has them.
OPTIONAL = (
    SCHEDULER + ".__init__",  # engine info, pool versus context
    TOKEN_ALLOCATOR + ".__init__",  # page size 1: canaries and tags on token slots
    TOKEN_ALLOCATOR + ".clear",
    TOKEN_ALLOCATOR + ".alloc",
    TOKEN_ALLOCATOR + ".free",
    SCHEDULER + ".process_batch_result",  # decode step check, deferred device results
    DECODE_QUEUE + "._pre_alloc",  # decode reserves a request's pages
    BATCH_MIXIN + ".process_prebuilt",  # decode admits: verify before the KV is read
    RESULTS + ".process_batch_result_prebuilt",  # admission's results: finished requests
    PREFILL_MIXIN + ".send_kv_chunk",  # prefill seals a transfer into its metadata row
    TRANSFER_QUEUE + "._commit_transfer_to_req",  # decode reads the seal from the row
    TRANSFER_QUEUE + "._do_release",  # an aborted transfer's held pages go back
    TRANSFER_QUEUE + "._observe_deferred_kv_release",  # ... drained or timed out (v0.5.22+)
    TRANSFER_QUEUE + ".resolve_deferred_releases",  # every decode iteration: windows close
    DECODE_MIXIN + "._verify_kv_checksums",  # SGLang's own checksum (v0.5.21+)
    DECODE_MIXIN + "._handle_kv_checksum_mismatch",
    CANARY_REPORTER + "._format_violation",  # SGLang's own kv-canary (v0.5.22+)
)


def sglang_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return ""


def version_tuple(version: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in version.split("+", maxsplit=1)[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def exists(target: str) -> bool:
    """True when ``module.path.Class.attr`` (or ``module.path.attr``) resolves."""
    parts = target.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        except Exception:  # a module that fails to import for another reason
            return False
        for name in parts[split:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@dataclass(frozen=True, slots=True)
class Support:
    version: str
    missing_required: tuple[str, ...]
    present_optional: tuple[str, ...]
    missing_optional: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return bool(self.version) and not self.missing_required


def check() -> Support:
    version = sglang_version()
    if not version:
        return Support("", ("sglang (not installed)",), (), OPTIONAL)
    missing = tuple(t for t in REQUIRED if not exists(t))
    present = tuple(t for t in OPTIONAL if exists(t))
    return Support(version, missing, present, tuple(t for t in OPTIONAL if t not in present))


def short(target: str) -> str:
    return target.removeprefix(S)
