"""The kvwatch node view: one node's engines, integrity, pool, GPU memory and daemon."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.models.dashboard import (
    Threshold,
)

from dashboards.common import (
    JOB,
    ONE_NODE,
    ONE_NODE_ROLE,
    Ids,
    instant_table_query,
    query,
    row,
    skeleton,
    stat_panel,
    table_panel,
    timeseries_panel,
)
from kvspool.catalogue import exposed

UID = "kvwatch-node"
TITLE = "kvwatch / Node"


def build() -> dash.Dashboard:
    ids = Ids()
    board = skeleton(
        TITLE,
        UID,
        "One serving node: its engines and their KV pools, the detectors' findings and "
        "coverage, GPU memory (NVML) and the kvwatch daemon.",
        since="now-3h",
        one_node=True,
    )

    board = board.with_row(row(ids, "Integrity on $node"))
    board = board.with_panel(
        stat_panel(
            ids,
            "Mismatches",
            "KV integrity mismatches on this node in the time range (KVIntegrityMismatch).",
            f"sum(increase({exposed('mismatches')}{{{ONE_NODE_ROLE}}}[$__range])) or vector(0)",
        )
    )
    board = board.with_panel(
        stat_panel(
            ids,
            "Aborted requests admitted",
            "Aborted requests an admission queue let through on this node in the time range.",
            f"sum(increase({exposed('aborted_admissions')}{{{ONE_NODE_ROLE}}}[$__range]))"
            " or vector(0)",
        )
    )
    board = board.with_panel(
        stat_panel(
            ids,
            "Incidents",
            "Incidents (affected requests, each counted once however many detectors found it) "
            "the daemon journalled on this node in the time range (`kvwatch incidents --since "
            "1h` on the node lists them).",
            f"sum(increase({exposed('affected_requests')}{{{ONE_NODE_ROLE}}}[$__range]))"
            " or vector(0)",
        )
    )
    board = board.with_panel(
        stat_panel(
            ids,
            "Largest unsafe band",
            "Tokens by which the context length exceeds the KV pool, worst role on this node "
            "(KVPoolSmallerThanContext).",
            f"max({exposed('unsafe_band_tokens')}{{{ONE_NODE_ROLE}}}) or vector(0)",
        )
    )
    board = board.with_panel(
        timeseries_panel(
            ids,
            "Mismatches and findings",
            "Per interval, by role, detector and kind: the hooks' mismatch counters, and the "
            "findings the daemon journalled (one incident may be several findings).",
            [
                query(
                    "sum by (role, detector, kind) "
                    f"(increase({exposed('mismatches')}{{{ONE_NODE_ROLE}}}[$__rate_interval]))",
                    "mismatch {{role}} {{detector}} {{kind}}",
                    "A",
                ),
                query(
                    "sum by (role, detector, kind) "
                    f"(increase({exposed('findings')}{{{ONE_NODE_ROLE}}}[$__rate_interval]))",
                    "finding {{role}} {{detector}} {{kind}}",
                    "B",
                ),
            ],
            bars=True,
        )
    )
    board = board.with_panel(
        timeseries_panel(
            ids,
            "Verified and skipped requests",
            "Requests each detector verified, and skipped by reason, per second.",
            [
                query(
                    "sum by (role, detector) "
                    f"(rate({exposed('verifications')}{{{ONE_NODE_ROLE}}}[$__rate_interval]))",
                    "verified {{role}} {{detector}}",
                    "A",
                ),
                query(
                    "sum by (role, detector, reason) "
                    f"(rate({exposed('verifications_skipped')}{{{ONE_NODE_ROLE}}}"
                    "[$__rate_interval]))",
                    "skipped {{role}} {{detector}} {{reason}}",
                    "B",
                ),
            ],
            unit="reqps",
        )
    )

    board = board.with_row(row(ids, "Engines and KV pools"))
    board = board.with_panel(
        timeseries_panel(
            ids,
            "KV pool and context length per rank",
            "Tokens per role, rank and source (hooks or log). Context above pool is the unsafe "
            "band.",
            [
                query(
                    f"max by (role, rank, source) ({exposed('kv_pool_tokens')}{{{ONE_NODE_ROLE}}})",
                    "pool {{role}} rank {{rank}} ({{source}})",
                    "A",
                ),
                query(
                    "max by (role, rank, source) "
                    f"({exposed('context_length_tokens')}{{{ONE_NODE_ROLE}}})",
                    "context {{role}} rank {{rank}} ({{source}})",
                    "B",
                ),
            ],
        )
    )
    board = board.with_panel(
        table_panel(
            ids,
            "Engines",
            "Engine processes on this node: engine, release, role, model, and the page size.",
            [
                instant_table_query(
                    "count by (role, engine, version, model) "
                    f"({exposed('engine_info')}{{{ONE_NODE_ROLE}}})",
                    "A",
                ),
            ],
            rename={"Value": "processes"},
            width=6,
        )
    )
    board = board.with_panel(
        table_panel(
            ids,
            "Page size",
            "Tokens per KV page, per role and source.",
            [
                instant_table_query(
                    f"max by (role, source) ({exposed('page_size_tokens')}{{{ONE_NODE_ROLE}}})", "A"
                )
            ],
            rename={"Value": "tokens per page"},
            width=6,
        )
    )

    board = board.with_row(row(ids, "GPU memory"))
    board = board.with_panel(
        timeseries_panel(
            ids,
            "GPU memory",
            "Used and total memory per GPU, from NVML. The KV pool is sized from what the weights "
            "leave free, so a change here moves the pool.",
            [
                query(
                    "sum by (gpu, state) "
                    f'({exposed("gpu_memory_bytes")}{{{ONE_NODE}, state=~"used|total"}})',
                    "GPU {{gpu}} {{state}}",
                )
            ],
            unit="bytes",
            width=18,
        )
    )
    board = board.with_panel(
        stat_panel(
            ids,
            "NVML",
            "1 when NVML answers; 0 on a node without NVIDIA GPUs or with a broken driver.",
            f"max({exposed('nvml_up')}{{{ONE_NODE}}})",
            steps=[Threshold(value=None, color="orange"), Threshold(value=1, color="green")],
            width=6,
            height=8,
        )
    )

    board = board.with_row(row(ids, "Hooks and daemon"))
    board = board.with_panel(
        timeseries_panel(
            ids,
            "Time inside kvwatch's hooks",
            "Seconds per second spent inside kvwatch's hooks in the engines, by hook.",
            [
                query(
                    "sum by (hook) "
                    f"(rate({exposed('hook_seconds')}{{{ONE_NODE_ROLE}}}[$__rate_interval]))",
                    "{{hook}}",
                )
            ],
            unit="percentunit",
            width=8,
        )
    )
    board = board.with_panel(
        timeseries_panel(
            ids,
            "Spool",
            "Records read, rejected and lost per second.",
            [
                query(
                    f"sum(rate({exposed('spool_records')}{{{ONE_NODE}}}[$__rate_interval]))",
                    "read",
                    "A",
                ),
                query(
                    "sum by (reason) "
                    f"(rate({exposed('spool_rejected')}{{{ONE_NODE}}}[$__rate_interval]))",
                    "rejected {{reason}}",
                    "B",
                ),
                query(
                    f"sum(rate({exposed('spool_lost_records')}{{{ONE_NODE}}}[$__rate_interval]))",
                    "lost",
                    "C",
                ),
            ],
            unit="ops",
            width=8,
        )
    )
    board = board.with_panel(
        timeseries_panel(
            ids,
            "Daemon",
            "Scrape status, producers and seconds since the hooks' last record.",
            [
                query(f"max(up{{{JOB}, {ONE_NODE}}})", "up", "A"),
                query(f"max({exposed('producers')}{{{ONE_NODE}}})", "producers", "B"),
                query(
                    f"time() - max({exposed('last_record_timestamp_seconds')}{{{ONE_NODE}}})",
                    "seconds since last record",
                    "C",
                ),
            ],
            width=8,
        )
    )
    return board
