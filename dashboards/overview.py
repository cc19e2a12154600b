"""The kvwatch overview: is any request reading pages it did not write, anywhere, and could it?"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.models.dashboard import (
    DynamicConfigValue,
    Threshold,
)

from dashboards.common import (
    GREEN_ORANGE_RED,
    GREEN_RED,
    JOB,
    NODE_ROLE,
    NODES,
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
from kvwatch.alerting.rules import VULNERABLE_PD

UID = "kvwatch-overview"
#: Nodes the fleet tables list, worst first.
TOP_NODES = 10
TITLE = "kvwatch / Overview"


def _coverage(by: str, family: str = "verifications") -> str:
    """Verified over verified + skipped requests in the time range, summed by ``by``, from the
    summed families or (``rank_verifications``) the per-rank ones."""
    verified = f"sum by ({by}) (increase({exposed(family)}{{{NODE_ROLE}}}[$__range]))"
    skipped = f"sum by ({by}) (increase({exposed(family + '_skipped')}{{{NODE_ROLE}}}[$__range]))"
    return f"{verified}\n/ (\n  {verified}\n  + {skipped}\n)"


def build() -> dash.Dashboard:
    ids = Ids()
    board = skeleton(
        TITLE,
        UID,
        "KV-cache integrity across a prefill/decode deployment: mismatches, verification "
        "coverage, the pool-versus-context band, engine releases, the hooks' own cost and "
        "the kvwatch daemons' health.",
        since="now-6h",
        one_node=False,
    )

    board = board.with_row(row(ids, "Integrity"))
    board = board.with_panel(
        stat_panel(
            ids,
            "Integrity mismatches",
            "KV integrity mismatches in the time range, all detectors (kvwatch and the engine's "
            "own). Above 0 a request read pages it did not write. Runbook: KVIntegrityMismatch.",
            f"sum(increase({exposed('mismatches')}{{{NODE_ROLE}}}[$__range])) or vector(0)",
        )
    )
    board = board.with_panel(
        stat_panel(
            ids,
            "Aborted requests admitted",
            "Requests already marked for abort that an admission queue let through, in the time "
            "range. Runbook: KVAbortedRequestAdmitted.",
            f"sum(increase({exposed('aborted_admissions')}{{{NODE_ROLE}}}[$__range])) or vector(0)",
        )
    )
    board = board.with_panel(
        stat_panel(
            ids,
            "Roles with an unsafe band",
            "Node and role pairs whose KV pool is smaller than the context length now. Runbook: "
            "KVPoolSmallerThanContext.",
            f"count(max by (node, role) ({exposed('unsafe_band_tokens')}{{{NODE_ROLE}}}) > 0)"
            " or vector(0)",
        )
    )
    board = board.with_panel(
        stat_panel(
            ids,
            "Vulnerable engines in PD mode",
            "Engine processes running a release before 0.5.20 as prefill or decode (recording "
            f"rule {VULNERABLE_PD} from alerts/kvwatch.rules.yml). Runbook: "
            "KVEngineReleaseVulnerable.",
            f"count({VULNERABLE_PD}{{{NODE_ROLE}}}) or vector(0)",
        )
    )
    board = board.with_panel(
        timeseries_panel(
            ids,
            "Integrity mismatches by detector and node",
            "Mismatches per interval, by node, role, detector and kind. Rare by design: every bar "
            "is an incident; `kvwatch incidents` lists the requests.",
            [
                query(
                    "sum by (node, role, detector, kind) "
                    f"(increase({exposed('mismatches')}{{{NODE_ROLE}}}[$__rate_interval]))",
                    "{{node}} {{role}} {{detector}} {{kind}}",
                )
            ],
            width=16,
            bars=True,
        )
    )
    board = board.with_panel(
        timeseries_panel(
            ids,
            "Aborted admissions by queue",
            "Aborted requests admitted per interval, by node and admission queue.",
            [
                query(
                    "sum by (node, role, queue) "
                    f"(increase({exposed('aborted_admissions')}{{{NODE_ROLE}}}"
                    "[$__rate_interval]))",
                    "{{node}} {{role}} {{queue}}",
                )
            ],
            width=8,
            bars=True,
        )
    )
    board = board.with_panel(
        timeseries_panel(
            ids,
            "Transfer mismatches by sending node",
            "Findings on transferred KV per interval, by the node that sent it (peer), summed "
            "over the readers. One peer standing out is a bad link or NIC on it: drain it "
            "(KVTransferPeerMismatches). At most 32 peers per daemon, the rest as other.",
            [
                query(
                    "sum by (peer) "
                    f"(increase({exposed('transfer_mismatches')}{{{JOB}, {NODES}}}"
                    "[$__rate_interval]))",
                    "{{peer}}",
                )
            ],
            width=24,
            bars=True,
        )
    )

    board = board.with_row(row(ids, "Fleet: which nodes"))
    board = board.with_panel(
        stat_panel(
            ids,
            "Daemons up",
            "kvwatch daemons Prometheus scrapes now, one per serving node. Compare with the "
            "number of nodes you run: a node without a daemon is a node nobody watches.",
            f"count(up{{{JOB}, {NODES}}} == 1) or vector(0)",
            steps=[Threshold(value=None, color="blue")],
            width=4,
            height=8,
        )
    )
    board = board.with_panel(
        table_panel(
            ids,
            f"Nodes with mismatches (top {TOP_NODES})",
            f"The {TOP_NODES} nodes with the most KV integrity mismatches in the time range, all "
            "roles and detectors. Empty is good. Open the node dashboard for one of them; "
            "`kvwatch incidents --journal a.db --journal b.db` lists the requests fleet-wide.",
            [
                instant_table_query(
                    f"topk({TOP_NODES}, sum by (node) "
                    f"(increase({exposed('mismatches')}{{{NODE_ROLE}}}[$__range])) > 0)"
                )
            ],
            rename={"Value": "mismatches"},
            width=6,
            steps=GREEN_RED,
        )
    )
    board = board.with_panel(
        table_panel(
            ids,
            "Nodes running a vulnerable release",
            "Engine processes on a release before 0.5.20 serving prefill or decode, by node "
            f"(recording rule {VULNERABLE_PD}; KVEngineReleaseVulnerable). Empty "
            "is good.",
            [
                instant_table_query(
                    "count by (node, role, engine, version, model) "
                    f"({VULNERABLE_PD}{{{NODE_ROLE}}})"
                )
            ],
            rename={"Value": "processes"},
            width=14,
        )
    )
    board = board.with_panel(
        table_panel(
            ids,
            "Unsafe band per model across nodes",
            "Per engine and model: the largest unsafe band (context minus pool, tokens) on any "
            "node, how many nodes have one, and how many nodes serve the model. One config "
            "usually serves a model fleet-wide: a band on one node is a band on all of its "
            "kind (KVPoolSmallerThanContext).",
            [
                instant_table_query(
                    f"max by (engine, model) ({exposed('unsafe_band_tokens')}{{{NODE_ROLE}}})",
                    "A",
                ),
                instant_table_query(
                    "count by (engine, model) (max by (node, engine, model) "
                    f"({exposed('unsafe_band_tokens')}{{{NODE_ROLE}}}) > 0)",
                    "B",
                ),
                instant_table_query(
                    "count by (engine, model) (max by (node, engine, model) "
                    f"({exposed('unsafe_band_tokens')}{{{NODE_ROLE}}}))",
                    "C",
                ),
            ],
            rename={
                "Value #A": "largest band",
                "Value #B": "nodes with a band",
                "Value #C": "nodes serving",
            },
            width=12,
        )
    )
    board = board.with_panel(
        table_panel(
            ids,
            "Verification coverage per node",
            "Share of the requests that reached a detector which it verified, per node over the "
            "time range, lowest first. A node well below the others runs a detector off or on an "
            "unsupported layout (KVDetectorVerifyingNothing).",
            [instant_table_query(f"sort(\n{_coverage('node')}\n)")],
            rename={"Value": "verified"},
            width=12,
        ).unit("percentunit")
    )

    board = board.with_row(row(ids, "Verification coverage"))
    board = board.with_panel(
        timeseries_panel(
            ids,
            "Verified requests by detector",
            "Requests each detector verified, per second. A detector at 0 while others verify on "
            "the same role is KVDetectorVerifyingNothing.",
            [
                query(
                    "sum by (node, role, detector) "
                    f"(rate({exposed('verifications')}{{{NODE_ROLE}}}[$__rate_interval]))",
                    "{{node}} {{role}} {{detector}}",
                )
            ],
            unit="reqps",
            width=8,
        )
    )
    board = board.with_panel(
        timeseries_panel(
            ids,
            "Skipped verifications by reason",
            "Requests a detector did not verify, per second, by reason (mode_off, "
            "unsupported_layout, no_seal, ...).",
            [
                query(
                    "sum by (node, role, detector, reason) "
                    f"(rate({exposed('verifications_skipped')}{{{NODE_ROLE}}}"
                    "[$__rate_interval]))",
                    "{{node}} {{role}} {{detector}} {{reason}}",
                )
            ],
            unit="reqps",
            width=8,
        )
    )
    board = board.with_panel(
        table_panel(
            ids,
            "Coverage in the time range",
            "Share of the requests that reached a detector which it verified, per node, role and "
            "detector, over the dashboard's time range.",
            [instant_table_query(_coverage("node, role, detector"))],
            rename={"Value": "verified"},
            width=8,
        ).unit("percentunit")
    )

    board = board.with_panel(
        table_panel(
            ids,
            "Coverage per engine rank",
            "Share of the requests that reached a detector which each tensor-parallel rank "
            "verified, lowest first: a rank below its engine's other ranks reads its KV unchecked "
            "(its counters summed with theirs look covered; kvwatch status says which rank).",
            [
                instant_table_query(
                    "sort(\n"
                    + _coverage("node, role, engine, model, rank, detector", "rank_verifications")
                    + "\n)"
                )
            ],
            rename={"Value": "verified"},
            width=24,
        ).unit("percentunit")
    )

    board = board.with_row(row(ids, "KV pool versus context length"))
    board = board.with_panel(
        timeseries_panel(
            ids,
            "KV pool and context length",
            "Tokens the KV pool holds and the context length the engine advertises, per node and "
            "role. Where the context line is above the pool line, prompts in between pass the "
            "context check and fail the pool check: the unsafe band.",
            [
                query(
                    f"max by (node, role) ({exposed('kv_pool_tokens')}{{{NODE_ROLE}}})",
                    "{{node}} {{role}} pool",
                    "A",
                ),
                query(
                    f"max by (node, role) ({exposed('context_length_tokens')}{{{NODE_ROLE}}})",
                    "{{node}} {{role}} context",
                    "B",
                ),
            ],
            width=12,
        )
    )
    board = board.with_panel(
        table_panel(
            ids,
            "Unsafe band per node and role",
            "Pool, context and the band max(0, context - pool) in tokens, now. Red rows page "
            "(KVPoolSmallerThanContext).",
            [
                instant_table_query(
                    "min by (node, role, engine, model)"
                    f" ({exposed('kv_pool_tokens')}{{{NODE_ROLE}}})",
                    "A",
                ),
                instant_table_query(
                    "max by (node, role, engine, model) "
                    f"({exposed('context_length_tokens')}{{{NODE_ROLE}}})",
                    "B",
                ),
                instant_table_query(
                    "max by (node, role, engine, model) "
                    f"({exposed('unsafe_band_tokens')}{{{NODE_ROLE}}})",
                    "C",
                ),
            ],
            rename={"Value #A": "pool", "Value #B": "context", "Value #C": "unsafe band"},
            width=12,
        ).override_by_name(
            "unsafe band",
            [
                DynamicConfigValue("custom.cellOptions", {"type": "color-background"}),
                DynamicConfigValue(
                    "thresholds",
                    {
                        "mode": "absolute",
                        "steps": [
                            {"value": None, "color": "green"},
                            {"value": 1, "color": "red"},
                        ],
                    },
                ),
            ],
        )
    )

    board = board.with_row(row(ids, "Engines"))
    board = board.with_panel(
        table_panel(
            ids,
            "Engine releases per role",
            "Engine processes by node, role, engine, release and model. SGLang (and minipd) before "
            "0.5.20 in PD mode leak; 0.5.22 is the recommended floor; prefill and decode should "
            "run the same release.",
            [
                instant_table_query(
                    "count by (node, role, engine, version, model) "
                    f"({exposed('engine_info')}{{{NODE_ROLE}}})"
                )
            ],
            rename={"Value": "processes"},
            width=16,
        )
    )
    board = board.with_panel(
        stat_panel(
            ids,
            "Releases per model across prefill and decode",
            "Distinct engine releases serving each model in PD mode: more than 1 is skew "
            "(KVEngineReleaseSkew).",
            "count by (engine, model) (group by (engine, model, version) "
            f'({exposed("engine_info")}{{{NODES}, role=~"prefill|decode"}}))',
            steps=[Threshold(value=None, color="green"), Threshold(value=2, color="orange")],
            width=8,
            height=8,
        )
    )

    board = board.with_row(row(ids, "Hooks' own cost"))
    board = board.with_panel(
        timeseries_panel(
            ids,
            "Time inside kvwatch's hooks",
            "Seconds the engine spent inside kvwatch's hooks per second of wall time (1 = one "
            "core's worth), by node and hook. This is kvwatch's overhead on the engine.",
            [
                query(
                    "sum by (node, hook) "
                    f"(rate({exposed('hook_seconds')}{{{NODE_ROLE}}}[$__rate_interval]))",
                    "{{node}} {{hook}}",
                )
            ],
            unit="percentunit",
            width=24,
        )
    )

    board = board.with_row(row(ids, "kvwatch daemons"))
    board = board.with_panel(
        stat_panel(
            ids,
            "Daemons down",
            "kvwatch daemons Prometheus cannot scrape (KVWatchDaemonDown).",
            f"count(up{{{JOB}, {NODES}}} == 0) or vector(0)",
        )
    )
    board = board.with_panel(
        stat_panel(
            ids,
            "Spool records lost",
            "Records the daemon never received (sequence gaps) in the time range "
            "(KVSpoolRecordsLost).",
            f"sum(increase({exposed('spool_lost_records')}{{{NODES}}}[$__range])) or vector(0)",
        )
    )
    board = board.with_panel(
        stat_panel(
            ids,
            "Spool records rejected",
            "Torn, corrupt or foreign records the daemon skipped in the time range "
            "(KVSpoolRecordsRejected).",
            f"sum(increase({exposed('spool_rejected')}{{{NODES}}}[$__range])) or vector(0)",
            steps=GREEN_ORANGE_RED,
        )
    )
    board = board.with_panel(
        stat_panel(
            ids,
            "Oldest hook record",
            "Seconds since the quietest node's hooks last wrote a spool record (KVHooksSilent "
            "above 300 s).",
            f"max(time() - max by (node) ({exposed('last_record_timestamp_seconds')}{{{NODES}}}))",
            steps=[Threshold(value=None, color="green"), Threshold(value=300, color="orange")],
            unit="s",
        )
    )
    board = board.with_panel(
        timeseries_panel(
            ids,
            "Spool records",
            "Records read, rejected (by reason) and lost per second, by node.",
            [
                query(
                    f"sum by (node) (rate({exposed('spool_records')}{{{NODES}}}"
                    "[$__rate_interval]))",
                    "{{node}} read",
                    "A",
                ),
                query(
                    f"sum by (node, reason) (rate({exposed('spool_rejected')}{{{NODES}}}"
                    "[$__rate_interval]))",
                    "{{node}} rejected {{reason}}",
                    "B",
                ),
                query(
                    f"sum by (node) (rate({exposed('spool_lost_records')}{{{NODES}}}"
                    "[$__rate_interval]))",
                    "{{node}} lost",
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
            "Spool lag and producers",
            "Bytes written by the hooks that the daemon has not read yet, and the number of "
            "engine processes writing to the spool, by node.",
            [
                query(
                    f"max by (node) ({exposed('spool_lag_bytes')}{{{NODES}}})",
                    "{{node}} lag",
                    "A",
                ),
                query(
                    f"max by (node) ({exposed('producers')}{{{NODES}}})",
                    "{{node}} producers",
                    "B",
                ),
            ],
            unit="bytes",
            width=8,
        ).override_by_regexp(".* producers", [DynamicConfigValue("unit", "short")])
    )
    board = board.with_panel(
        table_panel(
            ids,
            "Daemon collectors",
            "Whether each collector's last run succeeded (1) and how long it took, by node.",
            [
                instant_table_query(
                    f"min by (node, collector) ({exposed('collector_success')}{{{NODES}}})", "A"
                ),
                instant_table_query(
                    "max by (node, collector)"
                    f" ({exposed('collector_duration_seconds')}{{{NODES}}})",
                    "B",
                ),
            ],
            rename={"Value #A": "success", "Value #B": "seconds"},
            width=8,
        )
    )
    board = board.with_panel(
        table_panel(
            ids,
            "kvwatch releases",
            "Daemons per kvwatch release. The engine hooks and the daemon should run the same "
            "release (spool records of another schema version are rejected).",
            [instant_table_query(f"count by (version) ({exposed('build_info')}{{{NODES}}})")],
            rename={"Value": "daemons"},
            width=24,
            height=5,
        )
    )
    return board
