"""The SGLang PD bed: real SGLang 0.5.23 servers (prefill, decode) and the smg router on CPU.

Every server is ``python -m sglang.launch_server`` in its own process group, started by this
test process inside a network namespace that has only loopback (tests/sglang_pd/run.sh): SGLang
itself starts the scheduler processes, loads kvwatch through ``SGLANG_PLUGINS`` in each,
bootstraps the transfer and moves the KV (Mooncake over TCP, or NIXL over UCX/TCP). The CPU
shims (README.md here) are a second plugin, ``cpu_bed``, never part of kvwatch.

Requests go through the router (``smg``) the way a client sends them, or, for a decode server
behind no router, the way the router sends them: the same body to prefill and to decode, with
the prefill's bootstrap address and a fresh room. Every wait has a deadline; every process
group is killed on exit, failure included.
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import requests

from engine_hooks.testing import SpoolContents, read_spool

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "build" / "sglang-pd-model"
#: The servers' PYTHONPATH beyond the checkout: the sgl_kernel stand-in and the entry points of
#: the bed's plugins (setup_env.sh), kept out of the venv the class bed shares.
SHIMS = [ROOT / "tests" / "sglang_pd" / "stubs", ROOT / "build" / "sglang-pd-site"]
START_TIMEOUT_S = 300.0  # three servers starting together on a busy 2-core machine
ROUTER_TIMEOUT_S = 150.0  # a busy machine: the router's first checks may time out
REQUEST_TIMEOUT_S = 120.0
KVWATCH_ABORT = "kvwatch: KV cache integrity check failed"
PAGE_SIZE = 16
#: Each decode's page size in the bed (and its own prefill's: a transfer moves whole pages),
#: kvwatch's modes crossed with SGLang's default page size (1: a page is one token slot) and
#: 16, one deployment per transport: the log decode (decode radix cache off, behind the
#: router) at 1, the enforce decode (radix cache on, whose dedup once gave a false page) at 16.
PAGE_SIZES = {"log": 1, "enforce": PAGE_SIZE}
CONTEXT = 1024
POOL_TOKENS = 8192
RADIX_POOL_TOKENS = 1536  # the enforce decode's (radix cache on): 96 pages of 16
#: The deferred-release case's decode (test_pd_drain.py), beside the Mooncake bed's own and
#: reading from its prefill at page size 16: a pool of 64 pages, so that freed pages are reused
#: at once; SGLang's deferred-release timeout (30 s by default) long enough for the drained
#: control's ACK on a slow machine; kvwatch's window (10 s by default), in which three PD
#: requests must be done.
DRAIN_TRANSPORT = "mooncake_tcp"
DRAIN_POOL_TOKENS = 1024
DRAIN_RELEASE_TIMEOUT_S = 8.0
DRAIN_WINDOW_S = 10.0

#: SGLang's flags for a CPU-only machine (README.md: what each one replaces).
CPU_FLAGS = [
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    "--disable-cuda-graph",
    "--dtype", "float32",
    "--skip-server-warmup",
    # An idle scheduler waits on its sockets instead of spinning: three or four servers on two
    # cores, each idle one otherwise holding most of a core from the others.
    "--sleep-on-idle",
]  # fmt: skip


#: The ports the bed hands out: under the kernel's ephemeral range, where bind(0), connect()
#: and ZMQ's random ports (Mooncake's and NIXL's listeners) take theirs, and above SGLang's
#: own range for its NCCL port (22,000-29,999) and Mooncake's RPC ports (15,000-17,000). A
#: port a server binds only seconds later, once its schedulers are up, stays free meanwhile:
#: one from bind(0) was once taken by another server's listener (its router failed to bind).
PORTS = range(30000, 32768)
_ports = iter(PORTS)


def free_port() -> int:
    """A port nothing listens on, each handed out once per test session."""
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert ephemeral > PORTS[-1], f"the ephemeral range starts at {ephemeral} (run.sh sets it)"
    for port in _ports:
        with socket.socket() as s, suppress(OSError):
            s.bind(("0.0.0.0", port))  # every interface: Mooncake listens on all of them
            return port
    raise RuntimeError(f"sglang-pd bed: no free port left in {PORTS}")


def only_loopback() -> bool:
    """True inside a network namespace whose only interface is loopback."""
    return sorted(os.listdir("/sys/class/net")) == ["lo"]


@cache
def other_model_archs() -> str:
    """Every model module of SGLang's but Llama's (both of the bed's models are
    ``LlamaForCausalLM``), for ``SGLANG_DISABLED_MODEL_ARCHS``: SGLang's model registry
    otherwise imports all 255 of them in each scheduler at start-up (1.8 CPU-seconds of the
    48 a server takes here), as a deployment serving one model does not need to."""
    spec = importlib.util.find_spec("sglang")  # its location only: importing it takes seconds
    assert spec is not None and spec.submodule_search_locations, "sglang is not installed"
    models = Path(spec.submodule_search_locations[0]) / "srt" / "models"
    names = sorted(p.stem for p in models.glob("*.py") if p.stem not in {"__init__", "llama"})
    assert names, f"no SGLang models under {models}"
    return ",".join(names)


def base_env(spool: Path | None, mode: str, plugins: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(map(str, [ROOT, *SHIMS])),
        SGLANG_DISABLED_MODEL_ARCHS=other_model_archs(),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        SGLANG_HOST_IP="127.0.0.1",  # no interface but loopback: SGLang's own guess fails
        SGLANG_USE_CPU_ENGINE="1",
        # A cached prefix sent early creates a torch.cuda.Event (disaggregation/prefill.py).
        SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX="0",
        SGLANG_PLUGINS=plugins,
        UCX_NET_DEVICES="lo",
        UCX_TLS="tcp,self,sm",
        KVWATCH_MODE=mode,
    )
    if spool is not None:
        env["KVWATCH_SPOOL"] = str(spool)
    return env


@dataclass
class Process:
    name: str
    cmd: list[str]
    env: dict[str, str]
    workdir: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None
    reaped: bool = False  # its group was killed (stop_all)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.workdir / f"{self.name}.log"

    @property
    def spool(self) -> Path:
        """Its kvwatch spool (a server's; ``sglang_server``)."""
        return self.workdir / f"spool-{self.name}"

    def start(self) -> None:
        # A test process killed outright (no teardown) takes the server with it.
        cmd = ["setpriv", "--pdeathsig", "TERM", "--", *self.cmd]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )

    def alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.tail()}")

    def wait_ready(self, deadline: float, path: str = "/health") -> None:
        while time.monotonic() < deadline:
            self.alive()
            with suppress(requests.RequestException):
                if requests.get(self.url + path, timeout=5).status_code == 200:
                    return
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} not ready:\n{self.tail()}")

    def signal_group(self, sig: int) -> None:
        # Never once reaped: its group id may since be another process's.
        if self.proc is not None and not self.reaped:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def reap(self, deadline: float) -> None:
        if self.proc is None or self.reaped:
            return
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        self.signal_group(signal.SIGKILL)
        self.reaped = True
        self.proc.wait(timeout=10)

    def tail(self, n: int = 60) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def sglang_server(
    name: str,
    workdir: Path,
    *,
    role: str | None,
    transport: str,
    mode: str = "log",
    plugins: str = "kvwatch,cpu_bed",
    extra: list[str] | None = None,
    page_size: int = PAGE_SIZE,
    tp: int = 1,
) -> tuple[Process, Path, int]:
    """A server process (not started), its kvwatch spool and its bootstrap port (prefill);
    ``tp``: its TP width (one scheduler per rank, each bound to a core of its own)."""
    port, bootstrap = free_port(), free_port()
    cmd = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(MODEL),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--page-size", str(page_size),
        "--context-length", str(CONTEXT),
        "--max-total-tokens", str(POOL_TOKENS),
        "--random-seed", "0",
        # SGLang draws one at random (22,000-29,999) that its scheduler binds only later: with
        # four servers starting at once, one scheduler found its draw taken (EADDRINUSE).
        "--nccl-port", str(free_port()),
        *CPU_FLAGS,
    ]  # fmt: skip
    if role is not None:
        cmd += ["--disaggregation-mode", role, "--disaggregation-transfer-backend", transport]
    if role == "prefill":
        cmd += ["--disaggregation-bootstrap-port", str(bootstrap)]
    if role == "decode":
        # The default host backup pool sizes itself from the cgroup and registers it with CUDA.
        cmd += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    if tp > 1:
        cmd += ["--tp-size", str(tp)]
    cmd += extra or []
    server = Process(name, cmd, {}, workdir, port)
    server.spool.mkdir(parents=True, exist_ok=True)
    server.env = base_env(server.spool, mode, plugins)
    if tp > 1:
        # SGLang refuses more ranks than NUMA nodes without it (one node here).
        server.env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % 2) for r in range(tp))
    return server, server.spool, bootstrap


