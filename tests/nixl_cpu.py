"""NIXL on a CPU test bed: the progress thread's delay, for both PD beds (vLLM's, SGLang's).

NIXL's Python agent sets its progress thread's delay to 0 (``pthrDelay``, ``nixl/_api.py``), so
the thread polls UCX without pause: a whole core per NIXL server, idle or not, which a 2-core
machine running three to five servers cannot spare (the engines' own steps then stall for
minutes). The thread stays (UCX over TCP needs it to land a transfer), with a delay of
:data:`PROGRESS_DELAY_US` instead. A test-bed shim, never part of kvwatch.
"""

from __future__ import annotations

import importlib
from typing import Any

#: NIXL's progress-thread delay (``pthrDelay``), in microseconds: the most the thread sleeps in
#: ``poll()`` when no UCX worker fd fired.
PROGRESS_DELAY_US = 1000


def progress_delay() -> None:
    """Every agent built through ``nixlBind.nixlAgent`` in this process (``nixl_agent``'s)
    gets :data:`PROGRESS_DELAY_US`. Raises ImportError where NIXL is not installed."""
    api = importlib.import_module("nixl._api")
    bindings = api.nixlBind
    create = bindings.nixlAgent
    if getattr(create, "_cpu_bed", False):
        return

    def with_delay(name: str, config: Any) -> Any:
        config.pthrDelay = PROGRESS_DELAY_US
        return create(name, config)

    with_delay._cpu_bed = True  # type: ignore[attr-defined]
    bindings.nixlAgent = with_delay
