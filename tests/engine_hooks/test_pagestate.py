"""The host and device page-state backends agree on every operation (the device one on CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.engine_hooks.harness import backends_agree


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]
)
def test_backends_agree(dtype: torch.dtype) -> None:
    # The device backend as torch ops; as the Triton kernels in kernel_cases.py (interpreter).
    backends_agree(dtype, "mha", kernel=False, ops=400)


def test_scrub_of_runs_and_of_scattered_pages_agree() -> None:
    """The host backend zeroes runs of consecutive pages as slices, others by index."""
    import random

    from engine_hooks.pagestate import DevicePages, HostPages
    from tests.engine_hooks.harness import fill, make_pool

    host_pool, device_pool = (make_pool("mha", torch.bfloat16, 32) for _ in range(2))
    host, device = HostPages(host_pool), DevicePages(device_pool, kernel=False)
    for pages in ([3, 4, 5, 6, 7, 8, 9, 10, 20, 21, 22, 23, 24], [30, 1, 17, 2, 9], [31]):
        for pool in (host_pool, device_pool):
            fill(pool, range(32), random.Random(1))
            pool.mark_written(range(32), [5] * 32)
        host.scrub(pages)
        device.scrub(device.index(pages))
        for h, d in zip(host_pool.page_views, device_pool.page_views, strict=True):
            assert torch.equal(h, d)
            assert not h[pages].any()
            assert all(h[p].any() for p in range(32) if p not in pages)
        assert torch.equal(host_pool.tag_store, device_pool.tag_store)


def test_land_and_repoint_agree() -> None:
    """The tag writes of a transfer without tags (``land``) and of a re-pointed row
    (``repoint``): the same tags written, the same tags returned, in both backends."""
    from engine_hooks.pagestate import DevicePages, HostPages
    from tests.engine_hooks.harness import make_pool

    host_pool, device_pool = (make_pool("mha", torch.bfloat16, 16) for _ in range(2))
    host, device = HostPages(host_pool), DevicePages(device_pool, kernel=False)
    for state in (host, device):
        state.bump(state.index(range(16)))
        state.bump(state.index([3, 4, 9]))  # generations: 2 for 3, 4 and 9, 1 for the rest
    pages, gens = [1, 2, 3, 4], [7, 7, 8, 8]
    host.land(pages, gens, [False, True, False, True])
    device.land(device.index(pages), gens, torch.tensor([False, True, False, True]))
    assert host_pool.tag_store.tolist() == device_pool.tag_store.tolist()
    assert host_pool.tag_store[1:5].tolist() == [7, 0, 8, 0]
    host.land([5, 6], [3, 3])
    device.land(device.index([5, 6]), [3, 3])
    assert host_pool.tag_store.tolist() == device_pool.tag_store.tolist()
    # A row that read pages 1, 2, 3 with tags 5, 5, 5 now reads 1, 9, 3: page 9 moved.
    assert host.repoint([1, 2, 3], [1, 2, 3], [5, 5, 5]) is None
    host_tags = host.repoint([1, 9, 3], [1, 2, 3], [5, 5, 5])
    device_tags = device.repoint(device.index([1, 9, 3]), [1, 2, 3], [5, 5, 5])
    assert host_tags == device_tags.tolist() == [5, 2, 5]
    assert host_pool.tag_store.tolist() == device_pool.tag_store.tolist()
    assert host_pool.tag_store[9] == 2  # the moved page is written for its generation
