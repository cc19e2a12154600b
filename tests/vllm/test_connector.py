"""The kvwatch connector against the real vLLM 0.33.0 release, on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm
from harness import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    NUM_BLOCKS,
    Engine,
    kv_cache_config,
    prefill_then_reserve,
    tiny_model,
    transfer,
    vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from engine_hooks.testing import read_spool
from engine_hooks.vllm import KVWatchConnector
from engine_hooks.vllm.metadata import KVWatchWorkerMetadata


def test_real_release() -> None:
    assert vllm.__version__ == "0.33.0"
    assert torch.__version__.startswith("2.13.0")


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_factory_creates_it_alone(tmp_path: Path, role: KVConnectorRole) -> None:
    config = vllm_config("kv_producer", str(tmp_path), "log")
    connector = KVConnectorFactory.create_connector(config, role, kv_cache_config())
    assert isinstance(connector, KVWatchConnector)
    assert supports_hma(connector)
    assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config)
    assert KVWatchConnector.get_required_kvcache_layout(config) is None
    assert connector.get_num_new_matched_tokens(object(), 0) == (0, False)


def test_factory_creates_it_beside_nixl(tmp_path: Path) -> None:
    """Scheduler role beside the real NixlConnector (its worker needs the NIXL library and a
    GPU); kvwatch changes nothing about NIXL's layout or HMA requirements."""
    config = vllm_config("kv_consumer", str(tmp_path), "log", sibling="NixlConnector")
    connector = KVConnectorFactory.create_connector(
        config, KVConnectorRole.SCHEDULER, kv_cache_config()
    )
    assert isinstance(connector, MultiConnector)
    names = [type(c).__name__ for c in connector.sub_connectors]
    assert names[0] == "KVWatchConnector" and names[1].startswith("Nixl")
    nixl_layout = KVConnectorFactory.get_connector_class_by_name(
        "NixlConnector"
    ).get_required_kvcache_layout(config)
    assert MultiConnector.get_required_kvcache_layout(config) == nixl_layout


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_factory_creates_it_as_multiconnector_child(tmp_path: Path, role: KVConnectorRole) -> None:
    config = vllm_config("kv_both", str(tmp_path), "log", sibling="ExampleConnector")
    connector = KVConnectorFactory.create_connector(config, role, kv_cache_config())
    assert isinstance(connector, MultiConnector)
    assert isinstance(connector.sub_connectors[0], KVWatchConnector)


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def pair(tmp_path: Path, model: str) -> tuple[Engine, Engine]:
    return (
        Engine("kv_producer", str(tmp_path), model=model),
        Engine("kv_consumer", str(tmp_path), model=model),
    )


def test_seal_rides_in_kv_transfer_params(pair: tuple[Engine, Engine]) -> None:
    prefill, decode = pair
    params = prefill_then_reserve(prefill, decode, "r1")
    wire = params["kvwatch"]
    assert wire["v"] == 1 and wire["blocks"] == 3
    assert set(wire["seals"]) == {"0"} and wire["seals"]["0"]["page_count"] == 3


def test_clean_transfer_verifies(pair: tuple[Engine, Engine], tmp_path: Path) -> None:
    prefill, decode = pair
    prefill_then_reserve(prefill, decode, "clean")
    transfer(prefill, "clean", decode)
    out = decode.received("clean")
    assert out.invalid_block_ids == set()
    stats = decode.work.watch.stats
    assert stats.get("verifications", "checksum") == 1
    assert stats.get("verifications", "page_tag") == 1
    assert stats.get("verifications", "canary") == 2  # free canary at alloc, reserved at admit
    assert not decode.work.worker.verdicts


def _caught(decode: Engine, rid: str, out: KVConnectorOutput) -> set[tuple[str, str]]:
    ids = {b.block_id for b in decode.blocks[rid]}
    assert out.invalid_block_ids and out.invalid_block_ids <= ids
    return {(v.detector, v.kind or "") for v in decode.work.worker.verdicts}


def test_flipped_byte_is_a_load_error(pair: tuple[Engine, Engine]) -> None:
    prefill, decode = pair
    prefill_then_reserve(prefill, decode, "flip")
    transfer(prefill, "flip", decode)
    view = next(iter(decode.kv.values()))
    view[decode.blocks["flip"][1].block_id].view(torch.uint8).view(-1)[37] ^= 0x10
    assert _caught(decode, "flip", decode.received("flip")) == {("checksum", "digest")}


