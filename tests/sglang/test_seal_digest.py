"""kvwatch's seal equals SGLang's own ``--disaggregation-enable-kv-checksum`` digest on real SGLang
pools: SGLang's transfer buffer list (``get_kv_transfer_buf_infos``) is the pool kvwatch describes,
buffer for buffer and page width for page width, and SGLang's digest over it (its kernel's
arithmetic, tests/engine_hooks/sglang_digest.py, on SGLang's own page indices) is the seal."""

from __future__ import annotations

import importlib.util
import random
import zlib
from typing import Any

import pytest
import torch

from engine_hooks.sglang.runtime import describe_pool
from tests.engine_hooks import sglang_digest
from tests.sglang import sgl


@pytest.mark.parametrize("kind", sorted(sgl.POOLS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_seal_is_sglangs_kv_checksum(kind: str, dtype: torch.dtype) -> None:
    present = importlib.util.find_spec("sglang.srt.disaggregation.checksum") is not None
    sgl.needs("0.5.21", present, "--disaggregation-enable-kv-checksum")
    from sglang.srt.disaggregation.checksum import _to_page_indices_gpu
    from sglang.srt.disaggregation.utils import get_kv_transfer_buf_infos

    kvcache: Any = sgl.POOLS[kind](dtype)
    pool, reason = describe_pool(kvcache, sgl.PAGE_SIZE)
    assert pool is not None, reason
    ptrs, _, item_lens = get_kv_transfer_buf_infos(kvcache)
    assert ptrs == [view.data_ptr() for view in pool.page_views]
    assert item_lens == pool.layer_page_bytes

    gen = torch.Generator().manual_seed(7)
    for buffer in pool.buffers:
        buffer.view(torch.uint8).copy_(
            torch.randint(0, 256, buffer.view(torch.uint8).shape, dtype=torch.uint8, generator=gen)
        )
    # A request's token slots as req_to_token holds them: whole pages, shuffled.
    pages = random.Random(kind).sample(range(1, pool.num_pages), 6)
    slots = torch.tensor([p * sgl.PAGE_SIZE + i for p in pages for i in range(sgl.PAGE_SIZE)])
    page_indices = _to_page_indices_gpu(slots, sgl.PAGE_SIZE)
    assert page_indices.tolist() == pages

    theirs = sglang_digest.digest(ptrs, item_lens, page_indices.tolist())
    stream = b"".join(view[p].numpy().tobytes() for view in pool.page_views for p in pages)
    assert theirs == zlib.adler32(stream)
    assert pool.checksum(pages) == theirs
    assert pool.device_checksum(page_indices, kernel=False) == theirs
