"""The Triton kernels (under the interpreter, on CPU) against zlib and the torch paths: the seal
for every layout and dtype PagedKVPool knows, the batched tag compare and canary stamps, and the
device page-state backend built on them.

Run by ``test_kernels.py`` in a child pytest with ``TRITON_INTERPRET=1`` (the file name keeps the
main session from collecting it): ``pytest tests/engine_hooks/kernel_cases.py`` with the variable
set runs it by hand."""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_hooks import canary, kernels
from engine_hooks.pagestate import DevicePages
from engine_hooks.pool import PagedKVPool
from tests.engine_hooks import sglang_digest
from tests.engine_hooks.harness import backends_agree, fill, make_pool

KINDS = ["mha", "mla", "vllm"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


def host_bytes(pool: PagedKVPool, pages: list[int]) -> bytes:
    """The seal's stream, copied to the host: buffer by buffer, pages in page-table order."""
    return b"".join(view[p].numpy().tobytes() for view in pool.page_views for p in pages)


if not kernels.interpreted():  # pragma: no cover - a one-line reason instead of odd failures
    raise RuntimeError("kernel_cases.py runs with TRITON_INTERPRET=1 set (test_kernels.py does)")


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]
)
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_backend_agrees_with_the_host_backend(dtype: torch.dtype, kind: str) -> None:
    backends_agree(dtype, kind, kernel=True, ops=60)  # the interpreter is slow: fewer ops


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_seal_matches_zlib_for_every_layout_and_dtype(kind: str, dtype: torch.dtype) -> None:
    pool = make_pool(kind, dtype, 12)
    rng = random.Random(f"{kind}{dtype}")
    fill(pool, range(12), rng)
    table = rng.sample(range(12), 7)  # shuffled, a subset
    expected = zlib.adler32(host_bytes(pool, table))
    assert pool.device_checksum(table, kernel=True) == expected
    assert pool.device_checksum(table, kernel=False) == expected  # the torch fallback
    assert pool.checksum(table) == expected  # zlib-ng on the host
    value = rng.randrange(2**32)
    assert pool.device_checksum(table, value, kernel=True) == zlib.adler32(
        host_bytes(pool, table), value
    )


def raw_pool(widths: list[int], pages: int, seed: int, fill_byte: int | None) -> PagedKVPool:
    gen = torch.Generator().manual_seed(seed)
    buffers = [
        torch.full((pages, w), fill_byte, dtype=torch.uint8)
        if fill_byte is not None
        else torch.randint(0, 256, (pages, w), dtype=torch.uint8, generator=gen)
        for w in widths
    ]
    return PagedKVPool(buffers, 1, layout="pages")


@settings(max_examples=12, deadline=None)
@given(
    st.lists(st.sampled_from([1, 17, 2048, 2049, 5000]), min_size=1, max_size=3),
    st.integers(1, 5),
    st.integers(0, 2**31),
    st.sampled_from([None, 0xFF]),
    st.one_of(st.just(1), st.integers(0, 0xFFFFFFFF)),
)
def test_seal_on_odd_widths_matches_zlib(
    widths: list[int], pages: int, seed: int, fill_byte: int | None, value: int
) -> None:
    """Buffers of different page widths, not multiples of the load block; all-0xFF bytes (the
    largest sums); any start value."""
    pool = raw_pool(widths, pages, seed, fill_byte)
    table = random.Random(seed).choices(range(pages), k=pages + 1)  # repeats allowed
    assert pool.device_checksum(table, value, kernel=True) == zlib.adler32(
        host_bytes(pool, table), value
    )


def test_seal_over_several_programs_per_page() -> None:
    """A page wider than one program's chunk: partials of one page combined in order."""
    width = 2 * kernels.SEAL_CHUNK + 333
    pool = raw_pool([width, 100], 2, 5, None)
    for table in ([0, 1], [1, 0], [1]):
        assert pool.device_checksum(table, kernel=True) == zlib.adler32(host_bytes(pool, table))


@pytest.mark.parametrize("widths", [[17, 2049, 5000], [2 * kernels.SEAL_CHUNK + 333, 100]])
def test_scrub_zeroes_exactly_the_pages_in_every_buffer(widths: list[int]) -> None:
    """The scrub's one launch, over odd widths and pages wider than one program's chunk."""
    pool = raw_pool(widths, 5, 3, None)
    before = [view.clone() for view in pool.page_views]
    kernels.scrub(kernels.PageTables(pool.page_views), torch.tensor([3, 0]))
    kernels.scrub(kernels.PageTables(pool.page_views), torch.tensor([], dtype=torch.int64))
    for view, old in zip(pool.page_views, before, strict=True):
        assert not view[[0, 3]].any()
        assert torch.equal(view[[1, 2, 4]], old[[1, 2, 4]])


