"""Throughput of kvwatch's per-page transfer checksum, as ratios against a read pass.

One run measures, on the same bytes of a paged KV pool (>= 256 MiB, many layers):
  - read pass: one single-threaded pass that reads every byte (the physical limit on one core),
  - kvwatch: PagedKVPool.checksum over a page table (what seal and verify do): one native loop
    over the pages' addresses calling zlib-ng per page (engine_hooks/_pageloop.c),
  - the previous path, one zlib-ng call from Python per page (shuffled table),
  - stdlib zlib.adler32 over each buffer whole,
and prints each in GB/s and as a ratio to the read pass. Page tables: every page in order, runs
of 8 consecutive pages (what a sorted free list hands out after churn) and a shuffled table
(every page its own run, the worst case). With a CUDA device it also times the device path
against a device-to-device copy of the same bytes.

Then the per-(block, KV head) seal of tensor-parallel pairs (engine_hooks/heads.py) on a vLLM
HND pool: the CPU path (zlib-ng per head row) and the device path run on CPU tensors (RowAdler,
what the CPU ran before), interleaved, each against the read pass and the whole-page seal.

    python bench/checksum.py [--mib 256] [--repeat 5]
"""

from __future__ import annotations

import argparse
import random
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from bench._timing import best_seconds
from engine_hooks import PagedKVPool, adler32
from engine_hooks.checksum import adler32_chunks, native_read, tensor_buffer
from engine_hooks.heads import HeadedPool
from engine_hooks.pool import Layout


@dataclass(frozen=True)
class Model:
    name: str
    buffers: int  # per-layer tensors (MHA: 2 per layer; MLA: 1)
    token_bytes: int  # bytes of one token in one buffer
    page_size: int


MODELS = [
    Model("llama-3-8b MHA bf16, page 16", 2 * 32, 8 * 128 * 2, 16),
    Model("deepseek-v3 MLA bf16, page 64", 61, 576 * 2, 64),
    Model("llama-3-70b TP8 MHA fp8, page 64", 2 * 80, 1 * 128 * 1, 64),
]