def test_missing_block_is_a_load_error(pair: tuple[Engine, Engine]) -> None:
    prefill, decode = pair
    prefill_then_reserve(prefill, decode, "miss")
    transfer(prefill, "miss", decode, skip=2)
    out = decode.received("miss")
    caught = _caught(decode, "miss", out)
    assert ("canary", "unwritten_page") in caught and ("checksum", "digest") in caught
    assert decode.blocks["miss"][2].block_id in out.invalid_block_ids


def test_block_reallocated_before_read_is_a_load_error(pair: tuple[Engine, Engine]) -> None:
    prefill, decode = pair
    prefill_then_reserve(prefill, decode, "stale")
    transfer(prefill, "stale", decode)
    # A stale reference: the block pool takes a block back and hands it to another request
    # before the load was read.
    victim = decode.blocks["stale"][0]
    decode.pool.free_blocks([victim])
    (thief,) = decode.pool.get_new_blocks(1)
    assert thief.block_id == victim.block_id
    out = decode.received("stale")
    assert ("page_tag", "stale_tag") in _caught(decode, "stale", out)
    assert victim.block_id in out.invalid_block_ids


def test_log_mode_records_but_serves(tmp_path: Path) -> None:
    prefill = Engine("kv_producer", str(tmp_path), mode="log")
    decode = Engine("kv_consumer", str(tmp_path), mode="log")
    prefill_then_reserve(prefill, decode, "logged")
    transfer(prefill, "logged", decode, skip=0)
    assert decode.received("logged").invalid_block_ids == set()
    assert decode.work.worker.verdicts


def test_block_outermost_layout(tmp_path: Path) -> None:
    prefill = Engine("kv_producer", str(tmp_path), layout=KVCacheLayout.BLHNC)
    decode = Engine("kv_consumer", str(tmp_path), layout=KVCacheLayout.BLHNC)
    assert decode.work.worker.pool.page_bytes == decode.kcc.kv_cache_tensors[0].block_stride
    prefill_then_reserve(prefill, decode, "blk")
    transfer(prefill, "blk", decode)
    assert decode.received("blk").invalid_block_ids == set()


def test_unsupported_layout_is_counted_not_guessed(tmp_path: Path) -> None:
    decode = Engine("kv_consumer", str(tmp_path), layout=KVCacheLayout.LHBNC)
    assert decode.work.worker is None
    assert decode.work.watch.stats.get("verifications_skipped", "checksum", "unsupported_layout")


def test_through_multiconnector(tmp_path: Path) -> None:
    """The same detections with kvwatch as a MultiConnector child (beside ExampleConnector, a
    real connector that runs on CPU): metadata, worker metadata and load errors all pass through
    MultiConnector's aggregation."""
    prefill = Engine("kv_producer", str(tmp_path), sibling="ExampleConnector")
    decode = Engine("kv_consumer", str(tmp_path), sibling="ExampleConnector")
    prefill_then_reserve(prefill, decode, "multi")
    transfer(prefill, "multi", decode, skip=1)
    out = decode.received("multi")
    assert decode.blocks["multi"][1].block_id in out.invalid_block_ids


def test_beside_nixl_the_seal_joins_nixls_params(tmp_path: Path, model: str) -> None:
    """Scheduler halves: real MultiConnector over kvwatch and the real NixlConnector. The seal
    lands inside NIXL's kv_transfer_params (filled after request_finished), decode's NIXL takes
    the load (kvwatch claims no tokens), and kvwatch still verifies and reports it."""
    prefill = Engine("kv_producer", str(tmp_path), model=model, sibling="NixlConnector")
    decode = Engine("kv_consumer", str(tmp_path), model=model, sibling="NixlConnector")
    params = prefill_then_reserve(prefill, decode, "nixl")
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    assert params["kvwatch"]["seals"]["0"]["page_count"] == len(params["remote_block_ids"][0])
    assert decode.matched["nixl"] == (decode.requests["nixl"].num_prompt_tokens, True)
    transfer(prefill, "nixl", decode, skip=0)
    out = decode.received("nixl")
    assert decode.blocks["nixl"][0].block_id in out.invalid_block_ids


