"""The catalogue: every name the hooks and the daemon agree on, defined once.

Detectors, finding kinds, skip reasons, admission queues, hooks, drop reasons, reject reasons,
roles and engines (each a fixed label value set, ``"other"`` included), the daemon's own label
values (log error reasons, collectors, GPU memory states, post results), and every counter and
gauge a producer reports with its labels, metric family and help text. The record types
(:mod:`kvspool.records`), the daemon's ``/metrics`` and state, the engine adapters and the
dashboards and alerts generators all derive from these tables; none keeps its own copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, overload

OTHER: Final = "other"


@dataclass(frozen=True, slots=True)
class Label:
    """A label and its fixed value set; a producer's other values are counted as ``other``."""

    name: str
    #: value -> what it means.
    values: dict[str, str]

    @property
    def sorted_values(self) -> tuple[str, ...]:
        return tuple(sorted(self.values))

    def bound(self, value: object) -> str:
        text = value if type(value) is str else str(value)
        return text if text in self.values else OTHER

    def check(self, value: str) -> str:
        """``value``, named in code where it is defined: a ValueError at import when it is not one
        of this label's values, so a misspelt name never reaches a counter as ``other``."""
        if value == OTHER or value not in self.values:
            known = ", ".join(v for v in self.sorted_values if v != OTHER)
            raise ValueError(f"{value!r} is not a catalogued {self.name} ({known})")
        return value


def _label(name: str, values: dict[str, str]) -> Label:
    return Label(name, {**values, OTHER: "a value outside the fixed set"})