def build_pool(model: Model, mib: int, device: str) -> PagedKVPool:
    page_bytes = model.token_bytes * model.page_size
    pages = max(8, (mib << 20) // (page_bytes * model.buffers))
    slots = pages * model.page_size
    buffers = [
        torch.randint(0, 255, (slots, model.token_bytes), dtype=torch.uint8, device=device)
        for _ in range(model.buffers)
    ]
    return PagedKVPool(buffers, model.page_size, kv_dtype=torch.bfloat16)


def page_tables(num_pages: int) -> dict[str, list[int]]:
    rng = random.Random(0)
    in_order = list(range(num_pages))
    runs = [in_order[i : i + 8] for i in range(0, num_pages, 8)]
    rng.shuffle(runs)
    shuffled = in_order[:]
    rng.shuffle(shuffled)
    return {
        "in order": in_order,
        "runs of 8": [p for run in runs for p in run],
        "shuffled": shuffled,
    }


def cpu_rows(model: Model, mib: int, repeat: int) -> None:
    pool = build_pool(model, mib, "cpu")
    nbytes = pool.page_bytes * pool.num_pages
    torch.set_num_threads(1)
    int64_views = [buf.view(torch.int64) for buf in pool.buffers]
    read = best_seconds(lambda: [v.sum() for v in int64_views], repeat)
    views = [tensor_buffer(buf) for buf in pool.buffers]
    stdlib = best_seconds(lambda: [zlib.adler32(v) for v in views], max(1, repeat // 2))
    whole = best_seconds(lambda: [adler32(buf) for buf in pool.buffers], repeat)

    def row(label: str, seconds: float) -> None:
        gbps = nbytes / seconds / 1e9
        print(f"  {label:<34} {gbps:7.2f} GB/s  {read / seconds:5.2f}x read pass")

    chunk_kib = pool.layer_page_bytes[0] / 1024
    print(
        f"{model.name}: {nbytes / 2**20:.0f} MiB, {pool.num_pages} pages x {len(pool.buffers)} "
        f"buffers, {chunk_kib:g} KiB per page per buffer"
    )
    row("read pass (1 thread)", read)
    tables = page_tables(pool.num_pages)
    for name, table in tables.items():
        row(f"kvwatch per-page, {name}", best_seconds(lambda t=table: pool.checksum(t), repeat))
    # The same scattered table against a read pass over the same pages in the same order (the
    # physical limit of that access pattern), interleaved so drift hits both alike.
    ids = np.asarray(tables["shuffled"], dtype=np.uint64)
    addresses, lengths = pool.chunks(ids)
    read_pages = native_read()
    assert read_pages is not None, "engine_hooks._pageloop is not built"
    scattered_read = scattered_seal = float("inf")
    for _ in range(repeat):
        scattered_read = min(
            scattered_read, best_seconds(lambda: read_pages(addresses, lengths), 1)
        )
        scattered_seal = min(scattered_seal, best_seconds(lambda: pool.checksum(ids), 1))
    print(
        f"  {'read pass, same shuffled pages':<34} {nbytes / scattered_read / 1e9:7.2f} GB/s"
        f"  {read / scattered_read:5.2f}x read pass"
    )
    print(
        f"  {'kvwatch per-page, shuffled':<34} {nbytes / scattered_seal / 1e9:7.2f} GB/s"
        f"  {scattered_read / scattered_seal:5.2f}x the shuffled read pass (interleaved)"
    )
    # The previous CPU path, for comparison: one zlib-ng call from Python per page and buffer.
    shuffled = tables["shuffled"]
    chunks = [
        mv[p * w : (p + 1) * w]
        for mv, w in zip(views, pool.layer_page_bytes, strict=True)
        for p in shuffled
    ]
    row("Python call per page, shuffled", best_seconds(lambda: adler32_chunks(chunks), repeat))
    row("kvwatch adler32, whole buffers", whole)
    row("stdlib zlib.adler32", stdlib)


def headed_rows(mib: int, repeat: int) -> None:
    """llama-3-70b at TP 8 on the CPU: 80 layers, one KV head per rank, bf16, block 16; and 8
    KV heads (TP 1) in the same bytes, each per-layer buffer vLLM's HND ``[B, 2, H, N, D]``."""
    torch.set_num_threads(1)
    for heads in (1, 8):
        headed_case(heads, mib, repeat)


def headed_case(heads: int, mib: int, repeat: int) -> None:
    layers, tokens, dim = 80, 16, 128
    block = 2 * heads * tokens * dim * 2
    blocks = max(8, (mib << 20) // (block * layers))
    caches = [
        torch.randint(0, 255, (blocks, 2, heads, tokens, dim * 2), dtype=torch.uint8)
        for _ in range(layers)
    ]
    head_views = [c.permute(0, 2, 1, 3, 4) for c in caches]  # [B, H, 2, N, bytes]
    flat = [c.view(blocks, -1) for c in caches]
    pool = HeadedPool(flat, tokens, head_views, layout=Layout.PAGES, kv_dtype=torch.bfloat16)
    whole = PagedKVPool(flat, tokens, layout=Layout.PAGES, kv_dtype=torch.bfloat16)
    nbytes = block * blocks * layers
    table = page_tables(blocks)["runs of 8"]
    index = pool.as_index(table)
    int64_views = [c.view(torch.int64) for c in caches]
    paths: dict[str, tuple[str, Callable[[], object]]] = {
        "read": ("read pass (1 thread)", lambda: [v.sum() for v in int64_views]),
        "page": ("whole-page seal (one digest)", lambda: whole.checksum(table)),
        "host": (
            "per-head seal, CPU path (zlib-ng)",
            lambda: pool._host_head_digests(index, blocks),
        ),
        "device": (
            "per-head seal, device path on CPU",
            lambda: pool._device_head_digests(index, blocks),
        ),
    }
    timings = dict.fromkeys(paths, float("inf"))
    for _ in range(repeat):  # interleaved: drift hits every path alike
        for name, (_label, fn) in paths.items():
            timings[name] = min(timings[name], best_seconds(fn, 1))
    print(
        f"per-head seal, {layers} layers x {heads} KV head(s), bf16, block {tokens}, HND:"
        f" {nbytes / 2**20:.0f} MiB, {blocks} blocks (runs of 8)"
    )
    read, page = timings["read"], timings["page"]
    for name, (label, _fn) in paths.items():
        seconds = timings[name]
        print(
            f"  {label:<34} {nbytes / seconds / 1e9:7.2f} GB/s  {read / seconds:5.2f}x read pass"
            f"  {page / seconds:5.2f}x whole-page seal"
        )


def cuda_rows(model: Model, mib: int, repeat: int) -> None:
    pool = build_pool(model, mib, "cuda")
    nbytes = pool.page_bytes * pool.num_pages
    dst = [torch.empty_like(b) for b in pool.buffers]

    def timed(fn: Callable[[], object]) -> float:
        def run() -> None:
            fn()
            torch.cuda.synchronize()

        run()
        return best_seconds(run, repeat)

    copy = timed(lambda: [d.copy_(s) for d, s in zip(dst, pool.buffers, strict=True)])
    print(f"{model.name} on {torch.cuda.get_device_name()}: {nbytes / 2**20:.0f} MiB")
    print(f"  {'device-to-device copy':<34} {nbytes / copy / 1e9:7.1f} GB/s  1.00x copy")
    for name, table in page_tables(pool.num_pages).items():
        index = torch.tensor(table, device="cuda")
        seconds = timed(lambda i=index: pool.checksum(i))
        print(
            f"  {'kvwatch device path, ' + name:<34} {nbytes / seconds / 1e9:7.1f} GB/s  "
            f"{copy / seconds:5.2f}x copy"
        )


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    for model in MODELS:
        cpu_rows(model, args.mib, args.repeat)
    headed_rows(min(args.mib, 128), args.repeat)
    if torch.cuda.is_available():
        for model in MODELS:
            cuda_rows(model, args.mib, args.repeat)
    else:
        print("no CUDA device: the device path was not timed on a GPU")


if __name__ == "__main__":
    main()
