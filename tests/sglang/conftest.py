"""The SGLang stage: tests against the real SGLang release, run in build/sglang-venv.

``tests/sglang/setup_env.sh`` builds that environment; run the stage with
``KVWATCH_SGLANG_STAGE=1 build/sglang-venv/bin/python -m pytest tests/sglang``. The main test
run (``.venv``, no SGLang) does not collect these tests. Inside the SGLang stage a missing SGLang
is an error, never a silent skip.
"""

from __future__ import annotations

import importlib.util
import os
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

collect_ignore = ["stubs"]

if importlib.util.find_spec("sglang") is None:
    if os.environ.get("KVWATCH_SGLANG_STAGE") == "1":
        raise RuntimeError(
            "KVWATCH_SGLANG_STAGE=1 but sglang is not importable: run tests/sglang/setup_env.sh "
            "and use build/sglang-venv/bin/python"
        )
    collect_ignore_glob = ["test_*.py"]
else:
    from engine_hooks.sglang import compat

    if compat.version_tuple(compat.sglang_version()) < (0, 5, 22):
        # This release's alloc_extend / alloc_decode are Triton kernels with no torch fallback:
        # Triton's interpreter runs the release's own kernels on CPU tensors. Set before any
        # SGLang module defines a kernel (triton.jit reads it then).
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def sglang_plugins(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """SGLang's own ``load_plugins()``, once per session, finding kvwatch by its entry point."""
    os.environ["SGLANG_PLUGINS"] = "kvwatch"
    os.environ["KVWATCH_SPOOL"] = str(tmp_path_factory.mktemp("session-spool"))
    warnings.filterwarnings("ignore", category=UserWarning)
    from tests.sglang.sgl import published

    # This process is rank 0 of one-rank groups (what SGLang's launcher would publish); the
    # decode prealloc queue reads the attention group (no collective runs on one rank).
    one_rank = types.SimpleNamespace(cpu_group=None)
    with published(tp_rank=0, attn_tp_rank=0, pp_rank=0, pp_size=1, attn_tp_group=one_rank) as p:
        yield p


@pytest.fixture
def kv(sglang_plugins: Any, tmp_path: Path) -> Iterator[Any]:
    """A fresh kvwatch runtime (log mode) spooling to this test's own directory."""
    from engine_hooks.sglang import runtime
    from engine_hooks.sglang.config import from_env

    (tmp_path / "spool").mkdir()  # as the daemon's install would: the hooks never create it
    settings = from_env({"KVWATCH_MODE": "log", "KVWATCH_SPOOL": str(tmp_path / "spool")})
    rt = runtime.reset(settings)
    yield rt
    rt.close()


@pytest.fixture
def kv_enforce(sglang_plugins: Any, tmp_path: Path) -> Iterator[Any]:
    from engine_hooks.sglang import runtime
    from engine_hooks.sglang.config import from_env

    (tmp_path / "spool").mkdir()
    env = {"KVWATCH_MODE": "enforce", "KVWATCH_SPOOL": str(tmp_path / "spool")}
    rt = runtime.reset(from_env(env))
    yield rt
    rt.close()
