"""Per-(page, KV head) seals: zlib-exact, layout-independent, recombinable across TP widths."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_hooks import page_digests_digest
from engine_hooks.heads import HeadedPool, RowAdler, head_range, pack, unpack
from engine_hooks.pool import Layout

PAGES, HEADS, TOKENS, CONTENT, LAYERS = 6, 4, 3, 5, 2


def views(data: torch.Tensor, order: str) -> list[torch.Tensor]:
    """Per layer a logical ``[B, H, N, C]`` view of ``data`` (``[L, B, H, N, C]``) stored in
    ``order`` ("HNC": heads outer in a block, HND; "NHC": tokens outer, NHD)."""
    if order == "HNC":
        stored = data.clone()
        return [stored[layer] for layer in range(data.shape[0])]
    stored = data.permute(0, 1, 3, 2, 4).contiguous()  # [L, B, N, H, C] in memory
    return [stored[layer].permute(0, 2, 1, 3) for layer in range(data.shape[0])]


def pool_of(layer_views: list[torch.Tensor], head_start: int = 0) -> HeadedPool:
    buffers = [v.as_strided((v.shape[0], v[0].numel()), (v.stride(0), 1)) for v in layer_views]
    return HeadedPool(buffers, TOKENS, layer_views, head_start=head_start, layout=Layout.PAGES)


def expected(data: torch.Tensor, page: int, head: int) -> int:
    """zlib over the head's cells: layer by layer, token, content, as bytes."""
    cells = b"".join(
        data[layer, page, head].contiguous().view(torch.uint8).numpy().tobytes()
        for layer in range(LAYERS)
    )
    return zlib.adler32(cells)


def kv(seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((LAYERS, PAGES, HEADS, TOKENS, CONTENT), generator=gen).to(dtype)


@pytest.mark.parametrize("order", ["HNC", "NHC"])
def test_head_digests_are_zlib_over_the_logical_cells(order: str) -> None:
    data = kv(1)
    pool = pool_of(views(data, order))
    got = pool.head_digests([4, 1, 2])
    assert got == tuple(tuple(expected(data, p, h) for h in range(HEADS)) for p in (4, 1, 2))
    # The page digest is composed of the head digests, whatever the memory layout.
    assert pool.page_digests([4]) == (page_digests_digest(got[0]),)


def test_a_layout_does_not_change_the_digest_and_a_byte_does() -> None:
    data = kv(2)
    hnd, nhd = pool_of(views(data, "HNC")), pool_of(views(data, "NHC"))
    assert hnd.head_digests(range(PAGES)) == nhd.head_digests(range(PAGES))
    data[1, 3, 2, 0, 4] += 1
    changed = pool_of(views(data, "NHC")).head_digests([3])[0]
    before = hnd.head_digests([3])[0]
    assert [a != b for a, b in zip(changed, before, strict=True)] == [False, False, True, False]


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(1, 2), (2, 1), (2, 2), (4, 2), (1, 4)])
def test_a_reader_of_any_width_recombines_the_writers_heads(writer_tp: int, reader_tp: int) -> None:
    data = kv(3)
    sealed: dict[int, int] = {}  # global head -> digest of page 5
    for rank in range(writer_tp):
        start, count = head_range(rank, writer_tp, HEADS)
        shard = data[:, :, start : start + count]
        rows = unpack(pack(pool_of(views(shard, "NHC"), start).head_digests([5])), 1, count)
        assert rows is not None
        sealed.update({start + j: rows[0][j] for j in range(count)})
    for rank in range(reader_tp):
        start, count = head_range(rank, reader_tp, HEADS)
        reader = pool_of(views(data[:, :, start : start + count], "HNC"), start)
        want = page_digests_digest([sealed[h] for h in range(start, start + count)])
        assert reader.page_digests([5]) == (want,)


def test_head_range_shards_and_replicates_as_the_engines_do() -> None:
    assert [head_range(r, 2, 8) for r in range(2)] == [(0, 4), (4, 4)]
    assert [head_range(r, 8, 2) for r in range(8)] == [(0, 1)] * 4 + [(1, 1)] * 4
    assert head_range(0, 1, 8) == (0, 8)


def test_unpack_refuses_what_pack_did_not_write() -> None:
    text = pack([[1, 2], [3, 0xFFFFFFFF]])
    assert unpack(text, 2, 2) == [[1, 2], [3, 0xFFFFFFFF]]
    assert unpack(text, 3, 2) is None
    assert unpack("not base64!", 1, 1) is None
    assert unpack(text, 2, 0) is None


@settings(max_examples=40, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=300), min_size=1, max_size=5))
def test_row_adler_folds_like_zlib_over_the_concatenation(chunks: list[bytes]) -> None:
    state = RowAdler(2, torch.device("cpu"))
    for chunk in chunks:
        row = np.frombuffer(chunk, dtype=np.uint8)
        state.fold(torch.from_numpy(np.stack([row, row[::-1].copy()])).reshape(2, len(chunk)))
    joined = b"".join(chunks)
    reversed_rows = b"".join(c[::-1] for c in chunks)
    assert state.digests().tolist() == [zlib.adler32(joined), zlib.adler32(reversed_rows)]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    order=st.sampled_from(["HNC", "NHC"]),
    pages=st.lists(st.integers(0, PAGES - 1), min_size=1, max_size=PAGES),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.uint8]),
)
def test_the_host_and_device_sums_agree(
    seed: int, order: str, pages: list[int], dtype: torch.dtype
) -> None:
    """The CPU's zlib-ng path and the device's RowAdler path (run here on CPU tensors) give the
    same digests for any pages, layout and element type: the seal a GPU prefill writes is the
    one a CPU reader checks."""
    data = kv(seed, torch.float32).mul(64).to(dtype)
    pool = pool_of(views(data, order))
    index = pool.as_index(pages)
    host = pool._host_head_digests(index, len(pages))
    assert host == pool._device_head_digests(index, len(pages))
    assert host == tuple(tuple(expected(data, p, h) for h in range(HEADS)) for p in pages)