def test_records_land_in_the_spool(pair: tuple[Engine, Engine], tmp_path: Path) -> None:
    prefill, decode = pair
    prefill_then_reserve(prefill, decode, "spooled")
    transfer(prefill, "spooled", decode, skip=1)
    decode.received("spooled")
    for engine in pair:
        engine.work.shutdown()
        engine.sched.shutdown()
    contents = read_spool(tmp_path)
    assert not sum(contents.errors.values())
    events = contents.events(request_id="spooled")
    assert {e["detector"] for e in events} >= {"canary", "checksum"}
    assert all(e["action"] == "enforced" for e in events)
    hellos = [r for r in contents.records if r["type"] == "hello"]
    assert {(h["engine"], h["role"]) for h in hellos} >= {("vllm", "prefill"), ("vllm", "decode")}
    assert {h["engine_version"] for h in hellos} == {"0.33.0"}
    counters = contents.latest_counters()
    assert counters["verifications"]
    gauges = {g[0]: g[2] for r in contents.records if r["type"] == "gauges" for g in r["gauges"]}
    assert gauges == {
        "kv_pool_tokens": (NUM_BLOCKS - 1) * BLOCK_SIZE,
        "context_length_tokens": MAX_MODEL_LEN,
        "page_size_tokens": BLOCK_SIZE,
    }


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


def test_hooks_never_raise_into_the_engine(pair: tuple[Engine, Engine]) -> None:
    _, decode = pair
    decode.sched.update_state_after_alloc(object(), object(), 0)  # not a Request
    assert decode.sched.request_finished_all_groups(object(), ([1],)) == (False, None)
    decode.sched.bind_connector_metadata(object())
    decode.work.bind_connector_metadata(object())  # not kvwatch metadata: ignored
    decode.work.start_load_kv(None)
    assert decode.sched.watch.stats.get("hook_errors", "reserve") >= 1
    assert decode.sched.watch.stats.get("hook_errors", "seal") >= 1


def test_late_write_into_a_freed_block(pair: tuple[Engine, Engine]) -> None:
    """A write that lands after the block went back to vLLM's free list (an aborted transfer's
    late RDMA write) is caught when the block pool hands the block out again."""
    _, decode = pair
    decode.add("gone", 8, {})
    decode.allocate("gone", schedule=False)
    decode.step()
    freed = decode.blocks["gone"]
    decode.pool.free_blocks(freed)
    decode.step()  # the worker stamps free canaries on the freed blocks
    decode.write("gone", 99)  # the late write
    again = decode.pool.get_new_blocks(len(freed))
    assert {b.block_id for b in again} == {b.block_id for b in freed}
    decode.step()
    kinds = {(v.detector, v.kind) for v in decode.work.worker.verdicts}
    assert ("canary", "write_to_free_page") in kinds


def test_prefix_cached_blocks_are_never_stamped(pair: tuple[Engine, Engine]) -> None:
    """A freed block that keeps a prefix-cache hash stays readable (a later hit reads it): no
    canary may be written into it."""
    prefill, _ = pair
    prefill.add("cached", 8, {})
    prefill.allocate("cached", schedule=False)
    prefill.step({"cached": 5})
    block = prefill.blocks["cached"][0]
    before = [view[block.block_id].clone() for view in prefill.kv.values()]
    block.set_block_hash(b"\x01" * 32)  # what cache_full_blocks does to a full block
    prefill.pool.free_blocks([block])
    prefill.step()
    after = [view[block.block_id] for view in prefill.kv.values()]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"tp": 2}, "other"),
        ({"block_size": BLOCK_SIZE * 2}, "unsupported_layout"),
        ({"seals": None}, "no_seal"),
    ],
)
def test_seals_that_cannot_apply_are_skipped_with_a_reason(
    tmp_path: Path, model: str, change: dict[str, object], reason: str
) -> None:
    prefill = Engine("kv_producer", str(tmp_path), model=model)
    decode = Engine("kv_consumer", str(tmp_path), model=model)
    prefill.add("r", 10, {"do_remote_decode": True})
    prefill.allocate("r")
    params = prefill.finish("r", prefill.step({"r": 1}))
    params["kvwatch"].update(change)
    if params["kvwatch"]["seals"] is None:
        del params["kvwatch"]["seals"]
    decode.add("r", 10, {"do_remote_prefill": True, **params})
    decode.allocate("r", schedule=False)
    decode.step()
    transfer(prefill, "r", decode)
    assert decode.received("r").invalid_block_ids == set()
    stats = decode.work.watch.stats
    assert stats.get("verifications_skipped", "checksum", reason) == 1
    assert stats.get("verifications", "page_tag") == 1  # the other detectors still ran