def test_seal_of_no_pages_and_of_a_bad_page_id() -> None:
    pool = raw_pool([64], 4, 1, None)
    assert pool.device_checksum([], kernel=True) == 1
    assert pool.device_checksum([], 0xFFF1FFF1, kernel=True) == zlib.adler32(b"", 0xFFF1FFF1)
    # An id outside the pool reads nothing: the digest cannot equal the one of real pages.
    good = pool.device_checksum([0, 1], kernel=True)
    assert pool.device_checksum([0, 99], kernel=True) != good
    assert pool.device_checksum([-1, 1], kernel=True) != good


def test_seal_reads_the_bytes_it_seals() -> None:
    pool = make_pool("mha", torch.bfloat16, 8)
    fill(pool, range(8), random.Random(2))
    before = pool.device_checksum([3, 5], kernel=True)
    pool.page(5)[-1][-1] ^= 1  # one bit in the last buffer's last byte
    assert pool.device_checksum([3, 5], kernel=True) != before
    assert pool.device_checksum([3, 5], kernel=True) == zlib.adler32(host_bytes(pool, [3, 5]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_canary_kernel_writes_the_torch_stamps(kind: str, dtype: torch.dtype) -> None:
    pool = make_pool(kind, dtype, 16)
    pages = torch.tensor([9, 2, 15, 0])
    gens = torch.tensor([0, 7, 2**40, 3])
    area = pool.page_views[0]
    for purpose in canary.Purpose:
        kernels.canary(area, pages, gens, purpose, pool.kv_dtype, stamp=True)
        assert torch.equal(
            area[pages, : canary.STAMP_BYTES], canary.stamps(pages, gens, purpose, pool.kv_dtype)
        )
        intact = kernels.canary(area, pages, gens, purpose, pool.kv_dtype, stamp=False)
        assert intact.tolist() == [True] * 4
        other = 1 - list(canary.Purpose).index(purpose)
        wrong = kernels.canary(
            area, pages, gens, list(canary.Purpose)[other], pool.kv_dtype, stamp=False
        )
        assert wrong.tolist() == [False] * 4
    area[2, 5] ^= 0x01  # a write into one stamp
    intact = kernels.canary(area, pages, gens, canary.Purpose.RESERVED, pool.kv_dtype, stamp=False)
    assert intact.tolist() == [True, False, True, True]


def test_tag_kernel_matches_torch() -> None:
    rng = random.Random(4)
    generation = torch.tensor([rng.randint(0, 3) for _ in range(300)])
    written = torch.tensor([rng.randint(0, 3) for _ in range(300)])
    pages = torch.tensor([rng.randrange(300) for _ in range(517)])
    expected = torch.tensor([rng.randint(0, 3) for _ in range(517)])
    want = (generation[pages] != expected) | (written[pages] != expected)
    assert torch.equal(kernels.stale_tags(generation, written, pages, expected), want)
    assert kernels.stale_tags(generation, written, pages[:0], expected[:0]).numel() == 0


def test_torch_path_when_triton_is_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVWATCH_TRITON", "0")
    assert not kernels.available(torch.device("cuda"))
    monkeypatch.setenv("KVWATCH_TRITON", "1")
    assert kernels.available(torch.device("cuda")) and not kernels.available(torch.device("cpu"))
    pool = make_pool("mha", torch.bfloat16, 4)
    assert not DevicePages(pool).kernels  # CPU tensors: the kernels only when asked for


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_sglang_digest_equals_the_seal(kind: str, dtype: torch.dtype) -> None:
    """SGLang's own KV checksum (its kernel's arithmetic, over its item list) is Adler-32 of the
    same stream: equal to kvwatch's seal, kernel and torch paths, when SGLang's buffer list and
    item lengths are the pool's buffers and page widths (tests/sglang checks they are)."""
    pool = make_pool(kind, dtype, 12)
    rng = random.Random(kind)
    fill(pool, range(12), rng)
    table = rng.sample(range(12), 9)
    ptrs = [view.data_ptr() for view in pool.page_views]
    theirs = sglang_digest.digest(ptrs, pool.layer_page_bytes, table)
    assert theirs == zlib.adler32(host_bytes(pool, table))
    assert pool.device_checksum(table, kernel=True) == theirs
    assert pool.device_checksum(table, kernel=False) == theirs


def test_sglang_item_arithmetic_on_unaligned_and_long_items() -> None:
    """Their head/vector/tail split and the every-4096-vectors reduction, against zlib."""
    raw = torch.randint(0, 256, (3 * 65536 + 3,), dtype=torch.uint8)
    raw[:70000] = 0xFF
    for start, length in [(1, 100), (3, 65536 + 29), (0, 3 * 65536), (5, 7)]:
        item = raw[start : start + length]
        a, b, n = sglang_digest.compute(item.data_ptr(), length)
        assert (b << 16 | a, n) == (zlib.adler32(item.numpy().tobytes()), length)