def small_pool(tokens: int) -> list[str]:
    """A decode's flags for a pool of ``tokens``, with a decode reserve to match (SGLang's 512 by
    default would be much of it): freed pages are soon handed out again."""
    return ["--max-total-tokens", str(tokens), "--num-reserved-decode-tokens", "16"]


def router(workdir: Path, prefill: Process, bootstrap: int, decode: Process) -> Process:
    port = free_port()
    cmd = [
        sys.executable, "-m", "smg.cli", "launch",
        "--pd-disaggregation",
        "--prefill", prefill.url, str(bootstrap),
        "--decode", decode.url,
        "--host", "127.0.0.1",
        "--port", str(port),
        # Its metrics listen on 0.0.0.0:29000 by default.
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(free_port()),
        # Its workers are up before it starts: it checks them every second (default 30 s), so
        # it serves within seconds, not after a whole interval.
        "--worker-startup-check-interval", "1",
    ]  # fmt: skip
    return Process("router", cmd, base_env(None, "off", ""), workdir, port)


def stop_all(processes: list[Process], grace_s: float = 3.0) -> None:
    """SIGTERM to each main process alone, which stops its own schedulers (SGLang's graceful
    exit), then, after ``grace_s``, SIGKILL to what is left of each group: a server's drain
    and the router's clean-up take up to 5 s, for nothing a test reads. SIGTERM to the whole
    group reached the schedulers first, and SGLang's main process took their deaths for a crash
    and waited 5 s for crash diagnostics, at every teardown."""
    for p in processes:
        if p.proc is not None and p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    failed: list[Exception] = []
    for p in processes:  # every group killed, whichever one fails to go
        try:
            p.reap(deadline)
        except (OSError, subprocess.SubprocessError) as error:
            failed.append(error)
    if failed:
        raise failed[0]


