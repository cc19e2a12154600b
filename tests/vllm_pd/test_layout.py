"""A misconfigured pair in real vLLM PD servers: prefill's KV is float16, decode's bfloat16.

Both types are two bytes an element, so the blocks have the same size and NIXL copies them bit
for bit; with vLLM's handshake compatibility check off (``enforce_handshake_compat: false``,
which operators set when the two sides' model paths differ), nothing stops the pair. Decode
then reads float16 bits as bfloat16: without kvwatch the reply is HTTP 200 and wrong; with
kvwatch the seal's layout signature differs from decode's before anything reads the KV, a
``layout_mismatch`` that enforce mode fails. A byte checksum cannot see this: the bytes are
intact.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.vllm_pd.bed import ROOT, Bed, Server, serving, transfer_config, transport_child
from tests.vllm_pd.test_pd import SPOOL_WAIT_S, describe, findings, prompt

MODEL = ROOT / "build" / "vllm-pd-model"
#: vLLM's NIXL refuses a peer whose model, dtype or KV dtype hash differs, unless told not to.
NO_COMPAT = {"enforce_handshake_compat": False}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    assert (MODEL / "model.safetensors").is_file(), "run tests/vllm_pd/setup_env.sh first"
    workdir = tmp_path_factory.mktemp("layout")
    storage = workdir / "kv-storage"
    storage.mkdir()
    # decode-bare runs no kvwatch: its spool stays empty (Bed.pd reads every decode's).
    spools = {n: workdir / f"spool-{n}" for n in ("prefill", "decode-bare", "decode-enforce")}
    for spool in spools.values():
        spool.mkdir()

    def kvwatch(name: str, role: str, mode: str) -> dict[str, Any]:
        return transfer_config(
            "nixl", role, spools[name], mode, storage, False, node=name, nixl_extra=NO_COMPAT
        )

    bare = transport_child("nixl", "kv_consumer", storage, nixl_extra=NO_COMPAT)
    prefill = Server(
        "prefill", MODEL, workdir, kvwatch("prefill", "kv_producer", "enforce"),
        args=["--dtype", "float16"],
    )  # fmt: skip
    decode = {
        # NIXL alone: what the pair serves without kvwatch.
        "bare": Server("decode-bare", MODEL, workdir, bare, args=["--dtype", "bfloat16"]),
        "enforce": Server(
            "decode-enforce", MODEL, workdir, kvwatch("decode-enforce", "kv_consumer", "enforce"),
            args=["--dtype", "bfloat16"],
        ),
    }  # fmt: skip
    with serving([prefill, *decode.values()]):
        yield Bed("nixl", prefill, decode, spools, storage)


def test_without_kvwatch_the_misread_reply_is_200_and_wrong(pair: Bed) -> None:
    text = "layout bare " + prompt(31, 60)
    alone = pair.decode["bare"].complete(text, 12)  # decode's own engine, no PD: the reference
    assert alone.status_code == 200
    served = pair.pd("bare", text, 12)
    assert served.status == 200, served.body
    assert served.token_ids != alone.json()["choices"][0]["token_ids"]


def test_with_kvwatch_the_mismatch_is_caught_before_the_read(pair: Bed) -> None:
    server = "decode-enforce"
    served = pair.pd("enforce", "layout enforce " + prompt(32, 60), 12)
    deadline = time.monotonic() + SPOOL_WAIT_S
    while not findings(pair, server) and time.monotonic() < deadline:
        time.sleep(0.5)
    found = findings(pair, server)
    assert [(e["detector"], e["kind"], e["action"]) for e in found] == [
        ("checksum", "layout_mismatch", "enforced")
    ], describe(found)
    detail = found[0]["detail"]
    assert (detail["field"], detail["sealed"], detail["read"]) == ("dtype", "float16", "bfloat16")
    assert found[0].get("sources", []) == []  # nobody else's KV: the request's own, misread
    assert served.status != 200  # enforce: vLLM's kv_load_failure_policy fails it
    assert describe(findings(pair, "prefill")) == []
