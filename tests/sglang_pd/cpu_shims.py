"""Test-bed shims that let a real SGLang 0.5.23 PD deployment run on a CPU-only machine.

Loaded the way SGLang loads any plugin: the ``sglang.srt.plugins`` entry point ``cpu_bed``
(a dist-info that tests/sglang_pd/setup_env.sh writes into the bed's venv only), selected by
``SGLANG_PLUGINS=kvwatch,cpu_bed``. Nothing here is part of kvwatch or its plugin; each shim
replaces one CUDA assumption of SGLang's (its transfer code's, and its start method's, which
spawns because CUDA cannot be forked; README.md beside this file lists them).
"""

from __future__ import annotations

import functools
import importlib
import logging
import multiprocessing
from typing import Any

from tests.nixl_cpu import progress_delay

logger = logging.getLogger("kvwatch.sglang_pd.cpu_bed")


def _mooncake_host_indices() -> None:
    """Mooncake's sender says it takes host tensors of page indices; prefill then builds them
    with ``pin_memory=True`` (``disaggregation/prefill.py``), which needs CUDA. Off: prefill
    passes plain indices, as for every other backend."""
    conn = importlib.import_module("sglang.srt.disaggregation.mooncake.conn")
    for cls in vars(conn).values():
        if isinstance(cls, type) and getattr(cls, "supports_host_tensor_indices", False):
            cls.supports_host_tensor_indices = False


def _dram(value: Any) -> Any:
    return "DRAM" if isinstance(value, str) and value == "VRAM" else value


def _nixl_dram() -> None:
    """SGLang's NIXL connector labels every KV buffer VRAM; on a CPU machine they are host
    memory, and UCX refuses host memory registered as VRAM. Every NIXL call that takes a
    memory kind gets DRAM instead."""
    api = importlib.import_module("nixl._api")
    agent = api.nixl_agent
    for name in (
        "register_memory",
        "deregister_memory",
        "get_reg_descs",
        "get_xfer_descs",
        "prep_xfer_dlist",
    ):
        method = getattr(agent, name, None)
        if method is None or getattr(method, "_cpu_bed", False):
            continue

        @functools.wraps(method)
        def as_dram(self: Any, *args: Any, _method: Any = method, **kwargs: Any) -> Any:
            args = tuple(_dram(a) for a in args)
            kwargs = {k: _dram(v) for k, v in kwargs.items()}
            return _method(self, *args, **kwargs)

        as_dram._cpu_bed = True  # type: ignore[attr-defined]
        setattr(agent, name, as_dram)


#: What the forkserver imports once per server, before it forks the scheduler and detokenizer.
FORKSERVER_PRELOAD = ["sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager"]


def _from_forkserver(result: Any, *args: Any, **kwargs: Any) -> Any:
    multiprocessing.set_start_method("forkserver", force=True)
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    return result


def _forkserver() -> None:
    """SGLang spawns its scheduler and detokenizer (``_set_envs_and_config``: CUDA cannot be
    forked), so each imports SGLang anew: 16 of the 48 CPU-seconds a server takes to start
    here, each. On a CPU there is nothing that cannot be forked: a forkserver imports SGLang
    once and forks both, and each still loads its plugins itself (``load_plugins`` in its
    ``run_*_process``), as a spawned one does. In the server's main process only."""
    if multiprocessing.parent_process() is not None:
        return
    hooks = importlib.import_module("sglang.srt.plugins.hook_registry")
    hooks.HookRegistry.register(
        "sglang.srt.entrypoints.engine._set_envs_and_config",
        _from_forkserver,
        hooks.HookType.AFTER,
    )


def register() -> None:
    for shim in (_mooncake_host_indices, _nixl_dram, progress_delay, _forkserver):
        try:
            shim()
        except ImportError as error:  # that transport is not installed: its shim is not needed
            logger.info("cpu_bed: %s skipped (%s)", shim.__name__, error)