@dataclass
class Reply:
    status: int
    output_ids: list[int] | None
    body: str
    meta: dict[str, Any] = field(default_factory=dict)


def generate_body(text: str, max_tokens: int, rid: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "text": text,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    }
    if rid is not None:
        body["rid"] = rid
    return body


def with_room(body: dict[str, Any], bootstrap: int) -> dict[str, Any]:
    """The body with prefill's bootstrap address and a fresh room (what a PD router adds)."""
    return body | {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap,
        "bootstrap_room": random.getrandbits(62),
    }


def post(url: str, body: dict[str, Any]) -> Reply:
    try:
        r = requests.post(url + "/generate", json=body, timeout=REQUEST_TIMEOUT_S)
    except requests.RequestException as e:
        return Reply(0, None, f"{type(e).__name__}: {e}"[:500])
    if r.status_code != 200:
        return Reply(r.status_code, None, r.text[:500])
    data = r.json()
    return Reply(200, data.get("output_ids"), "", data.get("meta_info") or {})


#: What a failed transfer (not a kvwatch finding) says on decode: retried once, named.
TRANSPORT_FAILURES = ("KVTransferError", "Failed to get kvcache", "transfer failed", "bootstrap")


def transport_failure(reply: Reply) -> str | None:
    if reply.status == 200 or KVWATCH_ABORT in reply.body:
        return None
    if reply.status == 0:
        return reply.body
    for cause in TRANSPORT_FAILURES:
        if cause.lower() in reply.body.lower():
            return reply.body
    return None