ROLE: Final = _label(
    "role",
    {
        "prefill": "a prefill engine of a disaggregated pair",
        "decode": "a decode engine of a disaggregated pair",
        "unified": "an engine that prefills and decodes",
    },
)
ENGINE: Final = _label(
    "engine",
    {"sglang": "SGLang", "vllm": "vLLM", "minipd": "minipd, the reference PD engine"},
)
DETECTOR: Final = _label(
    "detector",
    {
        "canary": "reserved pages stamped with a canary until written",
        "checksum": "the writer seals an Adler-32 over its pages, the reader checks it",
        "page_tag": "page generations checked while a request holds them",
        "admission": "admission queues checked for aborted requests",
        "engine_canary": "the engine's own canary, where it has one",
        "engine_checksum": "the engine's own checksum, where it has one",
    },
)
#: The detectors kvwatch's engine hooks run; the other detectors are engines' own checks.
HOOKED_DETECTORS: Final = tuple(
    DETECTOR.check(name) for name in ("canary", "checksum", "page_tag", "admission")
)
KIND: Final = _label(
    "kind",
    {
        "unwritten_page": "a reserved page still holds its canary at admit: nobody wrote it",
        "write_to_free_page": "a free page's canary was overwritten before its next allocation",
        "digest": "the reader's Adler-32 over the pages differs from the writer's seal",
        "page_count": "the reader holds a different number of pages than the writer sealed",
        "layout_mismatch": "the writer's seal describes its pages' bytes (dtype, page size,"
        " layers, KV heads, head size, memory layout) differently from the reader's: intact"
        " bytes would be read wrongly",
        "stale_tag": "a page's generation changed while a request still referenced it",
        "double_free": "a page returned to the free list while already free",
        "aborted_admitted": "an aborted request passed an admission queue",
        "freed_before_read": "a sent request's pages were freed (and may be taken by other"
        " requests) before its remote reader's read was confirmed: the writer's side of a"
        " lease that expired",
        "freed_before_drain": "an aborted transfer's pages were freed on a timeout, before its"
        " writer confirmed that its writes into them had stopped, and other requests took them:"
        " a late write may put the aborted request's KV in theirs",
    },
)
#: The kinds each detector reports: the (detector, kind) pairs that can occur, the ones
#: /metrics initialises to 0 (a pair a producer reports outside them, ``other`` included, is
#: exposed as it comes). The engine hooks' detectors declare theirs from these (tested).
DETECTOR_KINDS: Final = {
    DETECTOR.check("canary"): ("unwritten_page", "write_to_free_page"),
    DETECTOR.check("checksum"): ("digest", "page_count", "layout_mismatch"),
    DETECTOR.check("page_tag"): (
        "stale_tag", "double_free", "freed_before_read", "freed_before_drain",
    ),
    DETECTOR.check("admission"): ("aborted_admitted",),
    DETECTOR.check("engine_canary"): (OTHER,),
    DETECTOR.check("engine_checksum"): ("digest",),
}  # fmt: skip
SKIP_REASON: Final = _label(
    "reason",
    {
        "mode_off": "the detector is off",
        "unsupported_layout": "the engine's KV layout is not one the detector reads",
        "no_seal": "the writer sealed no digest for the request",
        "no_pool": "no KV pool was registered",
        "hook_error": "the hook raised (counted in hook_errors as well)",
    },
)
QUEUE: Final = _label(
    "queue",
    {
        "prefill_bootstrap": "prefill's bootstrap queue",
        "decode_prealloc": "decode's preallocation queue",
    },
)
HOOK: Final = _label(
    "hook",
    {
        "alloc": "pages allocated",
        "free": "pages freed",
        "reserve": "pages reserved for a transfer",
        "seal": "the writer seals a digest",
        "verify": "the reader verifies",
        "step": "once per engine step",
        "landed": "a transfer without tags completed",
        "wrote": "a request's forward wrote its pages",
        "resolve": "device verdicts read back",
        "admission": "an admission queue is checked",
        "startup": "the hooks are installed",
        "flush": "counters and gauges written to the spool",
    },
)
DROP_REASON: Final = _label(
    "reason",
    {
        "spool_full": "the producer's segments fill the spool",
        "write_error": "the write failed (disk full, no permission)",
        "no_spool": "the spool folder does not exist (the hooks never create it: the daemon's"
        " install does)",
        "oversize": "the record is larger than MAX_RECORD_BYTES",
        "closed": "the writer was closed",
        "invalid": "the record is one the daemon would reject (its schema, or a hello or seal)",
    },
)
#: An engine's kvwatch settings, the same names for every engine (``kvwatch_engine_config_errors``):
#: its log names each as it was set (SGLang's ``KVWATCH_MODE``, the vLLM connector's ``mode``).
SETTING: Final = _label(
    "setting",
    {
        "mode": "the detectors' mode: off, log or enforce",
        **{f"mode_{name}": f"the {name} detector's own mode" for name in HOOKED_DETECTORS},
        "scrub": "when freed or reserved pages are overwritten: off, on_free or on_reserve",
        "flush_interval": "seconds between the hooks' counter and gauge records",
        "freed_watch_s": "seconds an aborted transfer's released pages are watched",
        "resolve_interval_s": "seconds between the vLLM worker's resolutions of device checks",
        "step_check": "whether the SGLang scheduler's every step is checked",
        "option": "a setting kvwatch does not know (a misspelt name)",
    },
)
#: What the detectors of one engine process run as (``kvwatch_engine_info{mode}``): ``mixed``
#: when per-detector settings differ from the engine's mode.
MODE: Final = _label(
    "mode",
    {
        "off": "no detector runs",
        "log": "findings are recorded and page; requests are not failed",
        "enforce": "findings are recorded and page, and the request is failed",
        "mixed": "detectors run in different modes (per-detector settings)",
        "none": "no kvwatch hooks say so (an engine seen only in its logs, or older hooks)",
    },
)
SCRUB: Final = _label(
    "scrub",
    {
        "off": "pages are not overwritten",
        "on_free": "pages are overwritten when freed",
        "on_reserve": "pages are overwritten when reserved",
        "none": "no kvwatch hooks say so (an engine seen only in its logs, or older hooks)",
    },
)
#: Why the daemon rejected a frame, record or file (``kvwatch_spool_rejected_total{reason}``).
REJECT_REASON: Final = Label(
    "reason",
    {
        "crc": "the payload's CRC32 does not match",
        "framing": "bytes that are not a frame (no magic): damage, resynchronised",
        "oversize": "a frame longer than MAX_RECORD_BYTES",
        "torn": "an incomplete last frame of a segment whose producer is gone",
        "malformed": "not JSON, or a field missing, of the wrong type or out of range",
        "schema": "an unknown schema version or record type",
        "producer": "a record naming another producer than its segment",
        "sequence": "a sequence number not above the last one seen (duplicate, replay)",
        "hello": "a hello that is not its segment's first record (forged or replayed)",
        "internal": "the daemon failed to store a valid record (a daemon bug): dead-lettered",
        "owner": "a segment file owned by a user not allowed to write the spool",
        "not_regular": "a segment name that is a FIFO, device, directory or symlink",
        "name": "a *.kvs file whose name is not <producer>.<index>.kvs",
    },
)
#: Why a segment in the spool is left unread (``kvwatch_spool_ignored_segments{reason}``).
IGNORED_REASON: Final = Label(
    "reason",
    {
        "owner": "its owner is neither in allowed_users nor in the spool folder's group",
        "unreadable": "the daemon may not open it (its mode or group keeps the daemon out)",
    },
)
#: How a post of the daemon's fast path to one Alertmanager ended
#: (``kvwatch_alertmanager_posts_total{result}``).
POST_RESULT: Final = Label(
    "result",
    {
        "sent": "Alertmanager accepted the alerts (HTTP 200)",
        "failed": "refused, unreachable or timed out (retried with the next resend)",
        "dropped": "the queue to that Alertmanager was full: the oldest batch was dropped",
    },
)
#: Why a line of a watched engine log was not read (``kvwatch_log_errors_total{reason}``).
LOG_ERROR_REASON: Final = Label(
    "reason",
    {
        "unparsed": "a line naming a field the parser reads, in a form it cannot read",
        "encoding": "bytes that are not UTF-8",
        "long_line": "a line longer than the parser reads, skipped",
        "read_error": "the file could not be opened, statted or read",
    },
)
#: The daemon's sources, each with its own success metric
#: (``kvwatch_collector_success{collector}``, ``kvwatch_collector_duration_seconds``).
COLLECTOR: Final = Label(
    "collector",
    {
        "spool": "the spool poll (every segment read, the journal commit)",
        "logs": "the engine logs watched",
        "nvml": "GPU memory from NVML, read at scrape time",
        "journal": "the journal's pruning",
        "incidents_log": "the incidents log's writes",
    },
)
#: ``kvwatch_gpu_memory_bytes{state}``, in NVML's order.
GPU_STATE: Final = Label(
    "state",
    {"total": "the GPU's memory", "used": "allocated", "free": "not allocated"},
)
MODES: Final = frozenset({"off", "log", "enforce"})
ACTIONS: Final = frozenset({"logged", "enforced"})


