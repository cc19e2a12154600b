"""``bench/gpu_check.py --dry``: the device check kit runs end to end on CPU (small sizes, the
Triton interpreter) and every correctness check in it passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from minipd.launch import child_env

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=child_env(),
    )
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "gpu-check: 0 failed check(s)" in out
    for section in ("== 1. correctness", "== 2. seal throughput", "== 3. per-decode-step",
                    "== 4. minipd"):  # fmt: skip
        assert section in out
    # Every layout and dtype, sealed by the kernel and the torch path, equal to zlib.
    for kind in ("mha", "mla", "vllm"):
        for dtype in ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"):
            assert f"ok   seal {kind} {dtype}:" in out
    assert "FAIL" not in out
    assert "caught by canary" in out and "the leak reproduced" in out
