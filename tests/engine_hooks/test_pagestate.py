"""The host and device page-state backends agree on every operation (the device one on CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from engine_hooks import canary
from engine_hooks.pagestate import DevicePages, HostPages
from tests.engine_hooks.harness import make_pool


def as_list(values: object) -> list[object]:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)  # type: ignore[call-overload]


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]
)
@pytest.mark.parametrize(
    ("kind", "kernel", "ops"),
    # The device backend as torch ops, and as the Triton kernels (interpreter: fewer ops).
    [("mha", False, 400), ("mha", True, 60), ("mla", True, 60), ("vllm", True, 60)],
)
def test_backends_agree(dtype: torch.dtype, kind: str, kernel: bool, ops: int) -> None:
    host_pool, device_pool = make_pool(kind, dtype, 32), make_pool(kind, dtype, 32)
    host, device = HostPages(host_pool), DevicePages(device_pool, kernel=kernel)
    assert device.kernels is kernel
    rng = random.Random(3)
    for _ in range(ops):
        pages = rng.sample(range(32), rng.randint(1, 12))  # both sides of _BATCH_PAGES
        op = rng.choice(["bump", "stamp", "intact", "free", "own", "stale", "scribble"])
        h, d = host.index(pages), device.index(pages)
        purpose = rng.choice(list(canary.Purpose))
        if op == "bump":
            host.bump(h)
            device.bump(d)
        elif op == "stamp":
            host.stamp(h, host.generations(h), purpose)
            device.stamp(d, device.generations(d), purpose)
        elif op == "intact":
            assert host.intact(h, host.generations(h), purpose) == as_list(
                device.intact(d, device.generations(d), purpose)
            )
        elif op == "free":
            flag = rng.random() < 0.5
            assert host.set_free(h, flag) == as_list(device.set_free(d, flag))
        elif op == "own":
            host.own_writes(h)
            device.own_writes(d)
        elif op == "stale":
            expected = [rng.randint(0, 3) for _ in pages]
            assert host.stale(h, expected) == as_list(device.stale(d, torch.tensor(expected)))
        else:  # a write into the pages' stamp area, the same on both pools
            for pool in (host_pool, device_pool):
                for p in pages:
                    pool.page(p)[0][:4] = p % 7
        assert host.generations(list(range(32))) == as_list(
            device.generations(device.index(list(range(32))))
        )
    assert torch.equal(host_pool.page_views[0], device_pool.page_views[0])
    assert torch.equal(host_pool.tag_store, device_pool.tag_store)