@dataclass(frozen=True, slots=True)
class Series:
    """One counter or gauge a producer reports, and the metric family the daemon sums it into."""

    #: The name in a ``counters`` / ``gauges`` record.
    name: str
    family: str
    help: str
    #: The family's labels, in order; :data:`ROLE` is filled from the producer, not the record.
    labels: tuple[Label, ...] = ()

    @property
    def record_labels(self) -> tuple[Label, ...]:
        return tuple(label for label in self.labels if label is not ROLE)

    @property
    def label_names(self) -> tuple[str, ...]:
        return tuple(label.name for label in self.labels)


COUNTER_SERIES: Final = (
    Series(
        "verifications",
        "kvwatch_verifications",
        "Requests a detector verified, summed over engine processes.",
        (DETECTOR, ROLE),
    ),
    Series(
        "verifications_skipped",
        "kvwatch_verifications_skipped",
        "Requests a detector did not verify, by reason.",
        (DETECTOR, ROLE, SKIP_REASON),
    ),
    Series(
        "mismatches",
        "kvwatch_mismatches",
        "KV integrity mismatches found by a detector: a request read pages it did not write.",
        (DETECTOR, ROLE, KIND),
    ),
    Series(
        "aborted_admissions",
        "kvwatch_aborted_admissions",
        "Aborted requests that an admission queue let through.",
        (QUEUE, ROLE),
    ),
    Series(
        "hook_seconds",
        "kvwatch_hook_seconds",
        "Time spent inside kvwatch's engine hooks.",
        (HOOK, ROLE),
    ),
    Series(
        "hook_errors",
        "kvwatch_hook_errors",
        "Exceptions caught inside kvwatch's engine hooks (the engine never sees them).",
        (HOOK, ROLE),
    ),
    Series(
        "spool_dropped",
        "kvwatch_spool_dropped_records",
        "Records the hooks could not write to the spool, by reason.",
        (DROP_REASON,),
    ),
)
GAUGE_SERIES: Final = (
    Series("kv_pool_tokens", "kvwatch_kv_pool_tokens", "Tokens the engine's KV pool holds."),
    Series(
        "context_length_tokens",
        "kvwatch_context_length_tokens",
        "The longest prompt the engine accepts (its advertised context length).",
    ),
    Series("page_size_tokens", "kvwatch_page_size_tokens", "Tokens per KV page."),
)
COUNTER_BY_NAME: Final = {series.name: series for series in COUNTER_SERIES}
GAUGE_BY_NAME: Final = {series.name: series for series in GAUGE_SERIES}

#: The unsafe band: prompt lengths that pass the context check but do not fit the KV pool.
UNSAFE_BAND_HELP: Final = (
    "Prompt lengths that pass the context check but do not fit the KV pool:"
    " max(0, context - pool). Above 0, a rejected prompt can read other users' pages."
)


