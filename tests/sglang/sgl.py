"""Real SGLang objects on CPU, built as minimally as their constructors allow."""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine_hooks.sglang import compat

PAGE_SIZE = 4
SIZE = 64  # token slots the allocator hands out: 16 pages, plus SGLang's padded page 0


def mha_pool(dtype: torch.dtype = torch.bfloat16, size: int = SIZE) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size=size,
        page_size=PAGE_SIZE,
        dtype=dtype,
        head_num=2,
        head_dim=8,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )


def mla_pool(dtype: torch.dtype = torch.bfloat16, size: int = SIZE) -> Any:
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool(
        size=size,
        page_size=PAGE_SIZE,
        dtype=dtype,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )


POOLS = {"mha": mha_pool, "mla": mla_pool}


def allocator(pool: Any, size: int = SIZE, need_sort: bool = False) -> Any:
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    return PagedTokenToKVPoolAllocator(size, PAGE_SIZE, pool.dtype, "cpu", pool, need_sort)


def needs(since: str, present: bool, what: str) -> None:
    """Skip where the installed release predates ``what`` (added in ``since``); from ``since`` on
    a missing point fails, so a point renamed in a newer release is never silently skipped."""
    version = compat.sglang_version()
    if not present and compat.version_tuple(version) < compat.version_tuple(since):
        pytest.skip(f"sglang {version} predates {what} ({since}+)")
    assert present, f"sglang {version} should have {what} ({since}+)"


def extend_on_cpu(alloc: Any) -> bool:
    """v0.5.22+ fall back to plain torch for alloc_extend/alloc_decode off CUDA; v0.5.19 runs
    its Triton kernels only, which need a GPU."""
    return getattr(alloc, "use_triton_kernels", True) is False


def extend(alloc: Any, tokens: int) -> torch.Tensor:
    """One request's prefill-sized allocation from an empty prefix, the way the scheduler and
    decode's prealloc make it (``alloc_extend``; ``alloc`` where that needs a GPU)."""
    if not extend_on_cpu(alloc):
        pages = -(-tokens // PAGE_SIZE)
        taken: torch.Tensor = alloc.alloc(pages * PAGE_SIZE)[:tokens]
        return taken
    out: torch.Tensor = alloc.alloc_extend(
        prefix_lens=torch.tensor([0]),
        prefix_lens_cpu=torch.tensor([0]),
        seq_lens=torch.tensor([tokens]),
        seq_lens_cpu=torch.tensor([tokens]),
        last_loc=torch.tensor([-1]),
        extend_num_tokens=tokens,
    )
    return out


def buffers(pool: Any) -> list[torch.Tensor]:
    k = getattr(pool, "k_buffer", None)
    if k is not None:
        return [*k, *pool.v_buffer]
    return list(pool.kv_buffer)


def write_page(pool: Any, page: int, value: float = 0.5) -> None:
    """A writer (prefill's RDMA write, a late write) fills every slot of a page, every layer."""
    for buf in buffers(pool):
        buf[page * PAGE_SIZE : (page + 1) * PAGE_SIZE] = value


def pages_of(token_indices: torch.Tensor) -> list[int]:
    return sorted({int(i) // PAGE_SIZE for i in token_indices.tolist()})


def request(rid: str, prompt_tokens: int = 8) -> Any:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    ids = array("q", [7] * prompt_tokens)
    # A PD request names its prefill's bootstrap server (not SGLang's fake-transfer host).
    return Req(
        rid,
        "",
        ids,
        SamplingParams(max_new_tokens=4),
        bootstrap_host="127.0.0.1",
        bootstrap_port=8998,
        bootstrap_room=abs(hash(rid)) % (1 << 62),
    )


def batch(reqs: list[Any]) -> Any:
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    return ScheduleBatch(reqs=reqs)


def spool(rt: Any) -> Any:
    """Everything the runtime's watches spooled so far (after a flush)."""
    from engine_hooks.testing import read_spool

    for watch in rt.all_watches:
        watch.flush()
    return read_spool(rt.settings.spool)


def counter(contents: Any, name: str, **labels: str) -> float:
    series = contents.latest_counters().get(name, {})
    return float(series.get(tuple(sorted(labels.items())), 0))


@contextlib.contextmanager
def published(**ranks: Any) -> Iterator[Any]:
    """This process's ranks published to SGLang's runtime context (what its launcher does),
    then kvwatch loaded by SGLang's own ``load_plugins()``; yields SGLang's plugins module."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    with contextlib.ExitStack() as stack:
        if hasattr(type(parallel), "override_permanently"):
            parallel.override_permanently(**ranks)
        else:  # v0.5.19: only the scoped override
            stack.enter_context(parallel.override(**ranks))
        from sglang.srt import plugins

        plugins.load_plugins()
        yield plugins