@dataclass
class Prefill:
    server: Process
    bootstrap: int


@dataclass
class Bed:
    transport: str
    prefills: dict[int, Prefill]  # by page size
    decode: dict[str, Process]  # by kvwatch mode
    router: Process  # in front of the log decode and its prefill
    spools: dict[str, Path]
    retried: list[str] = field(default_factory=list)
    #: PD requests each decode server served (HTTP 200): one transfer each.
    served: dict[str, int] = field(default_factory=lambda: {"log": 0, "enforce": 0})
    #: The deferred-release case's decode (Mooncake only), apart from ``decode`` and
    #: ``spools``: its findings are that test's, not the bed's.
    drain: Process | None = None

    @staticmethod
    def page_size(mode: str) -> int:
        return PAGE_SIZES[mode]

    def prefill(self, mode: str) -> Prefill:
        """The prefill that decode ``mode`` reads from (its own page size)."""
        return self.prefills[self.page_size(mode)]

    def via_router(self, text: str, max_tokens: int) -> Reply:
        send = lambda: post(self.router.url, generate_body(text, max_tokens))  # noqa: E731
        return self._count("log", self._retrying(send))

    def _count(self, mode: str, reply: Reply) -> Reply:
        self.served[mode] += reply.status == 200
        return reply

    def direct(self, mode: str, text: str, max_tokens: int, rid: str | None = None) -> Reply:
        """PD the way the router does it: one body to prefill and decode, a fresh room."""
        prefill = self.prefill(mode)

        def once() -> Reply:
            body = with_room(generate_body(text, max_tokens, rid), prefill.bootstrap)
            with ThreadPoolExecutor(2) as pool:
                first = pool.submit(post, prefill.server.url, body)
                served = pool.submit(post, self.decode[mode].url, body)
                first.result()
                return served.result()

        return self._count(mode, self._retrying(once))

    def _retrying(self, send: Any) -> Reply:
        served: Reply = send()
        cause = transport_failure(served)
        if cause is not None:  # a transport failure, never a finding: once more, named
            self.retried.append(f"{self.transport}: {cause}")
            print(f"sglang-pd bed: retrying after a transport failure: {cause}")
            served = send()
        return served

    def spool(self, name: str) -> SpoolContents:
        return read_spool(self.spools[name])

    def owners(self, mode: str) -> Path:
        """Decode ``mode``'s reserves and rows as SGLang held them (``drain_rows``,
        ``page_owners``; the radix decode only)."""
        return Path(self.decode[mode].env["KVWATCH_BED_OWNERS"])

    def servers(self) -> list[Process]:
        """The bed's SGLang servers (the drain decode not among them)."""
        return [*(p.server for p in self.prefills.values()), *self.decode.values()]

    def started(self) -> list[Process]:
        """Every SGLang server of the deployment, the drain decode too."""
        return [*self.servers(), *([self.drain] if self.drain else [])]

    def all_processes(self) -> list[Process]:
        return [*self.started(), self.router]


def reference_server(workdir: Path) -> Process:
    """One SGLang server, no PD, no kvwatch (not started): the reference output's."""
    server, _, _ = sglang_server("single", workdir, role=None, transport="", plugins="cpu_bed")
    return server


