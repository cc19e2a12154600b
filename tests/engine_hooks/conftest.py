"""The Triton kernels run under Triton's interpreter on CPU tensors in these tests: the flag
must be set before engine_hooks.kernels is first imported (triton.jit reads it then)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