#: ``Event.detail`` key of a reader's finding on transferred KV: the node that sent it
#: (``kvwatch_transfer_mismatches_total{peer}``).
PEER_NODE: Final = "peer_node"
#: Distinct peer nodes a daemon keeps as ``peer`` label values; later ones count as other.
MAX_PEERS: Final = 32


#: The labels of the families that describe an engine (its gauges, the unsafe band).
ENGINE_LABELS: Final = ("role", "engine", "model", "rank", "source")


@dataclass(frozen=True, slots=True)
class Family:
    """A metric family the daemon exposes from its own state, not summed from producers."""

    name: str
    type: str  # "counter" or "gauge"
    help: str
    labels: tuple[str, ...] = ()


#: Every other family on /metrics (with COUNTER_SERIES and GAUGE_SERIES above: all of them).
DAEMON_FAMILIES: Final = (
    Family(
        "kvwatch_build_info",
        "gauge",
        "kvwatch's version; the value is 1.",
        ("version", "python"),
    ),
    Family(
        "kvwatch_engine_info",
        "gauge",
        "The engines kvwatch sees, with the mode their detectors run in and their scrub setting;"
        " the value is 1.",
        ("engine", "version", "role", "model", "mode", "scrub"),
    ),
    Family(
        "kvwatch_engine_config_errors",
        "gauge",
        "Live engine processes that started with an invalid kvwatch setting, by role and"
        " setting: each runs with its documented fallback (a bad mode as log) and its log names"
        " the value.",
        ("role", "setting"),
    ),
    Family("kvwatch_unsafe_band_tokens", "gauge", UNSAFE_BAND_HELP, ENGINE_LABELS),
    Family(
        "kvwatch_rank_verifications",
        "counter",
        "Requests a hooked detector verified, per live engine rank (its processes' hooks summed,"
        " restarted ones included): a rank whose checks do not run shows beside the ranks whose"
        " checks do.",
        (*ENGINE_LABELS, "detector"),
    ),
    Family(
        "kvwatch_rank_verifications_skipped",
        "counter",
        "Requests a hooked detector did not verify, per live engine rank, every reason but"
        " mode_off (kvwatch_verifications_skipped_total says which).",
        (*ENGINE_LABELS, "detector"),
    ),
    Family(
        "kvwatch_findings",
        "counter",
        "Findings committed to the journal: one per detector event. One affected request found"
        " by several detectors, or at several doors, is several findings and one incident"
        " (kvwatch_affected_requests_total counts incidents, as kvwatch incidents does).",
        ("detector", "role", "kind"),
    ),
    Family(
        "kvwatch_affected_requests",
        "counter",
        "Affected requests: incidents, each a request that read KV it did not write or another"
        " finding's request, counted once however many detectors found it (the join rule of"
        " kvwatch incidents), by the role of its first finding.",
        ("role",),
    ),
    Family(
        "kvwatch_exposed_requests",
        "counter",
        "Requests whose KV an affected request received (each named source once, the sources a"
        " finding only counts once per incident), by the reader's role.",
        ("role",),
    ),
    Family(
        "kvwatch_transfer_mismatches",
        "counter",
        "Detection events on transferred KV, by the node that sent it (the finding's"
        f" peer_node): a bad link or NIC shows as one peer. At most {MAX_PEERS} peers per"
        " daemon, the rest counted as other.",
        ("peer",),
    ),
    Family(
        "kvwatch_spool_records",
        "counter",
        "Spool records committed to the journal.",
    ),
    Family(
        "kvwatch_spool_rejected",
        "counter",
        "Spool frames, records or files rejected, by reason.",
        ("reason",),
    ),
    Family(
        "kvwatch_spool_clamped_records",
        "counter",
        "Records whose timestamp lay outside the daemon's clock window, stored with the"
        " daemon's time instead.",
    ),
    Family(
        "kvwatch_spool_lost_records",
        "counter",
        "Records missing from a producer's sequence numbers (never reached the daemon).",
    ),
    Family(
        "kvwatch_spool_lag_bytes",
        "gauge",
        "Bytes in the spool not yet read.",
    ),
    Family(
        "kvwatch_spool_ignored_segments",
        "gauge",
        "Segment files in the spool the daemon leaves unread, by reason: their findings are not"
        " in the journal.",
        ("reason",),
    ),
    Family(
        "kvwatch_spool_ignored_findings",
        "gauge",
        "Detection events in the spool's ignored segments (those the daemon can read).",
    ),
    Family(
        "kvwatch_producers",
        "gauge",
        "Engine processes with a live spool segment.",
    ),
    Family(
        "kvwatch_config_last_reload_successful",
        "gauge",
        "Whether the last configuration reload (SIGHUP) applied: 1, or 0 while the file on"
        " disk is refused (the daemon runs on the configuration it had).",
    ),
    Family(
        "kvwatch_config_last_reload_success_timestamp_seconds",
        "gauge",
        "Unix time of the last configuration the daemon applied (its start, or a reload).",
    ),
    Family(
        "kvwatch_last_record_timestamp_seconds",
        "gauge",
        "Unix time of the newest record committed to the journal.",
    ),
    Family(
        "kvwatch_log_lines",
        "counter",
        "Engine log lines read.",
    ),
    Family(
        "kvwatch_log_errors",
        "counter",
        "Engine log lines that could not be read, by reason.",
        ("reason",),
    ),
    Family(
        "kvwatch_nvml_up",
        "gauge",
        "Whether NVML answered (0 on a node without NVIDIA GPUs).",
    ),
    Family(
        "kvwatch_gpu_memory_bytes",
        "gauge",
        "GPU memory by state (total, used, free), from NVML.",
        ("gpu", "state"),
    ),
    Family(
        "kvwatch_alertmanager_posts",
        "counter",
        "Posts of the daemon's fast path to Alertmanager, per Alertmanager and batch, by result.",
        ("result",),
    ),
    Family(
        "kvwatch_collector_success",
        "gauge",
        "Whether the collector's last run succeeded.",
        ("collector",),
    ),
    Family(
        "kvwatch_collector_duration_seconds",
        "gauge",
        "How long the collector's last run took.",
        ("collector",),
    ),
)
FAMILY_BY_NAME: Final = {family.name: family for family in DAEMON_FAMILIES}


