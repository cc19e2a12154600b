"""kvwatch's device check kit: one command on a GPU machine, each figure against a baseline
measured in the same run (``make gpu-check``; under 8 minutes on one H200).

  1. correctness: the Triton seal and the torch path on random pools of every layout (SGLang
     MHA and MLA token-slot buffers, vLLM page-leading buffers) and dtype (bf16, fp16, fp32,
     fp8 e4m3/e5m2 stored as uint8) equal zlib over the same bytes copied to the host; the
     batched canary and tag kernels find planted faults and nothing on clean pools;
  2. seal throughput in GB/s over a 4 GiB pool of 64-token pages, page table in order and
     shuffled, against a device-to-device copy of the same bytes and against the torch path;
  3. the per-decode-step page-tag check at batch 256 with 2,000-token contexts against a bf16
     matmul step of a Llama-3-8B-sized decoder at the same batch (share of the step), and the
     host CPU time of that hook per call;
  4. minipd with its KV pools on the device (one process per role, one GPU): SGLang 0.5.19's
     leak reproduced and caught by the detectors.

``--dry`` runs the same code on CPU tensors with small sizes and the kernels under Triton's
interpreter (what ``make test`` runs): it proves the kit works, its times mean nothing.

Air-gapped GPU machines (python3 with torch and triton, no package index): see README.md,
"Running the GPU check without a package index". In short, on a machine with an index::

    pip download -d kvwatch-wheels prometheus-client structlog nvidia-ml-py zlib-ng msgspec \\
        numpy --only-binary=:all: --python-version 3.11 --platform manylinux2014_x86_64
    pip wheel --no-deps -w kvwatch-wheels .

then on the GPU machine::

    pip install --no-index --find-links kvwatch-wheels kvwatch
    python bench/gpu_check.py

Exit status 0 when every correctness check passes (figures are printed, never judged).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if "--dry" in sys.argv:  # the kernels are built for the interpreter when first imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch

from engine_hooks import KVWatch, Mode, PagedKVPool, Ticket, canary, kernels
from engine_hooks.pagestate import DevicePages
from engine_hooks.pool import Layout


@dataclass(frozen=True)
class Sizes:
    pool_bytes: int  # the throughput pool
    page_tokens: int
    batch: int  # running requests per decode step
    context: int  # tokens per request
    hidden: int  # the matmul step: a Llama-3-8B-shaped decoder layer
    ffn: int
    kv_width: int
    layers: int
    repeat: int


FULL = Sizes(4 << 30, 64, 256, 2000, 4096, 14336, 1024, 32, 20)
DRY = Sizes(256 << 10, 64, 8, 200, 64, 128, 32, 2, 2)

KINDS = ("mha", "mla", "vllm")
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
FAILURES: list[str] = []


def check(label: str, ok: bool) -> None:
    print(f"  {'ok  ' if ok else 'FAIL'} {label}", flush=True)
    if not ok:
        FAILURES.append(label)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Best wall seconds of ``fn`` over ``repeat`` runs, the device drained around each."""
    fn()
    sync(device)
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - started)
    return best


# -- 1. correctness ---------------------------------------------------------------------------


