"""The Triton kernels, run in Triton's interpreter on CPU tensors: the cases in kernel_cases.py,
in a child pytest started with ``TRITON_INTERPRET=1``.

triton reads the variable when ``triton.language`` is imported (its own jit functions, ``tl.sum``
among them, are built interpreted or compiled then) and when each kernel is defined, so the
choice holds for the life of a process. Set in this session it would reach every later test and
every process they start, and the kernels' tests would pass or fail by whether something had
imported triton before them; a child process has it from its start and takes it to its end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from minipd.launch import child_env

CASES = Path(__file__).with_name("kernel_cases.py")


def test_kernels_under_the_interpreter() -> None:
    assert os.environ.get("TRITON_INTERPRET") is None, "this session itself runs compiled triton"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
        cwd=CASES.parents[2],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env=dict(child_env(), TRITON_INTERPRET="1"),
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout.splitlines()[-1]
