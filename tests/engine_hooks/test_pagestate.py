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