def random_pool(kind: str, dtype: torch.dtype, pages: int, device: torch.device) -> PagedKVPool:
    """A pool shaped as the engines shape theirs, filled with random bytes."""
    fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    storage, page = (torch.uint8 if fp8 else dtype), 4
    shapes: list[tuple[int, ...]]
    if kind == "mha":
        shapes, layout = [(pages * page, 2, 8)] * 4, Layout.TOKENS
    elif kind == "mla":
        shapes, layout = [(pages * page, 1, 24)] * 2, Layout.TOKENS
    else:
        shapes, layout = [(pages, page, 2, 8)] * 4, Layout.PAGES
    buffers = []
    for shape in shapes:
        raw = torch.randint(0, 256, shape, dtype=torch.uint8, device=device)
        size = torch.empty((), dtype=storage).element_size()
        buffers.append(raw.view(-1).view(storage).reshape(*shape[:-1], shape[-1] // size))
    return PagedKVPool(buffers, page, layout=layout, kv_dtype=dtype if fp8 else None)


def host_stream(pool: PagedKVPool, table: list[int]) -> bytes:
    index = torch.tensor(table, device=pool.device)
    return b"".join(v.index_select(0, index).cpu().numpy().tobytes() for v in pool.page_views)


def correctness(device: torch.device) -> None:
    print("\n== 1. correctness (baseline: zlib.adler32 over the same bytes copied to the host)")
    rng = random.Random(0)
    for kind in KINDS:
        for dtype in DTYPES:
            pool = random_pool(kind, dtype, 24, device)
            table = rng.sample(range(24), 17)
            want = zlib.adler32(host_stream(pool, table))
            seal = pool.device_checksum(table, kernel=True)
            torch_path = pool.device_checksum(table, kernel=False)
            name = f"{kind} {str(dtype).removeprefix('torch.')}"
            check(f"seal {name}: triton {seal:#010x} torch {torch_path:#010x} zlib {want:#010x}",
                  seal == torch_path == want)  # fmt: skip
            pages_checks(pool, name, rng)


def pages_checks(pool: PagedKVPool, name: str, rng: random.Random) -> None:
    """Reserved canaries at admit, free canaries at alloc, page tags per step: the kernels
    find exactly the planted faults, and nothing on a clean pool."""
    state = DevicePages(pool, kernel=True)
    device = pool.device
    pages = torch.tensor(rng.sample(range(pool.num_pages), 12), device=device)
    state.bump(pages)
    gens = state.generations(pages)
    state.stamp(pages, gens, canary.Purpose.RESERVED)
    unwritten = {3, 7}  # a writer writes every page but these
    for i in range(12):
        if i not in unwritten:
            for view in pool.page(int(pages[i])):
                view.copy_(torch.randint(0, 0x7F, view.shape, dtype=torch.uint8, device=device))
    found = state.intact(pages, gens, canary.Purpose.RESERVED)
    found_ids = set(found.nonzero().view(-1).tolist())
    check(f"reserved canary {name}: unwritten pages found", found_ids == unwritten)
    state.own_writes(pages)
    stale = state.stale(pages, gens)
    check(f"page tags {name}: clean batch, nothing stale", not bool(stale.any()))
    pool.tag_store[pages[5]] += 1  # a late writer of another generation
    state.bump(pages[9:10])  # a page freed and handed out again
    planted = set(state.stale(pages, gens).nonzero().view(-1).tolist())
    check(f"page tags {name}: planted stale pages found", planted == {5, 9})
    state.stamp(pages, gens, canary.Purpose.FREE)
    pool.page(int(pages[2]))[0][:4] = 1  # a write into a free page's stamp
    intact = state.intact(pages, gens, canary.Purpose.FREE)
    check(f"free canary {name}: the write into a free page found",
          set((~intact).nonzero().view(-1).tolist()) == {2})  # fmt: skip


# -- 2. seal throughput -----------------------------------------------------------------------


def throughput(device: torch.device, sizes: Sizes) -> None:
    # Llama-3-8B's per-layer K and V at bf16: 8 KV heads x 128 = 2 KiB per token per buffer.
    buffers_count, token_bytes = 64, 2048
    if sizes is DRY:
        buffers_count, token_bytes = 4, 64
    page_bytes = token_bytes * sizes.page_tokens
    pages = max(2, sizes.pool_bytes // (page_bytes * buffers_count))
    buffers = [
        torch.randint(0, 256, (pages * sizes.page_tokens, token_bytes), dtype=torch.uint8,
                      device=device)
        for _ in range(buffers_count)
    ]  # fmt: skip
    pool = PagedKVPool(buffers, sizes.page_tokens)
    nbytes = pool.page_bytes * pool.num_pages
    print(
        f"\n== 2. seal throughput: {nbytes / 2**30:.2f} GiB, {pool.num_pages} pages of "
        f"{sizes.page_tokens} tokens x {buffers_count} buffers ({page_bytes >> 10} KiB per page "
        f"per buffer); kernel constants {kernels.launch_config()}"
    )
    dst = [torch.empty_like(b) for b in buffers]
    copy = timed(
        lambda: [d.copy_(s) for d, s in zip(dst, buffers, strict=True)], device, sizes.repeat
    )
    dst.clear()  # the copy's memory back before the seals run
    print(f"  {'device-to-device copy (baseline)':<36} {nbytes / copy / 1e9:9.1f} GB/s  1.00x copy")
    in_order = torch.arange(pool.num_pages, device=device)
    shuffled = in_order[torch.randperm(pool.num_pages, device=device)]
    for name, table in (("in order", in_order), ("shuffled", shuffled)):
        seal = timed(lambda t=table: pool.device_checksum(t, kernel=True), device, sizes.repeat)
        old = timed(lambda t=table: pool.device_checksum(t, kernel=False), device,
                    max(1, sizes.repeat // 4))  # fmt: skip
        print(f"  {'triton seal, ' + name:<36} {nbytes / seal / 1e9:9.1f} GB/s  "
              f"{copy / seal:5.2f}x copy  {old / seal:6.1f}x the torch path")  # fmt: skip
        gbps = nbytes / old / 1e9
        print(f"  {'torch path, ' + name:<36} {gbps:9.1f} GB/s  {copy / old:5.2f}x copy")


# -- 3. per-step page checks ------------------------------------------------------------------


def no_sync_per_step(watch: KVWatch, tickets: list[Ticket], pages: torch.Tensor) -> None:
    """The per-step path never synchronises: the batch check, and a page for every request
    (``extend_each``, a decode step at page size 1), under CUDA's sync debug mode, which raises
    on any sync; a hook counts what it catches, so the count is what is checked."""
    before = sum(watch.counter("hook_errors", h) for h in ("step", "reserve"))
    lengths = [len(t.pages) for t in tickets]
    torch.cuda.set_sync_debug_mode("error")
    try:
        watch.check_batch(tickets)
        watch.extend_each(tickets, pages)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    after = sum(watch.counter("hook_errors", h) for h in ("step", "reserve"))
    check("per-step hooks: no device sync (CUDA sync debug mode)", after == before)
    grown = [len(t.pages) - n for t, n in zip(tickets, lengths, strict=True)]
    check("per-step hooks: each ticket got its one page", grown == [1] * len(tickets))
    watch.resolve()


def step_cost(device: torch.device, sizes: Sizes) -> None:
    per_request = -(-sizes.context // sizes.page_tokens)
    num_pages = sizes.batch * per_request + 1 + sizes.batch  # a page more for each: extend_each
    buffers = [torch.zeros((num_pages * sizes.page_tokens, 16), dtype=torch.bfloat16,
                           device=device)]  # fmt: skip
    pool = PagedKVPool(buffers, sizes.page_tokens)
    watch = KVWatch(pool, role="decode", engine="gpu-check", mode=Mode.LOG)
    assert watch._state is not None
    order = torch.randperm(num_pages - 1, device=device) + 1
    tickets = []
    for r in range(sizes.batch):
        ticket = watch.on_reserve(f"r{r}", order[r * per_request : (r + 1) * per_request])
        assert isinstance(ticket, Ticket)
        watch._state.own_writes(ticket.pages)
        tickets.append(ticket)
    clean = watch.check_batch(tickets) + watch.resolve()  # on CPU at once, on a GPU at resolve
    check("per-step tags: a clean batch gives no finding", clean == [])
    print(
        f"\n== 3. per-decode-step page checks: batch {sizes.batch}, {sizes.context}-token "
        f"contexts, {sizes.batch * per_request} pages of {sizes.page_tokens} tokens"
    )
    calls = 50 if sizes is FULL else 3
    started = time.process_time()
    for _ in range(calls):
        watch.check_batch(tickets)
    host = (time.process_time() - started) / calls
    sync(device)
    checks = timed(lambda: watch.check_batch(tickets), device, sizes.repeat)
    watch.resolve()
    # Baseline: one decode step's bf16 matmuls of a Llama-3-8B-shaped model at this batch.
    dtype = torch.bfloat16
    h, f, kv = sizes.hidden, sizes.ffn, sizes.kv_width
    x = torch.randn(sizes.batch, h, dtype=dtype, device=device)
    weights = [torch.randn(h, h + 2 * kv, dtype=dtype, device=device) / 64,
               torch.randn(h, h, dtype=dtype, device=device) / 64,
               torch.randn(h, 2 * f, dtype=dtype, device=device) / 64,
               torch.randn(f, h, dtype=dtype, device=device) / 64]  # fmt: skip

    def decode_step() -> None:
        for _ in range(sizes.layers):
            x @ weights[0]
            x @ weights[1]
            (x @ weights[2])[:, :f] @ weights[3]

    step = timed(decode_step, device, sizes.repeat)
    print(f"  {'bf16 matmul step (baseline)':<36} {1e6 * step:10.1f} us")
    print(f"  {'page-tag check of the batch':<36} {1e6 * checks:10.1f} us  "
          f"{100 * checks / step:6.2f}% of the step")  # fmt: skip
    print(f"  {'  its host CPU per call':<36} {1e6 * host:10.1f} us  "
          f"{1e6 * host / sizes.batch:6.2f} us per running request")  # fmt: skip
    if device.type == "cuda":
        no_sync_per_step(watch, tickets, order[sizes.batch * per_request :])
    # A planted fault in the same batch is found (read at the engine's next sync point).
    pool.tag_store[tickets[7].pages[3]] += 1
    found = watch.check_batch(tickets) + watch.resolve()
    check("per-step tags: a planted stale page is found",
          [(v.request_id, v.kind) for v in found] == [("r7", "stale_tag")])  # fmt: skip
    watch.close()


# -- 4. minipd on the device ------------------------------------------------------------------


def minipd_leak(device: torch.device) -> None:
    print(f"\n== 4. minipd with its pools on {device.type}: SGLang 0.5.19's leak, kvwatch log")
    root = Path(__file__).resolve().parents[1]
    path = [str(root), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, "-m", "minipd", "demo", "--device", device.type],
        capture_output=True, text=True, timeout=300, check=False, env=env,
    )  # fmt: skip
    out = done.stdout
    check(f"minipd demo exits 0 (rc {done.returncode})", done.returncode == 0)
    check("the leak reproduced: other users' codes in the reply",
          "other users' codes in the reply: ['CANARY-" in out)  # fmt: skip
    for detector in ("canary", "checksum", "page_tag"):
        check(f"caught by {detector}", f"detector={detector}" in out)
    if done.returncode != 0:
        print(done.stderr[-2000:])


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="CPU, small sizes, interpreter")
    parser.add_argument("--skip-minipd", action="store_true")
    args = parser.parse_args()
    started = time.monotonic()
    if args.dry:
        device, sizes = torch.device("cpu"), DRY
        print("gpu-check DRY RUN: CPU tensors, Triton interpreter; the times mean nothing")
    else:
        if not torch.cuda.is_available():
            print("gpu-check: no CUDA device (use --dry on a machine without one)")
            return 2
        device, sizes = torch.device("cuda"), FULL
        print(f"gpu-check on {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    import triton

    print(f"triton {triton.__version__}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    correctness(device)
    throughput(device, sizes)
    step_cost(device, sizes)
    if not args.skip_minipd:
        minipd_leak(device)
    print(f"\ngpu-check: {len(FAILURES)} failed check(s) in {time.monotonic() - started:.0f} s")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    raise SystemExit(main())