#: The prefix of every family kvwatch exposes.
PREFIX: Final = "kvwatch_"


class DaemonCounter:
    """The daemon's own counters, by name: the keys of its state's ``daemon`` totals (with
    their labels, in the order of the family's), the rows of the journal's ``counters`` table
    (stored by these names: renaming one takes a journal migration) and, with :data:`PREFIX`,
    the catalogued counter family each is exposed as. The reader, the pager, /metrics and the
    status page name them only through these."""

    #: Stored as "incidents" before journal schema 5 (migrated: tables.FINDINGS_RENAMED).
    FINDINGS: Final = "findings"
    AFFECTED_REQUESTS: Final = "affected_requests"
    EXPOSED_REQUESTS: Final = "exposed_requests"
    TRANSFER_MISMATCHES: Final = "transfer_mismatches"
    SPOOL_RECORDS: Final = "spool_records"
    SPOOL_REJECTED: Final = "spool_rejected"
    SPOOL_CLAMPED_RECORDS: Final = "spool_clamped_records"
    SPOOL_LOST_RECORDS: Final = "spool_lost_records"
    ALERTMANAGER_POSTS: Final = "alertmanager_posts"


#: Every name of :class:`DaemonCounter`.
DAEMON_COUNTERS: Final = tuple(
    value for name, value in vars(DaemonCounter).items() if name.isupper()
)
for _name in DAEMON_COUNTERS:  # each one a catalogued counter family
    assert FAMILY_BY_NAME[PREFIX + _name].type == "counter", _name

#: Every catalogued family, by its name without :data:`PREFIX`, and the name /metrics exposes
#: for it (a counter's with ``_total``).
EXPOSED: Final = {
    family.removeprefix(PREFIX): family + ("_total" if counter else "")
    for family, counter in (
        *((series.family, True) for series in COUNTER_SERIES),
        *((series.family, False) for series in GAUGE_SERIES),
        *((family.name, family.type == "counter") for family in DAEMON_FAMILIES),
    )
}


def exposed(name: str) -> str:
    """The name /metrics exposes for the catalogued family ``kvwatch_<name>`` (a counter's with
    ``_total``), for queries written by the alerts and dashboards generators: a name the
    catalogue does not hold fails at generation time instead of becoming a query that matches
    nothing."""
    try:
        return EXPOSED[name]
    except KeyError:
        raise ValueError(f"no catalogued family {PREFIX}{name}") from None


@overload
def unsafe_band(context_length_tokens: int, pool_tokens: int) -> int: ...
@overload
def unsafe_band(context_length_tokens: float, pool_tokens: float) -> float: ...
def unsafe_band(context_length_tokens: float, pool_tokens: float) -> float:
    """Tokens of prompt length that pass the context check but do not fit the pool."""
    return max(context_length_tokens - pool_tokens, 0)