def reference_outputs(server: Process, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """The prompts served by the started reference server, which is then stopped."""
    with ExitStack() as stack:
        stack.callback(stop_all, [server])
        server.wait_ready(time.monotonic() + START_TIMEOUT_S)
        out = []
        for text in prompts:
            reply = post(server.url, generate_body(text, max_tokens))
            assert reply.status == 200 and reply.output_ids is not None, reply.body
            out.append(reply.output_ids)
        return out


@contextmanager
def serving_all(servers: list[Process]) -> Iterator[None]:
    """The servers started together and ready; every one stopped on exit."""
    with ExitStack() as stack:
        stack.callback(stop_all, servers)
        for server in servers:
            server.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in servers:
            server.wait_ready(deadline)
        yield


@contextmanager
def running_bed(transport: str, workdir: Path) -> Iterator[Bed]:
    """A prefill at each page size (kvwatch log, the corrupter), the log decode behind the
    router and the enforce decode, each at its page size (``PAGE_SIZES``); over Mooncake, the
    drain decode beside them."""
    assert only_loopback(), "run the bed inside a loopback-only netns (tests/sglang_pd/run.sh)"
    prefills: dict[int, Prefill] = {}
    spools: dict[str, Path] = {}
    for page_size in sorted(set(PAGE_SIZES.values())):
        server, spool, bootstrap = sglang_server(
            f"prefill-page{page_size}",
            workdir,
            role="prefill",
            transport=transport,
            plugins="kvwatch,cpu_bed,corrupt_after_seal",
            page_size=page_size,
        )
        prefills[page_size] = Prefill(server, bootstrap)
        spools[server.name] = spool
    decode: dict[str, Process] = {}
    for mode, page_size in PAGE_SIZES.items():
        # The decode radix cache off on one decode server, on on the other; that one's pool
        # small enough that the pages its cache's dedup frees are soon taken again (SGLang
        # hands out never-used pages first), with a decode reserve to match (512 by default).
        radix = (
            ["--disaggregation-decode-enable-radix-cache", *small_pool(RADIX_POOL_TOKENS)]
            if mode == "enforce"
            else []
        )
        server, spool, _ = sglang_server(
            f"decode-{mode}",
            workdir,
            role="decode",
            transport=transport,
            mode=mode,
            # Ground truth for the radix cache's dedup: SGLang's reserves and rows.
            plugins="kvwatch,cpu_bed,page_owners,drain_rows" if radix else "kvwatch,cpu_bed",
            extra=radix,
            page_size=page_size,
        )
        server.env["KVWATCH_BED_OWNERS"] = str(workdir / f"owners-decode-{mode}.jsonl")
        decode[mode] = server
        spools[server.name] = spool
    fronted = prefills[PAGE_SIZES["log"]]
    front = router(workdir, fronted.server, fronted.bootstrap, decode["log"])
    bed = Bed(transport, prefills, decode, front, spools)
    if transport == DRAIN_TRANSPORT:
        bed.drain = drain_decode(workdir)
    with ExitStack() as stack:
        stack.callback(stop_all, bed.all_processes())
        stack.enter_context(serving_all(bed.started()))
        front.start()
        warm_router(bed)
        yield bed


def drain_decode(workdir: Path) -> Process:
    """The deferred-release case's decode (kvwatch log, page size 16, ``DRAIN_*``)."""
    server, _, _ = sglang_server(
        "decode-drain",
        workdir,
        role="decode",
        transport=DRAIN_TRANSPORT,
        plugins="kvwatch,cpu_bed,page_owners,drain_rows",
        extra=small_pool(DRAIN_POOL_TOKENS),
    )
    server.env.update(
        SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT=str(DRAIN_RELEASE_TIMEOUT_S),
        KVWATCH_FREED_WATCH_S=str(DRAIN_WINDOW_S),
        KVWATCH_BED_OWNERS=str(workdir / "owners-decode-drain.jsonl"),
    )
    return server


def warm_router(bed: Bed) -> None:
    serving(bed.router)
    bed.served["log"] += 1


def serving(front: Process) -> None:
    """The router accepts its workers after its first health pass (seconds: it checks every
    second, ``router``)."""
    deadline = time.monotonic() + ROUTER_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
        front.alive()
        reply = post(front.url, generate_body("warm the router", 2))
        if reply.status == 200:
            return
        last = reply.body
        time.sleep(3.0)
    raise TimeoutError(f"router never served: {last}\n{front.tail(20)}")
