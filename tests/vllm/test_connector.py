"""The kvwatch connector's contract with vLLM: factory, capabilities, layouts, aggregation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import vllm
from harness import (
    Node,
    kv_cache_config,
    kvwatch_child,
    transport_child,
    vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from engine_hooks.vllm import KVWatchConnector
from engine_hooks.vllm.metadata import KVWatchWorkerMetadata

SUPPORTED = ("0.32.0", "0.33.0")


def test_real_release() -> None:
    assert vllm.__version__ in SUPPORTED
    assert torch.__version__.startswith("2.13.0")


def _config(tmp_path: Path, role: str, sibling: str | None, model: str | None = None) -> Any:
    children = [kvwatch_child(role, str(tmp_path), "log")]
    if sibling is not None:
        children.append(transport_child(sibling, role, str(tmp_path / "storage"), "e"))
    return vllm_config(children, role, model)


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_factory_creates_it_alone(tmp_path: Path, role: KVConnectorRole) -> None:
    config = _config(tmp_path, "kv_producer", None)
    connector = KVConnectorFactory.create_connector(config, role, kv_cache_config())
    assert isinstance(connector, KVWatchConnector)
    assert supports_hma(connector)
    assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config)
    assert KVWatchConnector.get_required_kvcache_layout(config) is None


def test_factory_creates_it_beside_nixl(tmp_path: Path, model: str) -> None:
    """Scheduler role beside the real NixlConnector (its worker needs the NIXL library)."""
    config = _config(tmp_path, "kv_consumer", "nixl", model)
    connector = KVConnectorFactory.create_connector(
        config, KVConnectorRole.SCHEDULER, kv_cache_config()
    )
    assert isinstance(connector, MultiConnector)
    names = [type(c).__name__ for c in connector.sub_connectors]
    assert names[0] == "KVWatchConnector" and names[1].startswith("Nixl")


# Every capability MultiConnector (0.32 and 0.33) aggregates over its children with all(), any(),
# "the first non-None" or "all equal": adding kvwatch must leave each of them as it was.
# (get_handshake_metadata and get_mem_pool_context, "the first non-None", are worker-side: kvwatch
# keeps the base class's None.)
def _capabilities(connector: Any, config: Any) -> dict[str, Any]:
    ktc = config.kv_transfer_config
    extra = ktc.kv_connector_extra_config
    caps = {
        "supports_divergent_local_hybrid_hits": connector.supports_divergent_local_hybrid_hits,
        "requires_kv_delivery": connector.requires_kv_delivery,
        "requires_piecewise_for_cudagraph": MultiConnector.requires_piecewise_for_cudagraph(extra),
        "all_children_support_hma": MultiConnector.all_children_support_hma(ktc),
        "required_kvcache_layout": MultiConnector.get_required_kvcache_layout(config),
        "finished_count": connector.get_finished_count(),
        "has_pending_block_frees": connector.has_pending_block_frees(),
        "has_pending_push_work": connector.has_pending_push_work(),
        "reset_cache": connector.reset_cache(),
    }
    if hasattr(MultiConnector, "supports_sleep_mode"):  # 0.33
        caps["supports_sleep_mode"] = MultiConnector.supports_sleep_mode(ktc)
    return caps


@pytest.mark.parametrize(
    ("sibling", "role"),
    [
        ("nixl", "kv_consumer"),
        ("nixl", "kv_producer"),
        ("sync", "kv_consumer"),
        ("sync", "kv_producer"),
        ("async", "kv_consumer"),
    ],
)
def test_adding_kvwatch_changes_no_capability(
    tmp_path: Path, model: str, sibling: str, role: str
) -> None:
    from transport import new_link

    link = new_link() if sibling == "async" else str(tmp_path / "storage")
    other = transport_child(sibling, role, link, "e")
    caps = []
    for children in ([other], [kvwatch_child(role, str(tmp_path), "log"), other]):
        # MultiConnector over the transport, as deployed before kvwatch, then with kvwatch.
        config = vllm_config(children, role, model, multi=True)
        connector = KVConnectorFactory.create_connector(
            config, KVConnectorRole.SCHEDULER, kv_cache_config()
        )
        caps.append(_capabilities(connector, config))
    assert caps[0] == caps[1]


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer", "kv_both"])
def test_kvwatch_answers_aggregates_with_their_neutral_value(tmp_path: Path, role: str) -> None:
    """any() of False and all() of True leave MultiConnector's answer to the other children,
    whatever they answer (vLLM's base class says a producer requires KV delivery)."""
    config = _config(tmp_path, role, None)
    connector = KVConnectorFactory.create_connector(
        config, KVConnectorRole.SCHEDULER, kv_cache_config()
    )
    assert connector.requires_kv_delivery is False
    assert connector.supports_divergent_local_hybrid_hits is True


def test_seals_of_tp_ranks_merge_in_vllms_aggregator() -> None:
    seal0, seal1 = {"page_count": 3, "digest": 1}, {"page_count": 3, "digest": 2}
    outputs = [
        ModelRunnerOutput(
            req_ids=[],
            req_id_to_index={},
            kv_connector_output=KVConnectorOutput(
                kv_connector_worker_meta=KVWatchWorkerMetadata({"r": {str(rank): seal}})
            ),
        )
        for rank, seal in ((0, seal0), (1, seal1))
    ]
    merged = KVOutputAggregator(2).aggregate(outputs)
    assert merged is not None and merged.kv_connector_output is not None
    meta = merged.kv_connector_output.kv_connector_worker_meta
    assert isinstance(meta, KVWatchWorkerMetadata)
    assert meta.seals == {"r": {"0": seal0, "1": seal1}}


def test_hooks_never_raise_into_the_engine(tmp_path: Path, model: str) -> None:
    node = Node("kv_consumer", str(tmp_path), model, transport="sync", link=str(tmp_path / "s"))
    sched, work = node.child("scheduler"), node.child("worker")
    sched.update_state_after_alloc(object(), object(), 0)  # not a Request
    assert sched.get_num_new_matched_tokens(object(), 0) == (0, False)
    assert sched.request_finished_all_groups(object(), ([1],)) == (False, None)
    sched.bind_connector_metadata(object())
    work.bind_connector_metadata(object())  # not kvwatch metadata: ignored
    work.start_load_kv(None)
    assert sched.watch.counter("hook_errors", "reserve") >= 1
    assert sched.watch.counter("hook_errors", "seal") >= 1


def test_block_outermost_layout(tmp_path: Path, model: str) -> None:
    node = Node(
        "kv_consumer",
        str(tmp_path),
        model,
        transport="sync",
        link=str(tmp_path / "s"),
        layout=KVCacheLayout.BLHNC,
    )
    assert node.kvwatch.pool.page_bytes == node.kcc.kv_cache_tensors[0].block_stride


def test_unsupported_layout_is_counted_not_guessed(tmp_path: Path, model: str) -> None:
    node = Node(
        "kv_consumer",
        str(tmp_path),
        model,
        transport="sync",
        link=str(tmp_path / "s"),
        layout=KVCacheLayout.LHBNC,
    )
    work = node.child("worker")
    assert work.worker is None
    assert work.watch.counter("verifications_skipped", "checksum", "unsupported_layout")
